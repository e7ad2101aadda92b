"""Deterministic failure injection for tests, demos and benchmarks.

`FaultInjector().kill_at(rank, step, phase).hang_at(rank, step, phase)` or
`FaultInjector.from_rules(cfg.inject)`. The training loop (or the engine hook) calls
`maybe_fire(step, phase)` at the phase boundaries forward | backward | allreduce | optimizer; the
runtime itself fires "allreduce", "recovery" (after the agreement on a new generation), "join" (a
restarted rank, once admitted, before its generation forms) and "transfer" (every member of a
generation that hands the state to joiners, between the size and the payload) and "admit" (every
member, right after a commit decision that admits restarted ranks). A rule fires in the
incarnation it names (0, the first start, by default; a restarted rank does not kill itself again
unless a rule names its incarnation) at its step, or at any step with step "*":
"kill" is SIGKILL (a crash), "hang" is SIGSTOP (alive but silent, heartbeat frozen).

Under a launcher that kills every rank when one exits non-zero (the `deepspeed` launcher), the
injector is built with `soft=True`: "kill" ends the process at once with status 0 (`os._exit`, no
cleanup: peers see the same closed connections as after a crash) and "hang" stops the heartbeat
and blocks until the job has finished, then exits 0. Survivors recover exactly as from the real
thing; the launcher leaves them running.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import signal
import sys
from typing import Iterable, List, Mapping, Sequence

__all__ = ["FaultInjector", "PHASES", "TraceEvent", "failure_trace", "trace_from_events", "PAPER_SCENARIOS"]

logger = logging.getLogger(__name__)

PHASES = ("forward", "backward", "allreduce", "optimizer", "recovery", "join", "transfer", "admit")

PAPER_SCENARIOS = {"low": (2.0, 4.0), "medium": (1.0, 3.0), "high": (0.5, 2.0)}
"""The paper's failure scenarios: (mean time between failures, recovery time) in hours."""


@dataclasses.dataclass(frozen=True)
class TraceEvent:
    rank: int
    fail_step: int
    rejoin_step: int
    incarnation: int
    """Which incarnation of `rank` fails here (0 = first start)."""


def trace_from_events(events: Iterable[Sequence[int]]) -> List[TraceEvent]:
    """TraceEvents from [rank, fail_step, rejoin_step] triples (incarnations numbered per rank)."""
    out, seen = [], {}
    for rank, fail, rejoin in sorted(((int(r), int(f), int(j)) for r, f, j in events), key=lambda e: (e[1], e[0])):
        out.append(TraceEvent(rank, fail, rejoin, seen.get(rank, 0)))
        seen[rank] = seen.get(rank, 0) + 1
    return out


def failure_trace(world: int, total_steps: int, mtbf_steps: float, recovery_steps: int, seed: int = 0) -> List[TraceEvent]:
    """A deterministic failure trace: Poisson arrivals (job-wide mean gap `mtbf_steps`), each taking
    one healthy rank down for `recovery_steps`. A failure that would leave some failed replica
    without a neighbour (more than MeCeFO can absorb) is skipped. Pure: every rank computes the
    same trace from the same arguments.
    """
    from megatron_mecefo.elastic.topology import Grid, plan_cover
    from megatron_mecefo.errors import NoCoverAvailable

    if mtbf_steps <= 0 or recovery_steps < 1:
        raise ValueError("failure_trace needs mtbf_steps > 0 and recovery_steps >= 1")
    rng = random.Random(seed)
    grid = Grid(dp=world)
    events: List[TraceEvent] = []
    incarnations = [0] * world
    t = rng.expovariate(1.0 / mtbf_steps)
    while t < total_steps:
        step = max(1, int(t))
        down = {e.rank for e in events if e.fail_step <= step < e.rejoin_step}
        healthy = [r for r in range(world) if r not in down]
        rng.shuffle(healthy)
        for victim in healthy:
            try:
                plan_cover(grid, [r for r in range(world) if r not in down and r != victim])
            except NoCoverAvailable:
                continue
            events.append(TraceEvent(victim, step, step + recovery_steps, incarnations[victim]))
            incarnations[victim] += 1
            break
        t += rng.expovariate(1.0 / mtbf_steps)
    return events


class FaultInjector:
    """Kill or hang this process at an exact (rank, step, phase)."""

    def __init__(self, rank: int = 0, incarnation: int = 0, soft: bool = False) -> None:
        self.rank = rank
        self.incarnation = incarnation
        self.soft = soft
        self.rules: List[dict] = []
        self.on_soft_hang = None  # set by the runtime: stop heartbeats, wait for the job's end
        self.events = None  # an EventLog: the firing time is recorded before the signal

    def _add(self, kind: str, rank: int, step, phase: str, incarnation: int = 0) -> "FaultInjector":
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
        self.rules.append({"kind": kind, "rank": rank, "step": step, "phase": phase, "incarnation": incarnation})
        return self

    def add_trace(self, events: Iterable[TraceEvent], phase: str = "backward") -> "FaultInjector":
        """Kill each event's rank at its fail step, in the incarnation the event names."""
        for e in events:
            self._add("kill", e.rank, e.fail_step, phase, e.incarnation)
        return self

    def kill_at(self, rank: int, step, phase: str = "backward", incarnation: int = 0) -> "FaultInjector":
        return self._add("kill", rank, step, phase, incarnation)

    def hang_at(self, rank: int, step, phase: str = "backward", incarnation: int = 0) -> "FaultInjector":
        return self._add("hang", rank, step, phase, incarnation)

    @classmethod
    def from_rules(cls, rules: Iterable[Mapping], rank: int, incarnation: int = 0, soft: bool = False) -> "FaultInjector":
        inj = cls(rank, incarnation, soft)
        for r in rules:
            step = r["step"] if r["step"] == "*" else int(r["step"])
            inj._add(r["kind"], int(r["rank"]), step, r.get("phase", "backward"), int(r.get("incarnation", 0)))
        return inj

    def maybe_fire(self, step: int, phase: str) -> None:
        for rule in self.rules:
            if (rule["rank"], rule["phase"], rule["incarnation"]) == (self.rank, phase, self.incarnation) \
                    and rule["step"] in (step, "*"):
                msg = f"[mecefo inject] rank {self.rank}: {rule['kind']} at step {step} ({phase})"
                print(msg, file=sys.stderr, flush=True)
                if self.events is not None:
                    self.events.write("inject", kind=rule["kind"], step=step, phase=phase)
                if self.soft:
                    if rule["kind"] == "hang" and self.on_soft_hang is not None:
                        self.on_soft_hang()
                    os._exit(0)
                os.kill(os.getpid(), signal.SIGKILL if rule["kind"] == "kill" else signal.SIGSTOP)
