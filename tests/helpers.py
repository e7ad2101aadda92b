"""Helpers shared by the tests: tiny sizes, batches, losses, gradient snapshots."""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_mecefo.testing.launch import free_port, run_launcher  # noqa: F401  (the tests' runner)

ROOT = Path(__file__).resolve().parents[1]

TINY = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96)
VOCAB, SEQ = 128, 16


def make_batch(seed: int, batch: int = 2, seq: int = SEQ, vocab: int = VOCAB):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq), generator=g)
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    position_ids = torch.arange(seq).expand(batch, seq)
    return tokens, position_ids, labels


def gpt_loss(model, batch) -> torch.Tensor:
    tokens, position_ids, labels = batch
    return model(tokens, position_ids, None, labels=labels).float().mean()


def grads(model):
    return {n: (None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()}


def two_nodes_lose_one(tmp_path, script_args, *, victim_node: int, start_s: float = 120, finish_s: float = 150):
    """A head-node store (`mecefo-store`) and two launchers over loopback (2 ranks each,
    --external-store) running `script_args`. Once rank 2 has logged 3 steps in `tmp_path`, the
    launcher of `victim_node` is SIGKILLed (its ranks die with it). Returns the store's process and
    the surviving launcher's CompletedProcess."""
    import os
    import signal
    import subprocess
    import sys
    import time

    port = free_port()
    store = subprocess.Popen([sys.executable, "-m", "megatron_mecefo.elastic.launch.store_daemon", "--host", "127.0.0.1",
                              "--port", str(port), "--grace", "1"], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert store.stdout.readline().startswith("ready: the store of job")
    nodes = [subprocess.Popen(
        [sys.executable, "-m", "megatron_mecefo.elastic.launch", "--nnodes", "2", "--node-rank", str(i),
         "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port), "--external-store",
         *map(str, script_args)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True) for i in (0, 1)]
    survivor = nodes[1 - victim_node]
    try:
        deadline = time.monotonic() + start_s
        log = tmp_path / "steps_rank2.jsonl"
        while not log.exists() or len(log.read_text().splitlines()) < 3:
            assert time.monotonic() < deadline and all(n.poll() is None for n in nodes), "the job did not train"
            time.sleep(0.1)
        os.kill(nodes[victim_node].pid, signal.SIGKILL)  # the launcher only: its ranks must die with it
        out, err = survivor.communicate(timeout=finish_s)
    finally:
        for n in nodes:
            if n.poll() is None:
                os.killpg(n.pid, signal.SIGKILL)
    return store, subprocess.CompletedProcess(survivor.args, survivor.returncode, out, err)
