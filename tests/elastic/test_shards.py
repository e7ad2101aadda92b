"""The sharded optimizer state's layout and re-shard plan (pure)."""

import random

import pytest

from megatron_mecefo.elastic.plan.topology import Grid, ring_cover
from megatron_mecefo.elastic.sharding.shards import ShardLayout, reshard, shard_bounds

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("numel, parts, align", [(10, 3, 1), (10, 3, 4), (7, 4, 1), (3, 4, 1), (0, 2, 1), (1000, 8, 64)])
def test_bounds_split_the_range_in_order_balanced_and_aligned(numel, parts, align):
    bounds = shard_bounds(numel, parts, align)
    assert len(bounds) == parts and bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    assert all(start % align == 0 for start, _ in bounds)
    sizes = [end - start for start, end in bounds]
    assert max(sizes) - min(sizes) <= align


def test_the_copy_of_a_shard_is_held_by_the_replica_that_covers_its_owner():
    layout = ShardLayout(100, (0, 1, 2, 3))
    for failed in layout.live:
        live = [r for r in layout.live if r != failed]
        assert layout.copy_holder(failed) == ring_cover(Grid(dp=4), live).cover[failed]
        assert layout.copy_of(layout.copy_holder(failed)) == failed
    assert ShardLayout(100, (2,)).copy_holder(2) is None
    assert ShardLayout(100, (0, 1), neighbour_copy=False).held(1) == {"shard": (50, 100)}
    assert layout.held_bytes(1, 12) == 2 * 25 * 12  # own shard and its neighbour's, 12 bytes each (fp32 master + moments)


def test_no_change_moves_nothing():
    layout = ShardLayout(90, (0, 1, 2))
    plan = reshard(layout, layout, layout.live)
    assert not plan.lost and all(m.local for m in plan.moves)


def test_a_failed_owner_s_shard_comes_from_its_copy():
    old, new = ShardLayout(90, (0, 1, 2)), ShardLayout(90, (0, 2))
    plan = reshard(old, new, holding=[0, 2])
    assert not plan.lost
    # replica 1's old shard [30, 60) lives on in replica 2's copy: 0's new shard [0, 45) takes [30, 45)
    # from it, 2's new shard [45, 90) keeps [45, 60) where it is
    assert sorted((m.src, m.start, m.end) for m in plan.moves if m.dst == 0 and m.into == "shard") == [(0, 0, 30), (2, 30, 45)]
    assert sorted((m.src, m.start, m.end) for m in plan.moves if m.dst == 2 and m.into == "shard") == [(2, 45, 60), (2, 60, 90)]
    assert not plan.sent_by(1) and not plan.received_by(1)


def test_two_adjacent_failures_lose_the_shard_whose_both_holders_died():
    old, new = ShardLayout(80, (0, 1, 2, 3)), ShardLayout(80, (0, 3))
    plan = reshard(old, new, holding=[0, 3])
    assert plan.lost == ((20, 40),)  # replica 1's shard: its copy was on replica 2
    no_copy = reshard(ShardLayout(80, (0, 1, 2, 3), neighbour_copy=False), ShardLayout(80, (0, 2, 3), neighbour_copy=False), [0, 2, 3])
    assert no_copy.lost == ((20, 40),)


def test_a_joiner_receives_only_what_it_will_hold():
    old, new = ShardLayout(90, (0, 2)), ShardLayout(90, (0, 1, 2))
    plan = reshard(old, new, holding=[0, 2])
    assert not plan.lost
    got = sorted((m.into, m.start, m.end) for m in plan.received_by(1))
    assert [(into, start, end) for into, start, end in got] == [("copy", 0, 30), ("shard", 30, 45), ("shard", 45, 60)]
    assert not plan.sent_by(1)


@pytest.mark.parametrize("seed", range(20))
def test_every_element_of_the_new_layout_comes_from_a_holder_or_is_lost(seed):
    rnd = random.Random(seed)
    dp = rnd.randint(2, 8)
    numel = rnd.randint(0, 200)
    old_live = tuple(sorted(rnd.sample(range(dp), rnd.randint(1, dp))))
    holding = [r for r in old_live if rnd.random() < 0.6]
    joiners = [r for r in range(dp) if r not in old_live and rnd.random() < 0.5]
    new_live = tuple(sorted(set(holding) | set(joiners))) or (0,)
    copies = rnd.random() < 0.7
    old, new = ShardLayout(numel, old_live, copies), ShardLayout(numel, new_live, copies)
    plan = reshard(old, new, holding)

    def holders(i):
        owner = next(r for r in old_live if old.shard(r)[0] <= i < old.shard(r)[1])
        return {r for r in (owner, old.copy_holder(owner)) if r in holding}

    lost = {i for a, b in plan.lost for i in range(a, b)}
    for dst in new_live:
        for into, (lo, hi) in new.held(dst).items():
            filled = {}
            for m in plan.moves:
                if m.dst == dst and m.into == into:
                    for i in range(m.start, m.end):
                        assert i not in filled, "an element filled twice"
                        filled[i] = m.src
            for i in range(lo, hi):
                if holders(i):
                    assert filled[i] in holders(i)
                    assert (filled[i] == dst) == (dst in holders(i)), "a holder keeps what it has"
                else:
                    assert i in lost and i not in filled
    assert all(not holders(i) for i in lost)
