"""The covering budget against a synthetic cost model: the step it chooses stays within budget and
is the largest that does; the costs are learned from observed step times alone."""

import random

import pytest

from megatron_mecefo.elastic.budget import CoveringBudget

pytestmark = pytest.mark.unit


def step_time(a, c, exact, covering, jitter=0.0, rng=None):
    noise = 1 + (rng.uniform(-jitter, jitter) if rng else 0.0)
    return (exact * a + covering * c) * noise


def learn(budget, a, c, k, steps=6, jitter=0.0, rng=None):
    """A rank's life: healthy steps (k exact), then covering steps with the budget's choice."""
    for _ in range(steps):
        budget.observe(k, 0, step_time(a, c, k, 0, jitter, rng))
    chosen = []
    for _ in range(steps):
        e = budget.exact_own(k)
        chosen.append(e)
        budget.observe(e, 2 * k - e, step_time(a, c, e, 2 * k - e, jitter, rng))
    return chosen


def test_the_first_covering_step_is_the_papers_then_the_largest_within_budget():
    b = CoveringBudget(1.10)
    chosen = learn(b, a=1.0, c=0.45, k=4)
    # covering 8 micro-batches at 0.45 = 0.9 of a normal step; each own exact one adds 0.55 / 4
    assert chosen[0] == 0 and set(chosen[1:]) == {1}
    assert b.predicted_ratio(4, 1) == pytest.approx(1.0375) and b.predicted_ratio(4, 2) > 1.10


def test_k1_is_all_or_nothing():
    assert set(learn(CoveringBudget(1.10), a=1.0, c=0.5, k=1)) == {0}  # 1 + 0.5 > 1.1
    assert learn(CoveringBudget(1.6), a=1.0, c=0.5, k=1)[1:] == [1] * 5  # 1 + 0.5 <= 1.6


@pytest.mark.parametrize("seed", range(40))
def test_the_budget_holds_on_random_cost_models(seed):
    rng = random.Random(seed)
    a, k, budget = rng.uniform(0.1, 5.0), rng.choice([1, 2, 4, 8, 16]), rng.uniform(1.01, 2.0)
    c = a * rng.uniform(0.3, 0.95)
    b = CoveringBudget(budget)
    e = learn(b, a, c, k)[-1]
    ratio = lambda e: (e * a + (2 * k - e) * c) / (k * a)  # noqa: E731  (the true cost model)
    assert 0 <= e <= k
    if e > 0:
        assert ratio(e) <= budget + 1e-9
    if e < k:
        assert ratio(e + 1) > budget - 1e-9 or ratio(0) > budget  # one more would break it


def test_noisy_clocks_stay_near_budget():
    rng = random.Random(0)
    b = CoveringBudget(1.10, window=5)
    chosen = learn(b, a=1.0, c=0.4, k=8, steps=20, jitter=0.05, rng=rng)
    # true costs: e = floor(8 x (1.1 - 0.8) / 0.6) = 4; the medians of noisy samples land next to it
    assert all(3 <= e <= 5 for e in chosen[1:]), chosen
    assert (chosen[-1] * 1.0 + (16 - chosen[-1]) * 0.4) / 8 <= 1.10 * 1.06


def test_invalid_budget():
    with pytest.raises(ValueError, match="covering_budget must be > 1"):
        CoveringBudget(1.0)


def test_the_runtime_refuses_a_budget_with_tensor_or_pipeline_parallelism():
    """Each rank of a replica would read its own clock: they could run one micro-batch in two modes."""
    from megatron_mecefo.config import LaunchEnv, MeCeFOConfig
    from megatron_mecefo.elastic.runtime import ElasticRuntime

    cfg = MeCeFOConfig(enable=True, covering_budget=1.1)
    for tp, pp in ((2, 1), (1, 2)):
        with pytest.raises(ValueError, match='"covering_budget" needs tensor and pipeline parallel size 1'):
            job = LaunchEnv(rank=0, world=4, local_rank=0, master_addr="127.0.0.1", master_port=1, incarnation=0,
                            mecefo_launcher=False)
            ElasticRuntime(cfg, job, tensor_parallel=tp, pipeline_parallel=pp)  # refused before the store is touched
