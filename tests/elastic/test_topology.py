import pytest

from megatron_mecefo.elastic.plan.topology import CoverMap, Grid, ring_cover
from megatron_mecefo.errors import NoCoverAvailable

pytestmark = pytest.mark.unit


def test_grid_layout_follows_megatron_order():
    g = Grid(tp=2, pp=2, dp=3)
    assert g.world == 12
    # tp fastest, then dp, then pp
    assert [g.coords(r) for r in (0, 1, 2, 5, 6, 11)] == [(0, 0, 0), (1, 0, 0), (0, 0, 1), (1, 0, 2), (0, 1, 0), (1, 1, 2)]
    assert all(g.rank(*g.coords(r)) == r for r in range(12))
    assert g.ranks_of_replica(1) == [2, 3, 8, 9]
    with pytest.raises(ValueError):
        Grid(dp=0)


def test_no_failure_no_cover():
    plan = ring_cover(Grid(dp=4), range(4))
    assert plan.live == (0, 1, 2, 3) and plan.cover == {} and not plan.degraded


def test_neighbour_is_next_on_the_ring():
    assert ring_cover(Grid(dp=4), [0, 1, 3]).cover == {2: 3}
    assert ring_cover(Grid(dp=4), [0, 1, 2]).cover == {3: 0}  # wraps around


def test_two_failures_get_different_neighbours():
    plan = ring_cover(Grid(dp=4), [0, 3])
    assert plan.cover == {1: 3, 2: 0}  # 1 -> 2 dead, 3 free; 2 -> 3 busy, wraps to 0
    assert plan.covering == {0, 3}
    assert plan.adopted_by(3) == (1,) and plan.adopted_by(0) == (2,)
    # adjacent failures skip the covering neighbour
    assert ring_cover(Grid(dp=5), [0, 3, 4]).cover == {1: 3, 2: 4}


def test_one_rank_of_a_tensor_parallel_group_retires_the_replica():
    g = Grid(tp=2, pp=2, dp=3)
    live = [r for r in range(12) if r != 9]  # tp1, pp1, dp1
    plan = ring_cover(g, live)
    assert plan.live == (0, 2) and plan.cover == {1: 2}


def test_no_cover_available_is_a_clear_error():
    with pytest.raises(NoCoverAvailable, match="replica 2 has no healthy neighbour left: 2 of 3"):
        ring_cover(Grid(dp=3), [0])
    with pytest.raises(NoCoverAvailable):
        ring_cover(Grid(dp=2), [])


def test_plan_json_roundtrip():
    g = Grid(dp=4)
    plan = ring_cover(g, [0, 3])
    assert CoverMap.from_json(g, plan.to_json()) == plan
