"""A lost store (`mecefo-store` SIGKILLed mid-run) ends the job with a checkpoint and a clear message.

The ranks need no store on a healthy step, so they learn the loss from their heartbeat thread (or
the lowest member's one store call per step); the flag rides the step's confirmation all-reduce, so
every member ends before committing the same step, and the lowest member's replica writes the
checkpoint of the last committed step without asking the store who should.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from megatron_mecefo.log import read_jsonl
from megatron_mecefo.testing import toy_train
from tests.helpers import ROOT, free_port

pytestmark = [pytest.mark.dist, pytest.mark.fault]

FAST = ["--mecefo-collective-timeout-s", "4", "--mecefo-heartbeat-interval-s", "0.2",
        "--mecefo-heartbeat-timeout-s", "1.5", "--mecefo-agree-timeout-s", "30"]


@pytest.mark.parametrize("sharded", [False, True], ids=["replicated", "sharded"])
def test_a_killed_store_ends_the_job_with_a_checkpoint_and_a_message(tmp_path, sharded):
    """Sharded: the step's vote is in the store, so the members confirm in a collective that each
    read the commit; a store lost before or during the vote stops every shard at one step, and each
    holder writes its ranges of that step beside the writer's checkpoint."""
    port = free_port()
    store = subprocess.Popen([sys.executable, "-m", "megatron_mecefo.elastic.launch.store_daemon", "--host", "127.0.0.1",
                              "--port", str(port), "--grace", "1"], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert store.stdout.readline().startswith("ready: the store of job")
    launcher = subprocess.Popen(
        [sys.executable, "-m", "megatron_mecefo.elastic.launch", "--nproc-per-node", "3", "--master-addr",
         "127.0.0.1", "--master-port", str(port), "--external-store", str(toy_train.__file__), "--out", str(tmp_path),
         "--steps", "400", "--k", "2", "--mb", "4", "--step-sleep", "0.02", *(["--sharded"] if sharded else []),
         "--mecefo", *FAST],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        log = tmp_path / "steps_rank0.jsonl"
        deadline = time.monotonic() + 180
        while not log.exists() or len(log.read_text().splitlines()) < 3:  # keyed to the event, not a time
            assert time.monotonic() < deadline and launcher.poll() is None, "the job did not train"
            time.sleep(0.05)
        store.send_signal(signal.SIGKILL)
        out, err = launcher.communicate(timeout=120)
    finally:
        for p in (launcher, store):
            if p.poll() is None:
                os.killpg(launcher.pid, signal.SIGKILL) if p is launcher else p.kill()
    assert launcher.returncode == 3, err[-3000:]
    assert "stopped answering" in err and "restart the job from the checkpoint" in err, err[-3000:]
    assert "checkpoint of the last committed step written to" in err and "no checkpoint was written" not in err
    committed = [len(read_jsonl(tmp_path / f"steps_rank{r}.jsonl")) for r in range(3)]
    assert len(set(committed)) == 1 and committed[0] < 400, committed  # all stopped at one step, early
    ckpt = torch.load(tmp_path / "checkpoint_rank0.pt", weights_only=False)
    assert ckpt["step"] == committed[0]
    assert not any((tmp_path / f"checkpoint_rank{r}.pt").exists() for r in (1, 2))  # one writer, agreed
    gave_up = [e for r in range(3) for e in read_jsonl(tmp_path / f"events_rank{r}.jsonl") if e["event"] == "gave_up"]
    assert sorted(e["rank"] for e in gave_up) == [0, 1, 2] and {e["kind"] for e in gave_up} == {"StoreLost"}
    if sharded:  # every holder's ranges (and the neighbour's copies), at the checkpoint's step, covering all
        shards = [torch.load(tmp_path / f"giveup_shards_rank{r}.pt", weights_only=False) for r in range(3)]
        assert {s["step"] for s in shards} == {committed[0]}
        ranges = sorted({(start, end) for s in shards for start, end, *_ in s["shards"]})
        n_params = sum(p.numel() for p in ckpt["params"])
        assert ranges[0][0] == 0 and ranges[-1][1] == n_params and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
