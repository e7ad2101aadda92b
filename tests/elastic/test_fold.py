import itertools

import pytest

from megatron_mecefo.elastic.plan.fold import MicroBatch, fold_neighbor, sample_range
from megatron_mecefo.elastic.plan.topology import Grid, ring_cover

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("dp, live", [(4, [0, 1, 2, 3]), (4, [0, 1, 3]), (4, [0, 3]), (5, [1, 2, 4]), (3, [2, 0])])
@pytest.mark.parametrize("k", [1, 3])
def test_every_micro_batch_exactly_once(dp, live, k):
    fold = fold_neighbor(ring_cover(Grid(dp=dp), live), k)
    assert fold.all_micro_batches() == sorted(itertools.product(range(dp), range(k)))
    assert fold.divisor == dp * k


def test_covering_replica_runs_own_then_adopted_in_covering_mode():
    fold = fold_neighbor(ring_cover(Grid(dp=4), [0, 1, 3]), 2)
    assert fold.micro_batches(3) == (
        MicroBatch(3, 0, True), MicroBatch(3, 1, True), MicroBatch(2, 0, True), MicroBatch(2, 1, True),
    )
    assert fold.micro_batches(0) == (MicroBatch(0, 0, False), MicroBatch(0, 1, False))
    # attention: only the 4 micro-batches of replicas 0 and 1 have an exact attention backward
    assert fold.divisor_mha == 4


def test_adopted_only_and_none_modes():
    plan = ring_cover(Grid(dp=4), [0, 1, 3])
    adopted = fold_neighbor(plan, 2, approximate="adopted")
    assert [m.covering for m in adopted.micro_batches(3)] == [False, False, True, True]
    assert adopted.divisor_mha == 6
    none = fold_neighbor(plan, 2, approximate="none")
    assert not any(m.covering for mbs in none.assignments.values() for m in mbs)
    assert none.divisor_mha == none.divisor == 8
    # covering mode without the attention skip: attention gradients from every micro-batch
    assert fold_neighbor(plan, 2, skip_attention=False).divisor_mha == 8


def test_fault_free_fold_is_plain_data_parallel():
    fold = fold_neighbor(ring_cover(Grid(dp=3), range(3)), 2)
    assert fold.divisor == fold.divisor_mha == 6
    assert all(len(m) == 2 and not any(x.covering for x in m) for m in fold.assignments.values())


def test_two_of_four_down_leaves_attention_nothing_without_the_floor_and_half_with_it():
    plan = ring_cover(Grid(dp=4), [0, 2])  # replicas 1 and 3 down: both survivors cover
    paper = fold_neighbor(plan, 1)
    assert paper.divisor_mha == 0  # the paper's rule: no exact attention gradient this step
    floor = fold_neighbor(plan, 1, attention_floor=0.5)
    assert floor.divisor_mha == 2
    # each survivor keeps the attention backward of its own micro-batch, not of the adopted one
    for r in (0, 2):
        own, adopted = floor.micro_batches(r)
        assert (own.replica, own.covering, own.exact_attention) == (r, True, True)
        assert (adopted.covering, adopted.exact_attention) == (True, False)
    assert floor.all_micro_batches() == paper.all_micro_batches()


@pytest.mark.parametrize("dp, live, k", [(4, [0, 2], 1), (4, [0, 2], 3), (8, [0, 2, 4, 6], 2), (2, [1], 2),
                                         (8, [0, 1, 2, 3, 4, 5, 6], 2), (5, [1, 3, 4], 3)])
@pytest.mark.parametrize("floor", [0.1, 0.25, 0.5, 0.75, 1.0])
def test_the_floor_is_met_with_the_fewest_kept_and_never_leaves_zero(dp, live, k, floor):
    plan = ring_cover(Grid(dp=dp), live)
    paper, fold = fold_neighbor(plan, k), fold_neighbor(plan, k, attention_floor=floor)
    kept = [m for mbs in fold.assignments.values() for m in mbs if m.exact_attention]
    assert all(m.covering for m in kept)
    # the share reaches the floor, with no more micro-batches kept than needed
    need = -(-floor * dp * k // 1)
    assert fold.divisor_mha == max(paper.divisor_mha, need) == paper.divisor_mha + len(kept)
    assert fold.divisor_mha > 0
    # own micro-batches are kept before any adopted one, and spread over the covering replicas
    own_left = [m for r, mbs in fold.assignments.items() for m in mbs if m.replica == r and m.covering and not m.exact_attention]
    if own_left:
        assert all(m.replica == r for r, mbs in fold.assignments.items() for m in mbs if m.exact_attention)
    per_replica = [sum(m.exact_attention for m in mbs) for mbs in fold.assignments.values() if any(m.covering for m in mbs)]
    assert max(per_replica) - min(per_replica) <= 1 or not own_left


def test_the_floor_changes_nothing_when_enough_attention_is_exact():
    plan = ring_cover(Grid(dp=8), [0, 1, 2, 3, 4, 5, 7])  # the high rate: one of eight down
    assert fold_neighbor(plan, 2, attention_floor=0.5) == fold_neighbor(plan, 2)
    assert fold_neighbor(plan, 2, attention_floor=0.5, skip_attention=False) == fold_neighbor(plan, 2, skip_attention=False)


def test_sample_ranges_tile_the_global_batch():
    dp, k, mb = 3, 2, 4
    seen = []
    for step in range(3):
        for d in range(dp):
            for j in range(k):
                seen.extend(sample_range(step, d, j, micro_batch_size=mb, dp=dp, k=k))
    assert sorted(seen) == list(range(3 * dp * k * mb))


def test_invalid_arguments():
    plan = ring_cover(Grid(dp=2), [0, 1])
    with pytest.raises(ValueError, match="approximate"):
        fold_neighbor(plan, 1, approximate="some")
    with pytest.raises(ValueError, match="micro_batches_per_replica"):
        fold_neighbor(plan, 0)
    with pytest.raises(ValueError, match="attention_floor"):
        fold_neighbor(plan, 1, attention_floor=1.5)
