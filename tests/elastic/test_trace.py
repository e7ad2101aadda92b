import os
import signal

import pytest

from megatron_mecefo.elastic.faults.inject import FaultInjector, TraceEvent, failure_trace
from megatron_mecefo.elastic.plan.topology import Grid, ring_cover

pytestmark = pytest.mark.unit


def test_trace_is_deterministic_and_always_coverable():
    a = failure_trace(4, 500, 10, 20, seed=7)
    assert a == failure_trace(4, 500, 10, 20, seed=7)
    assert a != failure_trace(4, 500, 10, 20, seed=8)
    for step in range(500):
        down = {e.rank for e in a if e.fail_step <= step < e.rejoin_step}
        ring_cover(Grid(dp=4), [r for r in range(4) if r not in down])  # never NoCoverAvailable
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


def test_a_trace_under_a_restarting_launcher_holds_for_each_rejoin(monkeypatch):
    """Every rank holds at an event's rejoin step for the next incarnation of its rank (the trace
    plays out as written however long a restart takes); a hold never signals anyone."""
    fired = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: fired.append(sig))
    trace = [TraceEvent(rank=1, fail_step=5, rejoin_step=8, incarnation=0), TraceEvent(1, 12, 15, 1),
             TraceEvent(2, 14, 30, 0)]
    inj = FaultInjector(rank=0).add_trace(trace, hold_until=20)
    assert [inj.holds(s) for s in (8, 15, 30)] == [[(1, 1)], [(1, 2)], []], "none past the job's end"
    assert FaultInjector(rank=0).add_trace(trace).holds(8) == [], "no restarts: no holds"
    restarted = FaultInjector(rank=1, incarnation=1).add_trace(trace, hold_until=20)
    for step in range(20):
        for phase in ("forward", "backward"):
            if (step, phase) != (12, "backward"):
                restarted.maybe_fire(step, phase)
    assert fired == []


def test_trace_from_events_numbers_incarnations_per_rank():
    from megatron_mecefo.elastic.faults.inject import trace_from_events

    assert trace_from_events([[1, 12, 20], [1, 5, 9], [2, 6, 10]]) == [
        TraceEvent(1, 5, 9, 0), TraceEvent(2, 6, 10, 0), TraceEvent(1, 12, 20, 1),
    ]


def test_check_trace_rejects_what_cannot_run():
    from megatron_mecefo.elastic.faults.inject import check_trace, trace_from_events

    def check(events, world=2, steps=100, restarts=3):
        check_trace(trace_from_events(events), world, steps, restarts)

    check([[0, 3, 10], [1, 20, 30]])
    with pytest.raises(ValueError, match=r"event \[1, 5, 10\]: at step 5 ranks \[0, 1\] are down"):
        check([[0, 3, 10], [1, 5, 10]])  # the example: nobody left to cover
    with pytest.raises(ValueError, match=r"event \[2, 3, 10\]: rank 2 is not a rank of this job"):
        check([[2, 3, 10]])
    with pytest.raises(ValueError, match="rank 0 is still down"):
        check([[0, 3, 10], [0, 8, 12]])
    with pytest.raises(ValueError, match=r"restarted 2 times by then, but the launcher restarts a rank at most 1"):
        check([[0, 3, 5], [0, 10, 12]], restarts=1)
    with pytest.raises(ValueError, match="no restarts: use mecefo-launch --restart-failed-after"):
        check([[0, 3, 5]], restarts=0)
    check([[0, 3, 500]], restarts=0)  # down to the end: needs no restart


def test_generated_traces_fit_the_restart_budget():
    """The paper's high scenario over 1000 steps on 4 ranks needs far more than 3 restarts per rank;
    with the launcher's budget the generated trace keeps what can run (and passes check_trace)."""
    from megatron_mecefo.elastic.faults.inject import check_trace, job_trace

    trace = {"mtbf_steps": 10.0, "recovery_steps": 40, "seed": 0}
    unlimited = job_trace(trace, 4, 1000, None)
    assert max(sum(e.rank == r for e in unlimited) for r in range(4)) > 3
    budget = job_trace(trace, 4, 1000, 3)
    check_trace(budget, 4, 1000, 3)
    assert all(sum(e.rank == r and e.rejoin_step < 1000 for e in budget) <= 3 for r in range(4))
    assert budget and len(budget) < len(unlimited)
    none = job_trace(trace, 4, 1000, 0)  # a launcher that restarts nobody: failures are permanent
    check_trace(none, 4, 1000, 0)
    assert none and all(e.rejoin_step >= 1000 for e in none)


def test_inject_rules_must_name_ranks_of_the_job():
    from megatron_mecefo.config import MeCeFOConfig
    from megatron_mecefo.elastic.faults.inject import check_rules

    cfg = MeCeFOConfig(inject=["kill:9:5", "kill:1:5"])
    check_rules(cfg.inject[1:], 4)
    with pytest.raises(ValueError, match=r"kill:9:5:backward names rank 9, but the job has 4 ranks"):
        check_rules(cfg.inject, 4)
