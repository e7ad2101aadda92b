"""The fluid simulation: training progress between failure and repair events.

Step times are seconds and failures hours apart, so between two events a system trains at a
constant rate: `progress` is counted in seconds of the same job running failure-free with no
fault-tolerance cost (so `progress / wall` is the ETTR). Each event may cost a transition (a
detection, a regroup, a restart, work rolled back); a system is a small policy object:

    rate(down)              -> Rate(speed, approx, dropped)  while the domains in `down` are out
    on_failure(down, f)     -> Transition(downtime_s, lost_s, fatal)   after `f` took its domain out
    on_repair(down, domain) -> Transition                              after `domain` came back

`simulate` walks a trace and sums where the time went (`breakdown`). Checkpoint-restart keeps a
clock of its own (segments of compute and a write) and runs in `checkpoint_restart.py`.
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Dict, FrozenSet, List, Sequence

from megatron_mecefo.sim.trace import Failure

__all__ = ["Rate", "Transition", "Outcome", "simulate"]


@dataclasses.dataclass(frozen=True)
class Rate:
    speed: float
    """Progress per wall second (1: the failure-free job without fault-tolerance costs)."""
    approx: float = 0.0
    """Share of the step's micro-batches that go through an approximate backward."""
    dropped: float = 0.0
    """Share of the global batch's samples that are dropped (not trained on)."""
    cause: str = "degraded"
    """Where 1 - speed goes in the breakdown."""


@dataclasses.dataclass(frozen=True)
class Transition:
    downtime_s: float = 0.0
    """Wall seconds with no progress (detection, regroup, restart)."""
    lost_s: float = 0.0
    """Progress rolled back (the in-flight step, work since the last checkpoint)."""
    fatal: bool = False
    """The system could not absorb the event and restarted from its last checkpoint."""
    cause: str = "restart"
    """Breakdown key of the downtime."""


@dataclasses.dataclass
class Outcome:
    wall_s: float
    progress_s: float
    breakdown: Dict[str, float]
    """Wall seconds lost per cause (their sum + progress_s = wall_s, up to the dropped samples,
    which count as lost progress: `dropped`)."""
    approx_fraction: float
    """Share of all trained micro-batches that went through the approximate backward."""
    fatal_events: int
    timeline: List[dict]
    """(t, domains down, useful speed, approximate share) after every event, for the plot."""
    wasted_wall_s: float = 0.0
    """Wall seconds that went into work later rolled back (each loss at the speed it was made at):
    the "fallback" time of Oobleck's artifact simulator."""
    counters: Dict[str, int] = dataclasses.field(default_factory=dict)
    """The policy's own event counts (its `counters()`, e.g. MeCeFO's shard losses)."""

    @property
    def ettr(self) -> float:
        return self.progress_s / self.wall_s


def simulate(system, trace: Sequence[Failure], horizon_s: float, *, timeline: bool = False) -> Outcome:
    """Run `system` through `trace` until `horizon_s` (wall seconds)."""
    events = [(f.t, 0, i, f) for i, f in enumerate(trace) if f.t < horizon_s]
    heapq.heapify(events)
    down: FrozenSet[int] = frozenset()
    t, progress, approx_progress, fatal, wasted = 0.0, 0.0, 0.0, 0, 0.0
    breakdown: Dict[str, float] = {}
    marks: List[dict] = []
    blocked_until = 0.0  # a transition's downtime ends here; events during it still count

    def advance(to: float) -> None:
        nonlocal t, progress, approx_progress
        start = max(t, blocked_until)
        if to > start:
            r = system.rate(down)
            dt = to - start
            gained = dt * r.speed * (1 - r.dropped)
            progress += gained
            approx_progress += gained * r.approx
            if r.speed < 1:
                breakdown[r.cause] = breakdown.get(r.cause, 0.0) + dt * (1 - r.speed)
            if r.dropped:
                breakdown["dropped"] = breakdown.get("dropped", 0.0) + dt * r.speed * r.dropped
        t = max(t, to)

    def apply(tr: Transition, speed_before: float) -> None:
        nonlocal progress, blocked_until, fatal, wasted
        if tr.downtime_s:
            start = max(t, blocked_until)
            end = min(start + tr.downtime_s, horizon_s)
            breakdown[tr.cause] = breakdown.get(tr.cause, 0.0) + (end - start)
            blocked_until = start + tr.downtime_s
        if tr.lost_s:
            lost = min(tr.lost_s, progress)
            progress -= lost
            wasted += lost / speed_before if speed_before > 0 else lost
            breakdown["lost_work"] = breakdown.get("lost_work", 0.0) + lost
        fatal += tr.fatal

    while events:
        when, kind, _, payload = heapq.heappop(events)
        if when >= horizon_s:
            break
        advance(when)
        speed_before = system.rate(down).speed
        if kind == 0:  # a failure
            down = down | {payload.domain}
            apply(system.on_failure(down, payload), speed_before)
            heapq.heappush(events, (when + payload.repair, 1, payload.domain, payload.domain))
        else:
            down = down - {payload}
            apply(system.on_repair(down, payload), speed_before)
        if timeline:
            r = system.rate(down)
            marks.append({"t": when, "down": len(down), "speed": r.speed * (1 - r.dropped), "approx": r.approx})
    advance(horizon_s)
    counters = system.counters() if hasattr(system, "counters") else {}
    return Outcome(horizon_s, progress, breakdown, approx_progress / progress if progress else 0.0, fatal, marks,
                   wasted, counters)
