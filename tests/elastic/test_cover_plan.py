"""The cover planner against brute force on small cases (D <= 6, k <= 4, one to three failures,
random costs): every micro-batch exactly once, the divisors, the fewest approximated micro-batches
within the target and then the fastest slowest replica, never slower nor more approximate than the
paper's rule by default, deterministic."""

import itertools
import random

import pytest

from megatron_mecefo.elastic.plan.cover_plan import Costs, plan_cover, predict
from megatron_mecefo.elastic.plan.fold import fold_neighbor
from megatron_mecefo.elastic.plan.topology import Grid, ring_cover

pytestmark = pytest.mark.unit


def cases(seed=0, count=120):
    rng = random.Random(seed)
    for _ in range(count):
        dp = rng.randint(2, 6)
        failures = rng.randint(1, min(3, dp // 2))
        failed = sorted(rng.sample(range(dp), failures))
        k = rng.randint(1, 4)
        exact = rng.uniform(0.5, 2.0)
        costs = Costs(exact=exact, covering=exact * rng.uniform(0.3, 1.0))
        yield Grid(dp=dp), [d for d in range(dp) if d not in failed], k, costs, rng.choice(["all", "adopted", "none"])


def brute_force(live, n_lost, k, costs, target, approximate):
    """(fewest approximated, fastest slowest) over every split of the lost micro-batches and every
    count of approximated ones per replica; only replicas that adopt some may approximate."""
    best = None
    for split in itertools.product(range(n_lost + 1), repeat=len(live)):
        if sum(split) != n_lost:
            continue
        options = []
        for c in split:
            cap = 0 if c == 0 else {"all": k + c, "adopted": c, "none": 0}[approximate]
            options.append([(x, (k + c - x) * costs.exact + x * costs.covering) for x in range(cap + 1)])
        for choice in itertools.product(*options):
            total, slowest = sum(x for x, _ in choice), max(t for _, t in choice)
            key = (slowest > target + 1e-9, total if slowest <= target + 1e-9 else 0, slowest)
            best = key if best is None or key < best else best
    return best


@pytest.mark.parametrize("seed", range(4))
def test_spread_is_optimal_and_never_worse_than_the_neighbour_rule(seed):
    for grid, live, k, costs, approximate in cases(seed, 30):
        cover = ring_cover(grid, live)
        plan = plan_cover(cover, k, costs, policy="spread", approximate=approximate)
        lost = [(f, j) for f in cover.failed for j in range(k)]
        # every micro-batch of the global batch exactly once; divisors as the fold's rule
        assert plan.fold.all_micro_batches() == sorted((d, j) for d in range(grid.dp) for j in range(k))
        assert plan.fold.divisor == grid.dp * k
        assert plan.fold.divisor_mha == sum(not m.covering for mbs in plan.fold.assignments.values() for m in mbs)
        counts = [sum(m.replica != r for m in plan.fold.assignments[r]) for r in live]
        assert sum(counts) == len(lost)
        if approximate == "none":  # nothing to trade: the lost micro-batches are dealt evenly
            assert max(counts) - min(counts) <= 1
        for r in live:  # adopted micro-batches are approximated before own ones
            mbs = plan.fold.assignments[r]
            if any(m.covering for m in mbs if m.replica == r):
                assert all(m.covering for m in mbs if m.replica != r)
        # optimal: fewest approximations within the target, then the fastest slowest replica
        infeasible, total, slowest = brute_force(live, len(lost), k, costs, plan.target, approximate)
        assert plan.slowest == pytest.approx(slowest)
        if not infeasible:
            assert plan.slowest <= plan.target + 1e-9 and plan.approximated == total
        # the default target is the paper's slowest replica: never slower, never more approximated
        paper = plan_cover(cover, k, costs, policy="neighbour", approximate=approximate)
        assert plan.slowest <= paper.slowest + 1e-9
        assert plan.approximated <= paper.approximated
        assert plan == plan_cover(cover, k, costs, policy="spread", approximate=approximate)  # deterministic


def test_the_issues_example_d8_k4():
    """D = 8, k = 4, one replica lost, a = 0.55 e: the paper's neighbour runs 8 approximated
    micro-batches at 8a / 4e = 1.10; dealt over the seven survivors (ring order from the failed
    replica's neighbour), the slowest stays within the paper's time with fewer approximated."""
    cover = ring_cover(Grid(dp=8), [0, 1, 2, 4, 5, 6, 7])
    costs = Costs(exact=1.0, covering=0.55)
    paper = plan_cover(cover, 4, costs)
    assert paper.slowest == pytest.approx(8 * 0.55) and paper.approximated == 8
    spread = plan_cover(cover, 4, costs, policy="spread")
    assert [sum(m.replica == 3 for m in spread.fold.assignments[r]) for r in (4, 5, 6, 7, 0, 1, 2)] == \
        [1, 1, 1, 1, 0, 0, 0]
    # five micro-batches in 4.4: one approximated each -> 4 + 0.55 = 4.55 > 4.4, two -> 3 + 1.1 = 4.1
    assert spread.slowest == pytest.approx(4.1) and spread.approximated == 8
    # a target of one healthy step (4e, no slowdown): two survivors adopt two each and approximate
    # five of six (1e + 5a = 3.75); one each would need three approximated on four (12); the
    # slowest are the survivors that adopt nothing, at a healthy step's 4e
    flat = plan_cover(cover, 4, costs, policy="spread", target=4.0)
    assert [sum(m.replica == 3 for m in flat.fold.assignments[r]) for r in (4, 5, 6)] == [2, 2, 0]
    assert flat.predicted[4] == pytest.approx(3.75) and flat.slowest == pytest.approx(4.0) and flat.approximated == 10
    # exact (approximations off): dealt evenly, the slowest runs five exact micro-batches, not eight
    exact = plan_cover(cover, 4, costs, policy="spread", approximate="none")
    assert exact.approximated == 0 and exact.slowest == pytest.approx(5.0)
    assert plan_cover(cover, 4, costs, approximate="none").slowest == pytest.approx(8.0)


def test_the_attention_floor_holds_under_spread():
    cover = ring_cover(Grid(dp=4), [0, 1])
    plan = plan_cover(cover, 2, Costs(), policy="spread", target=2.0, attention_floor=0.5)
    assert plan.fold.divisor_mha >= 4
    assert plan.predicted == predict(plan.fold, Costs())


def test_neighbour_policy_is_the_papers_fold():
    cover = ring_cover(Grid(dp=4), [0, 2, 3])
    assert plan_cover(cover, 3, Costs()).fold == fold_neighbor(cover, 3)
    with pytest.raises(ValueError, match="cover policy"):
        plan_cover(cover, 3, Costs(), policy="nearest")
    with pytest.raises(ValueError, match="covering <= exact"):
        Costs(exact=1.0, covering=1.5)


def test_the_policies_are_the_configs_choices():
    from megatron_mecefo.config import COVER_CHOICES
    from megatron_mecefo.elastic.plan.cover_plan import COVER_POLICIES

    assert COVER_POLICIES == COVER_CHOICES
    with pytest.raises(ValueError, match="cover policy must be one of"):
        plan_cover(ring_cover(Grid(dp=3), [0, 2]), 2, Costs(), policy="ring")
