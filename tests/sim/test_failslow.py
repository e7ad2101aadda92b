"""The simulator's fail-slow model: exact step times on a small job, the reduced planner against
the whole fold, the watch's thresholds, job-wide episodes, calibration."""

import random

import pytest

from megatron_mecefo.elastic.plan.cover_plan import Costs
from megatron_mecefo.elastic.plan.fold import Fold, MicroBatch
from megatron_mecefo.elastic.plan.rebalance import rebalance, replica_times
from megatron_mecefo.elastic.plan.topology import Grid
from megatron_mecefo.sim import failslow as fs

pytestmark = pytest.mark.unit

GRID = Grid(tp=1, pp=1, dp=4)
HOUR = 3600.0


def test_one_slow_replica_exact():
    """Replica 0 at 2x for an hour of ten, D = 4, k = 8, 10-s steps, window 5."""
    trace = [fs.Slow(t=HOUR, gpu=0, factor=2.0, duration_s=HOUR)]
    without = fs.run(trace, GRID, 10, step_s=10.0)
    assert without["slowdown"] == pytest.approx(36000 / (3600 + 1800 + 28800))
    assert without["replans"] == 0
    with_ = fs.run(trace, GRID, 10, step_s=10.0, policy=fs.Rebalance(threshold=1.2, window=5))
    # 5 steps at 2x (100 s) before the plan; then 5 micro-batches on the slow replica, 9 on the
    # others: 10/8 = 1.25; after it recovers, 5 steps at 9/8 (56.25 s) until the plan is even again
    progress = 3600 + 100 / 2 + (7200 - 3700) / 1.25 + 56.25 / 1.125 + (36000 - 7256.25)
    assert with_["slowdown"] == pytest.approx(36000 / progress)
    assert with_["replans"] == 2


def test_below_threshold_and_job_wide_are_not_rebalanced():
    mild = [fs.Slow(t=HOUR, gpu=1, factor=1.15, duration_s=HOUR)]
    wide = [fs.Slow(t=HOUR, gpu=1, factor=2.0, duration_s=HOUR, job_wide=True)]
    policy = fs.Rebalance(threshold=1.2, window=5)
    for trace in (mild, wide):
        a, b = fs.run(trace, GRID, 10), fs.run(trace, GRID, 10, policy=policy)
        assert a["slowdown"] > 1.0
        assert b["slowdown"] == pytest.approx(a["slowdown"]) and b["replans"] == 0


def test_reduced_fold_gives_the_whole_folds_step_time():
    """The planner on the slow replicas plus the healthy ones that can receive gives what it gives on
    every replica (the claim in failslow.py)."""
    rng = random.Random(0)
    grid, k = Grid(tp=1, pp=1, dp=24), 6
    for _ in range(60):
        job = fs._Job(grid, k, fs.Rebalance())
        for r in rng.sample(range(grid.dp), rng.randint(1, 6)):
            job.active[r] = [rng.uniform(1.0, 3.0)]
            if rng.random() < 0.7:
                job.planned[r] = rng.uniform(1.2, 3.0)
        whole = Fold({r: tuple(MicroBatch(r, j, False) for j in range(k)) for r in range(grid.dp)},
                     divisor=grid.dp * k, divisor_mha=grid.dp * k)
        plan = rebalance(whole, job.planned, Costs())
        truth = {r: job.factor(r) for r in range(grid.dp)}
        expected = max(replica_times(plan, Costs(), truth).values()) / k if job.planned else max(truth.values())
        assert job.step_time() == pytest.approx(expected)


def test_calibrate_meets_the_target():
    grid = Grid(tp=8, pp=1, dp=16)
    model = fs.calibrate(grid, 240, 2, target=1.2)
    assert fs.mean_slowdown(model, grid, 240, 2) == pytest.approx(1.2, rel=0.02)
    assert fs.mean_slowdown(fs.FailSlowModel(model.per_gpu_per_hour * 4), grid, 240, 2) > 1.2


def test_bad_model_refused():
    with pytest.raises(ValueError, match="severity"):
        fs.FailSlowModel(1e-4, severity=(0.9, 2.0))
    with pytest.raises(ValueError, match="job_wide_share"):
        fs.FailSlowModel(1e-4, job_wide_share=1.5)
