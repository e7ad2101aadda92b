"""Fail-slow planning: the moves against brute force (equal costs: the least slowest time there
is), the invariants of any move (every micro-batch once, in its mode, the divisors), and the watch
that decides which replicas are slow (the window, the hysteresis, no flapping on noise)."""

import itertools
import random

import pytest

from megatron_mecefo.elastic.plan.cover_plan import Costs, plan_cover
from megatron_mecefo.elastic.plan.fold import fold_neighbor
from megatron_mecefo.elastic.plan.rebalance import SlowWatch, rebalance, replica_times, slots
from megatron_mecefo.elastic.plan.topology import Grid, ring_cover

pytestmark = pytest.mark.unit


def best_slowest(live, total, factors):
    """The least slowest time of `total` exact micro-batches over `live`, each keeping one."""
    best = None
    for split in itertools.product(range(1, total + 1), repeat=len(live)):
        if sum(split) == total:
            t = max(factors.get(r, 1.0) * n for r, n in zip(live, split))
            best = t if best is None else min(best, t)
    return best


@pytest.mark.parametrize("seed", range(60))
def test_moves_reach_the_least_slowest_time_with_equal_costs(seed):
    rng = random.Random(seed)
    dp, k = rng.randint(2, 5), rng.randint(1, 4)
    failed = rng.sample(range(dp), rng.randint(0, (dp - 1) // 2))
    live = [d for d in range(dp) if d not in failed]
    grid = Grid(dp=dp)
    fold = fold_neighbor(ring_cover(grid, live), k, approximate="none")
    factors = {r: rng.choice([1.25, 1.5, 2.0, 3.0]) for r in rng.sample(live, rng.randint(1, len(live)))}
    out = rebalance(fold, factors, Costs())
    assert out.all_micro_batches() == fold.all_micro_batches() and (out.divisor, out.divisor_mha) == \
        (fold.divisor, fold.divisor_mha)
    assert all(len(mbs) >= 1 for mbs in out.assignments.values())
    got = max(replica_times(out, Costs(), factors).values())
    assert got == pytest.approx(best_slowest(live, dp * k, factors))
    assert rebalance(fold, factors, Costs()) == out, "deterministic"


def test_moved_micro_batches_keep_their_mode_and_the_plan_is_never_slower():
    grid, k = Grid(dp=4), 4
    plan = plan_cover(ring_cover(grid, [0, 1, 3]), k, Costs(covering=0.55))
    factors = {3: 2.0}
    out = rebalance(plan.fold, factors, plan.costs)
    before = {(m.replica, m.index): m for mbs in plan.fold.assignments.values() for m in mbs}
    after = {(m.replica, m.index): m for mbs in out.assignments.values() for m in mbs}
    assert before == after and out.divisor_mha == plan.fold.divisor_mha
    assert max(replica_times(out, plan.costs, factors).values()) < max(replica_times(plan.fold, plan.costs, factors).values())


def test_one_slow_replica_of_four_at_k8():
    """D = 4, k = 8: at 1.5x the slowest time falls from 12 to 9 micro-batches, at 2x from 16 to 10,
    at 1.25x from 10 to 9 (the least there is at micro-batch granularity)."""
    fold = fold_neighbor(ring_cover(Grid(dp=4), range(4)), 8)
    for factor, slowest, kept in ((1.5, 9.0, 6), (2.0, 10.0, 5), (1.25, 9.0, 7)):
        out = rebalance(fold, {2: factor}, Costs())
        assert max(replica_times(out, Costs(), {2: factor}).values()) == pytest.approx(slowest)
        assert len(out.assignments[2]) == kept and all(not m.covering for mbs in out.assignments.values() for m in mbs)


def steps(watch, rows):
    return [watch.observe(dict(enumerate(row))) for row in rows]


def test_a_replica_is_slow_after_a_whole_window_above_the_threshold():
    watch = SlowWatch(threshold=1.2, window=3)
    assert steps(watch, [(1, 1, 1.5, 1), (1, 1, 1.5, 1)]) == [False, False] and watch.factors == {}
    assert steps(watch, [(1, 1, 1.1, 1)]) == [False], "a step under the threshold in the window"
    assert steps(watch, [(1, 1, 1.5, 1), (1, 1, 1.5, 1)]) == [False, False]
    assert steps(watch, [(1, 1, 1.5, 1)]) == [True] and watch.factors == {2: pytest.approx(1.5)}


def test_no_flapping_on_noise_and_back_to_even_on_recovery():
    watch = SlowWatch(threshold=1.2, window=3)
    steps(watch, [(1, 1, 2.0, 1)] * 3)
    assert watch.factors == {2: pytest.approx(2.0)}
    rng = random.Random(0)
    noisy = [(1, 1, 2.0 * rng.uniform(0.9, 1.1), 1) for _ in range(40)]
    assert not any(steps(watch, noisy)), "noise of 10 % never re-plans"
    # a real change of speed: re-planned once the whole window shows it
    assert steps(watch, [(1, 1, 1.5, 1)] * 3) == [False, False, True] and watch.factors == {2: pytest.approx(1.5)}
    # between the thresholds (1.1 .. 1.2): still slow, at its new factor
    assert steps(watch, [(1, 1, 1.15, 1)] * 6) == [False, False, True, False, False, False]
    assert watch.factors == {2: pytest.approx(1.15)}
    # under 1.1 for a whole window: back to even
    assert steps(watch, [(1, 1, 1.05, 1)] * 3) == [False, False, True] and watch.factors == {}
    assert not any(steps(watch, [(1, 1, 1.15, 1)] * 10)), "between the thresholds: not slow again"


def test_no_re_plan_in_the_middle_of_a_change():
    """Slow at 2x, then fast: a window half slow, half fast is no new speed (its median would be);
    the plan goes back to even once the whole window is fast."""
    watch = SlowWatch(threshold=1.2, window=2)
    assert steps(watch, [(1, 1, 2.0, 1)] * 2) == [False, True]
    assert steps(watch, [(1, 1, 2.0, 1), (1, 1, 1.0, 1), (1, 1, 1.0, 1)]) == [False, False, True]
    assert watch.factors == {}


def test_a_pipeline_replica_dealt_fewer_micro_batches_reads_its_own_speed():
    """P = 2, D = 2, k = 2, a step of m + P - 1 micro-batch slots (1F1B): replica 1, three times as
    slow, sheds to one micro-batch; healthy again while it runs one and replica 0 three, it reads 1x
    per slot (1.5x per micro-batch, above the threshold) and the plan goes back to even."""
    costs, base = Costs(), fold_neighbor(ring_cover(Grid(dp=2), range(2)), 2)
    watch, fold = SlowWatch(threshold=1.2, window=2), base

    def run(speed, n):
        nonlocal fold
        for _ in range(n):
            t = {r: speed.get(r, 1.0) * (len(mbs) + 1) for r, mbs in fold.assignments.items()}
            if watch.observe({r: t[r] / slots(fold.assignments[r], costs, pp=2) for r in t}):
                fold = rebalance(base, watch.factors, costs) if watch.factors else base
        return {r: len(mbs) for r, mbs in fold.assignments.items()}

    assert run({1: 3.0}, 4) == {0: 3, 1: 1} and watch.factors == {1: pytest.approx(3.0)}
    assert run({}, 4) == {0: 2, 1: 2} and watch.factors == {}
    dealt = rebalance(base, {1: 3.0}, costs).assignments
    per_micro_batch = [(len(dealt[r]) + 1) / slots(dealt[r], costs) for r in (0, 1)]
    assert per_micro_batch[1] / per_micro_batch[0] == pytest.approx(1.5), "what counting micro-batches reads"
    assert slots((), costs, pp=2) == 0.0


@pytest.mark.parametrize("threshold, window", [(1.0, 5), (0.5, 5), (1.2, 1)])
def test_thresholds_that_cannot_work_are_refused(threshold, window):
    with pytest.raises(ValueError, match="threshold > 1 and window >= 2"):
        SlowWatch(threshold, window)
