import os
import signal

import pytest

from megatron_mecefo.elastic.inject import FaultInjector, TraceEvent, failure_trace
from megatron_mecefo.elastic.topology import Grid, plan_cover

pytestmark = pytest.mark.unit


def test_trace_is_deterministic_and_always_coverable():
    a = failure_trace(4, 500, 10, 20, seed=7)
    assert a == failure_trace(4, 500, 10, 20, seed=7)
    assert a != failure_trace(4, 500, 10, 20, seed=8)
    for step in range(500):
        down = {e.rank for e in a if e.fail_step <= step < e.rejoin_step}
        plan_cover(Grid(dp=4), [r for r in range(4) if r not in down])  # never NoCoverAvailable
    # mean gap close to the requested MTBF (failures that cannot be absorbed are skipped)
    assert 8 <= 500 / len(a) <= 25


def test_incarnations_count_each_ranks_failures():
    trace = failure_trace(3, 300, 5, 3, seed=1)
    for r in range(3):
        mine = [e for e in trace if e.rank == r]
        assert [e.incarnation for e in mine] == list(range(len(mine)))
        assert all(b.fail_step >= a.rejoin_step for a, b in zip(mine, mine[1:]))


def test_injector_fires_only_in_the_named_incarnation(monkeypatch):
    fired = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: fired.append(sig))
    trace = [TraceEvent(rank=1, fail_step=5, rejoin_step=8, incarnation=0), TraceEvent(1, 12, 15, 1)]
    first = FaultInjector(rank=1, incarnation=0).add_trace(trace)
    first.maybe_fire(12, "backward")
    first.maybe_fire(5, "forward")
    assert fired == []
    first.maybe_fire(5, "backward")
    assert fired == [signal.SIGKILL]
    restarted = FaultInjector(rank=1, incarnation=1).add_trace(trace)
    restarted.maybe_fire(5, "backward")
    assert len(fired) == 1
    restarted.maybe_fire(12, "backward")
    assert len(fired) == 2
    FaultInjector(rank=2, incarnation=0).add_trace(trace).maybe_fire(5, "backward")
    assert len(fired) == 2


def test_trace_from_events_numbers_incarnations_per_rank():
    from megatron_mecefo.elastic.inject import trace_from_events

    assert trace_from_events([[1, 12, 20], [1, 5, 9], [2, 6, 10]]) == [
        TraceEvent(1, 5, 9, 0), TraceEvent(2, 6, 10, 0), TraceEvent(1, 12, 20, 1),
    ]
