"""Deterministic failure injection for tests, demos and benchmarks.

`FaultInjector().kill_at(rank, step, phase).hang_at(rank, step, phase)` or
`FaultInjector.from_rules(cfg.inject)`. The training loop (or the engine hook) calls
`maybe_fire(step, phase)` at the phase boundaries forward | backward | allreduce | optimizer; the
runtime itself fires "allreduce" and "recovery" (after checking in for a new generation). A rule
fires once, in the rank's first incarnation only (a restarted rank does not kill itself again):
"kill" is SIGKILL (a crash), "hang" is SIGSTOP (alive but silent, heartbeat frozen).

Under a launcher that kills every rank when one exits non-zero (the `deepspeed` launcher), the
injector is built with `soft=True`: "kill" ends the process at once with status 0 (`os._exit`, no
cleanup: peers see the same closed connections as after a crash) and "hang" stops the heartbeat
and blocks until the job has finished, then exits 0. Survivors recover exactly as from the real
thing; the launcher leaves them running.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import Iterable, List, Mapping

__all__ = ["FaultInjector", "PHASES"]

logger = logging.getLogger(__name__)

PHASES = ("forward", "backward", "allreduce", "optimizer", "recovery")


class FaultInjector:
    """Kill or hang this process at an exact (rank, step, phase)."""

    def __init__(self, rank: int = 0, incarnation: int = 0, soft: bool = False) -> None:
        self.rank = rank
        self.incarnation = incarnation
        self.soft = soft
        self.rules: List[dict] = []
        self.on_soft_hang = None  # set by the runtime: stop heartbeats, wait for the job's end
        self.events = None  # an EventLog: the firing time is recorded before the signal

    def _add(self, kind: str, rank: int, step: int, phase: str) -> "FaultInjector":
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
        self.rules.append({"kind": kind, "rank": rank, "step": step, "phase": phase})
        return self

    def kill_at(self, rank: int, step: int, phase: str = "backward") -> "FaultInjector":
        return self._add("kill", rank, step, phase)

    def hang_at(self, rank: int, step: int, phase: str = "backward") -> "FaultInjector":
        return self._add("hang", rank, step, phase)

    @classmethod
    def from_rules(cls, rules: Iterable[Mapping], rank: int, incarnation: int = 0, soft: bool = False) -> "FaultInjector":
        inj = cls(rank, incarnation, soft)
        for r in rules:
            inj._add(r["kind"], int(r["rank"]), int(r["step"]), r.get("phase", "backward"))
        return inj

    def maybe_fire(self, step: int, phase: str) -> None:
        if self.incarnation != 0:
            return
        for rule in self.rules:
            if (rule["rank"], rule["step"], rule["phase"]) == (self.rank, step, phase):
                msg = f"[mecefo inject] rank {self.rank}: {rule['kind']} at step {step} ({phase})"
                print(msg, file=sys.stderr, flush=True)
                if self.events is not None:
                    self.events.write("inject", kind=rule["kind"], step=step, phase=phase)
                if self.soft:
                    if rule["kind"] == "hang" and self.on_soft_hang is not None:
                        self.on_soft_hang()
                    os._exit(0)
                os.kill(os.getpid(), signal.SIGKILL if rule["kind"] == "kill" else signal.SIGSTOP)
