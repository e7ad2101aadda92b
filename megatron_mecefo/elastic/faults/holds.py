"""The waits that key a job to its restarted ranks instead of the clock (inject.py's "hold" rules
and a replayed trace's rejoin steps), so a test or demo plays out as written on any machine,
however long (or short) a restarted process takes to start. Both sides of a rejoin at step s wait:
the members at the start of s until the restarted rank has asked to join, and the restarted rank
until the job has committed step s - 1 (a fast restart would otherwise be admitted earlier). Both
poll the store through the rank's Membership and end with the job."""

from __future__ import annotations

import time
from typing import Iterable, Optional, Tuple

__all__ = ["wait_for_holds", "wait_for_rejoin_step"]


def wait_for_holds(holds: Iterable[Tuple[int, int]], step: int, membership, timeout_s: float, events, log) -> None:
    """At the start of `step`, wait until each (rank, incarnation) of `holds` has asked to rejoin,
    so that this step's commit admits it; past `timeout_s` (join_timeout_s) the job goes on."""
    for rank, incarnation in holds:
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        while not membership.asked_to_rejoin(rank, incarnation):
            membership.check_job()
            if time.monotonic() > deadline:
                log.warning("hold: incarnation %d of rank %d did not ask to rejoin within join_timeout_s; going on",
                            incarnation, rank)
                break
            time.sleep(0.05)
        events.write("hold", step=step, rank_awaited=rank, incarnation=incarnation, waited_s=time.monotonic() - t0)


def wait_for_rejoin_step(step: Optional[int], membership, *, deadline: float) -> None:
    """A restarted rank whose rejoin is pinned to `step` (FaultInjector.rejoin_step; None: not
    pinned) stays down until the job's progress (the last committed step + 1) reaches it, or until
    `deadline` (monotonic)."""
    if step is None:
        return
    watch = membership.orphan_watch()
    while membership.progress() < step and time.monotonic() < deadline:
        membership.check_job()
        watch.check()
        time.sleep(0.1)
