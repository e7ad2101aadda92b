"""The waits that key a job to its restarted ranks instead of the clock (inject.py's "hold" rules
and a replayed trace's rejoin steps), so a test or demo plays out as written on any machine,
however long a restarted process takes to start. Both poll the store and end with the job."""

from __future__ import annotations

import time
from typing import Iterable, Sequence, Tuple

__all__ = ["wait_for_holds", "wait_for_rejoin_step"]


def wait_for_holds(holds: Iterable[Tuple[int, int]], step: int, store, membership, timeout_s: float, events,
                   log) -> None:
    """At the start of `step`, wait until each (rank, incarnation) of `holds` has asked to rejoin,
    so that this step's commit admits it; past `timeout_s` (join_timeout_s) the job goes on."""
    for rank, incarnation in holds:
        key = f"rejoining/{rank}/{incarnation}"
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        while not store.check([key]):
            membership.check_job()
            if time.monotonic() > deadline:
                log.warning("hold: incarnation %d of rank %d did not ask to rejoin within join_timeout_s; going on",
                            incarnation, rank)
                break
            time.sleep(0.05)
        events.write("hold", step=step, rank_awaited=rank, incarnation=incarnation, waited_s=time.monotonic() - t0)


def wait_for_rejoin_step(trace: Sequence, rank: int, incarnation: int, store, membership, *, deadline: float) -> None:
    """A rank restarted by a trace (inject.TraceEvent) stays down until its event's rejoin step
    (the job's progress in the store), or until `deadline` (monotonic)."""
    mine = [e for e in trace if e.rank == rank and e.incarnation == incarnation - 1]
    if not mine:
        return
    watch = membership.orphan_watch()
    while int(store.add("job/progress", 0)) < mine[0].rejoin_step and time.monotonic() < deadline:
        membership.check_job()
        watch.check()
        time.sleep(0.1)
