"""Helpers shared by the tests: tiny sizes, batches, losses, gradient snapshots."""

from __future__ import annotations

from pathlib import Path

import torch

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


def run_launcher(cmd, timeout):
    """Run a launcher command in its own session; on timeout kill the whole process group."""
    import os
    import signal
    import subprocess

    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"timed out after {timeout} s:\n{out[-2000:]}\n{err[-4000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
