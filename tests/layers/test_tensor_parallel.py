"""TP=2 over gloo, two real processes: exact parity with stock, per-shard low-rank gradients."""

import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parents[2]


def test_tensor_parallel_2(tmp_path):
    world = 2
    store = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True, timeout=timedelta(seconds=60), wait_for_workers=False)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    outs = [tmp_path / f"rank{r}.json" for r in range(world)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.layers.tp_worker", str(r), str(world), str(store.port), str(outs[r])],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for r in range(world)
    ]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=240)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} failed:\n{logs[r][-4000:]}"
    reports = [json.loads(o.read_text()) for o in outs]
    for rep in reports:
        assert rep["exact_compared"] == 2 * 15  # 2 steps x every parameter of the tiny GPT
        assert rep["lowrank_compared"] == 4  # fc1 + fc2 in both layers
        # fc1 (SwiGLU, 2 x 96 outputs) is split over the two ranks: 96 x 64 local
        assert rep["fc1_local_shape"] == [96, 64]
    assert reports[0]["exact_losses"] == reports[1]["exact_losses"]
