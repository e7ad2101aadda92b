"""examples/pretrain_gpt with --overlap-grad-reduce (ds_config "zero_optimization.overlap_comm"):
the runtime's all-reduce runs in buckets launched during the last micro-batch's backward. It must
give the losses of the reduction after the backward, through a kill and a hang while buckets are
in flight, and with a covering rank whose attention gradients never arrive. Real processes."""

import json

import pytest

from tests.data.pretrain import losses, pretrain

pytestmark = [pytest.mark.dist, pytest.mark.fault]

EXACT = ["--mecefo", "--no-mecefo-skip-attention", "--no-mecefo-lowrank-ffn", "--mecefo-recompute-ffn", "never"]
THREE = ["--global-batch-size", "12", "--train-iters", "8", "--eval-interval", "8"]
OVERLAP = ["--overlap-grad-reduce", "--ddp-bucket-size", "20000"]


def steps_of(log_dir, rank):
    return {r["step"]: r for r in map(json.loads, (log_dir / f"steps_rank{rank}.jsonl").read_text().splitlines())}


def assert_same_losses(got, want):
    assert sorted(got) == sorted(want) == list(range(1, 9))
    assert [got[i] for i in want] == pytest.approx([want[i] for i in want], rel=1e-5)


def test_buckets_in_flight_through_a_kill_and_a_hang(tmp_path):
    """3 replicas, approximations off: rank 1 SIGKILLed as it launches its first bucket of step 3,
    and (another run) rank 2 hung in step 5's buckets: the step fails like any reduction, the
    survivors redo it and the losses are the run's without overlap; every healthy step launched all
    its buckets during the backward."""
    want = losses(pretrain(tmp_path / "plain", 3, *EXACT, *THREE).stdout)
    logs = tmp_path / "logs"
    killed = pretrain(tmp_path / "killed", 3, *EXACT, *THREE, *OVERLAP, "--mecefo-inject", "kill:1:3:allreduce",
                      "--mecefo-log-dir", str(logs))
    assert "cover 1->2" in killed.stdout
    assert_same_losses(losses(killed.stdout), want)
    early = {s: r["overlapped_buckets"] for s, r in steps_of(logs, 0).items()}
    assert early[0] >= 3 and all(early[s] == early[0] for s in range(8))
    hung = pretrain(tmp_path / "hung", 3, *EXACT, *THREE, *OVERLAP, "--mecefo-inject", "hang:2:5:allreduce",
                    "--mecefo-collective-timeout-s", "5", "--mecefo-agree-timeout-s", "20")
    assert "cover 2->0" in hung.stdout
    assert_same_losses(losses(hung.stdout), want)


def test_a_covering_rank_launches_in_the_same_order(tmp_path):
    """Approximations on, rank 1 killed at step 3: rank 2 covers it, and the covered micro-batches
    skip the attention backward, so its buckets holding attention weights complete only at the
    backward's end. It launches them, and the later ones, then, in the order rank 0 launches all of
    them during its backward (one order for every member: a different order would mismatch the
    collectives). The losses are those of the same kill without overlap."""
    kill = ["--mecefo", "--mecefo-inject", "kill:1:3", *THREE]
    want = losses(pretrain(tmp_path / "plain", 3, *kill).stdout)
    logs = tmp_path / "logs"
    out = pretrain(tmp_path / "overlap", 3, *kill, *OVERLAP, "--mecefo-log-dir", str(logs))
    assert_same_losses(losses(out.stdout), want)
    exact, covering = steps_of(logs, 0), steps_of(logs, 2)
    assert all(m[2] for m in covering[5]["micro_batches"] if m[0] == 1)  # rank 1's micro-batches, approximated
    assert exact[5]["overlapped_buckets"] == exact[0]["overlapped_buckets"]
    assert covering[5]["overlapped_buckets"] < covering[0]["overlapped_buckets"]
