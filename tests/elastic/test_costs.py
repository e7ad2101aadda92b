"""Micro-batch costs: learned from observed step times alone, agreed identically from what the
members post, and the covering budget as the planner's target (the fewest approximations within it)."""

import json
import random

import pytest

from megatron_mecefo.elastic.plan.costs import DEFAULT_COVERING, CostMeter, agreed_costs
from megatron_mecefo.elastic.plan.cover_plan import Costs, plan_cover
from megatron_mecefo.elastic.plan.topology import Grid, ring_cover

pytestmark = pytest.mark.unit


def step_time(a, c, exact, covering, jitter=0.0, rng=None):
    noise = 1 + (rng.uniform(-jitter, jitter) if rng else 0.0)
    return (exact * a + covering * c) * noise


def test_the_meter_learns_both_costs_from_step_times():
    meter = CostMeter()
    assert json.loads(meter.info()) == {"exact": None, "covering": None}
    meter.observe(2, 3, 5.0)  # a mixed step before any healthy one: cannot be split, ignored
    assert meter.covering_cost() is None
    for _ in range(3):
        meter.observe(4, 0, 4 * 0.8)
    for exact, covering in ((4, 4), (0, 8), (2, 6), (1, 7)):
        meter.observe(exact, covering, step_time(0.8, 0.44, exact, covering))
    assert meter.exact_cost() == pytest.approx(0.8) and meter.covering_cost() == pytest.approx(0.44)
    assert json.loads(meter.info()) == pytest.approx({"exact": 0.8, "covering": 0.44})


def test_noisy_clocks_give_medians_near_the_truth():
    rng = random.Random(0)
    meter = CostMeter(window=5)
    for _ in range(20):
        meter.observe(8, 0, step_time(1.0, 0.4, 8, 0, 0.05, rng))
    for _ in range(20):
        meter.observe(4, 12, step_time(1.0, 0.4, 4, 12, 0.05, rng))
    assert meter.exact_cost() == pytest.approx(1.0, rel=0.05)
    assert meter.covering_cost() == pytest.approx(0.4, rel=0.15)


def post(exact, covering):
    return json.dumps({"exact": exact, "covering": covering})


def test_agreed_costs_are_the_median_ratio_of_what_the_members_posted():
    info = {0: post(2.0, 1.0), 3: post(1.0, 0.6), 5: post(4.0, 1.6), 7: post(1.0, None), 9: ""}
    costs = agreed_costs(info)
    assert costs == Costs(exact=1.0, covering=0.5)  # ratios 0.5, 0.6, 0.4; rank 7 never covered, 9 a joiner
    # every member derives it from the same published dict, whatever order it reads it in
    assert agreed_costs(dict(reversed(list(info.items())))) == costs
    assert agreed_costs({0: post(1.0, None), 1: post(None, None)}).covering == DEFAULT_COVERING == 0.55
    assert agreed_costs({0: post(1.0, 1.3)}).covering == 1.0  # a covering step slower than exact: capped


@pytest.mark.parametrize("seed", range(40))
def test_the_budget_is_the_planners_target_on_random_cost_models(seed):
    """The covering replica approximates the fewest micro-batches that keep it within B normal
    steps (adopted ones first), or all when none does; every other replica runs exact."""
    rng = random.Random(seed)
    k, budget, dp = rng.choice([1, 2, 4, 8]), rng.uniform(1.0, 2.0), rng.choice([3, 4, 6])
    costs = Costs(exact=1.0, covering=rng.uniform(0.3, 0.95))
    failed = rng.randrange(dp)
    plan = plan_cover(ring_cover(Grid(dp=dp), [r for r in range(dp) if r != failed]), k, costs,
                      target=budget * k)
    (coverer,) = [r for r, mbs in plan.fold.assignments.items() if len(mbs) == 2 * k]
    mbs = plan.fold.assignments[coverer]
    x = sum(m.covering for m in mbs)
    assert all(m.covering for m in mbs[2 * k - x:]) and not any(m.covering for m in mbs[:2 * k - x])
    assert plan.approximated == x
    time = lambda x: (2 * k - x) * 1.0 + x * costs.covering  # noqa: E731  (the true cost model)
    if time(2 * k) <= budget * k:
        assert time(x) <= budget * k + 1e-9 and (x == 0 or time(x - 1) > budget * k - 1e-9)
    else:
        assert x == 2 * k  # nothing keeps it within the budget: the paper's rule
    assert plan.fold.divisor_mha == dp * k - x


def test_k1_is_all_or_nothing():
    cover = ring_cover(Grid(dp=3), [0, 2])
    assert plan_cover(cover, 1, Costs(covering=0.5), target=1.1).approximated == 2  # 1 + 0.5 > 1.1
    assert plan_cover(cover, 1, Costs(covering=0.5), target=1.6).approximated == 1  # 1 + 0.5 <= 1.6
