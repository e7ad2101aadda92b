"""Deterministic failure injection for tests, demos and benchmarks.

`FaultInjector().kill_at(rank, step, phase).hang_at(rank, step, phase)` or
`FaultInjector.from_rules(cfg.inject)`. The training loop (or the engine hook) calls
`maybe_fire(step, phase)` at the phase boundaries forward | backward | allreduce | optimizer; the
runtime itself fires "allreduce", "recovery" (after the agreement on a new generation), "join" (a
restarted rank, once admitted, before its generation forms) and "transfer" (every member of a
generation that hands the state to joiners, between the size and the payload) and "admit" (every
member, right after a commit decision that admits restarted ranks) and "reshard" (every member of
a new generation with a sharded optimizer state, after the layout is shared and before the state
and parameters move). A rule fires in the
incarnation it names (0, the first start, by default; a restarted rank does not kill itself again
unless a rule names its incarnation) at its step, or at any step with step "*":
"kill" is SIGKILL (a crash), "hang" is SIGSTOP (alive but silent, heartbeat frozen). "commit" is
reached after the step's last collective (the commit's confirmation) completed on this rank; an
"error" there (that phase only) makes the rank see that collective fail although its peers'
completed, the window in which some members commit a step and others do not.

"hold" makes the job wait for a restarted rank instead of for the clock: every member waits at the
start of the named step until the named incarnation (default 1; 0 for a rank that started too late
for the first generation) of the named rank has asked to join, and that incarnation asks only once
the job has committed the step before, so a test or demo that needs a rejoin, or a fault during
one, gets it at that step on any machine, however long or short a process takes to start. The
commit of that step admits the rank.

A kill is a real SIGKILL and a hang a real SIGSTOP under every launcher: under one that is not
mecefo-launch the rank's keeper (keeper.py) absorbs the crash as mecefo-launch does.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import signal
import sys
import time
from typing import Iterable, List, Mapping, Optional, Sequence

from megatron_mecefo.fault_rules import KINDS, PAPER_SCENARIOS, PHASES, RULE_FORMAT, parse_rules, parse_trace

__all__ = ["FaultInjector", "InjectedError", "KINDS", "PHASES", "TraceEvent", "failure_trace", "trace_from_events", "PAPER_SCENARIOS",
           "check_rules", "check_job", "check_trace", "job_trace", "parse_rules", "parse_trace", "REJOIN_SLACK", "RULE_FORMAT"]

logger = logging.getLogger(__name__)

REJOIN_SLACK = 2
"""Steps a restarted rank is still counted down after its trace's rejoin step: it is admitted at a
step boundary once it is back, not at the rejoin step itself."""


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


def _down(events: Sequence[TraceEvent], step: int) -> set:
    return {e.rank for e in events if e.fail_step <= step < e.rejoin_step + REJOIN_SLACK}


def failure_trace(world: int, total_steps: int, mtbf_steps: float, recovery_steps: int, seed: int = 0,
                  max_restarts: Optional[int] = None) -> List[TraceEvent]:
    """A deterministic failure trace: Poisson arrivals (job-wide mean gap `mtbf_steps`), each taking
    one healthy rank down for `recovery_steps`. A failure that would leave some failed replica
    without a neighbour (more than MeCeFO can absorb) is skipped. A rank that has used up its
    `max_restarts` (None: unlimited; 0 under a launcher that does not restart) stays down to the end
    once it fails. Pure: every rank computes the same trace from the same arguments.
    """
    from megatron_mecefo.elastic.plan.topology import Grid

    if mtbf_steps <= 0 or recovery_steps < 1:
        raise ValueError("failure_trace needs mtbf_steps > 0 and recovery_steps >= 1")
    rng = random.Random(seed)
    grid = Grid(dp=world)
    events: List[TraceEvent] = []
    incarnations = [0] * world
    t = rng.expovariate(1.0 / mtbf_steps)
    while t < total_steps:
        step = max(1, int(t))
        down = _down(events, step)
        healthy = [r for r in range(world) if r not in down]
        rng.shuffle(healthy)
        for victim in healthy:
            restartable = max_restarts is None or incarnations[victim] < max_restarts
            rejoin = step + recovery_steps if restartable else max(total_steps, step + 1)
            trial = events + [TraceEvent(victim, step, rejoin, incarnations[victim])]
            if not _absorbable(grid, trial, step):  # events come in time order: only this step can break
                continue
            events.append(trial[-1])
            incarnations[victim] += 1
            break
        t += rng.expovariate(1.0 / mtbf_steps)
    return events


def _absorbable(grid, events: Sequence[TraceEvent], step: int) -> bool:
    from megatron_mecefo.elastic.plan.topology import ring_cover
    from megatron_mecefo.errors import NoCoverAvailable

    try:
        ring_cover(grid, [r for r in range(grid.world) if r not in _down(events, step)])
        return True
    except NoCoverAvailable:
        return False


def check_rules(rules: Iterable[Mapping], world: int) -> None:
    """Injection rules must name ranks of the job. Raises ValueError naming the rule."""
    for r in rules:
        if not 0 <= int(r["rank"]) < world:
            what = f'slow:{r["rank"]}:{r["factor"]}:{r["from"]}' if r["kind"] == "slow" else \
                f'{r["kind"]}:{r["rank"]}:{r["step"]}:{r.get("phase", "backward")}'
            raise ValueError(
                f'mecefo "inject" rule {what} names rank '
                f'{r["rank"]}, but the job has {world} ranks (0..{world - 1}): it would never fire')


def check_trace(events: Sequence[TraceEvent], world: int, total_steps: int, max_restarts: Optional[int]) -> None:
    """Reject a trace that cannot run as written, before training. Raises ValueError naming the event.

    Checks: ranks in range; a rank fails again only after its rejoin step; every failure is
    absorbable under the ring cover map (counting a restarted rank down until REJOIN_SLACK steps
    after its rejoin step); a rank that must come back before the end is within `max_restarts`
    (None: not known, not checked; 0: the launcher restarts nobody).
    """
    from megatron_mecefo.elastic.plan.topology import Grid

    grid = Grid(dp=world)
    name = lambda e: f"[{e.rank}, {e.fail_step}, {e.rejoin_step}]"  # noqa: E731
    restarts = [0] * world
    last = {}
    for e in sorted(events, key=lambda e: (e.fail_step, e.rank)):
        if not 0 <= e.rank < world:
            raise ValueError(f'mecefo "trace" event {name(e)}: rank {e.rank} is not a rank of this job (0..{world - 1})')
        if e.rejoin_step <= e.fail_step:
            raise ValueError(f'mecefo "trace" event {name(e)}: the rejoin step must come after the failure step')
        prev = last.get(e.rank)
        if prev is not None and e.fail_step < prev.rejoin_step + REJOIN_SLACK:
            raise ValueError(
                f'mecefo "trace" event {name(e)}: rank {e.rank} is still down then (event {name(prev)}; a restarted '
                f"rank is back {REJOIN_SLACK} steps after its rejoin step)")
        last[e.rank] = e
        if e.fail_step >= total_steps:
            continue
        if not _absorbable(grid, events, e.fail_step):
            down = sorted(_down(events, e.fail_step))
            raise ValueError(
                f'mecefo "trace" event {name(e)}: at step {e.fail_step} ranks {down} are down and some failed replica '
                "has no healthy, non-covering neighbour left (MeCeFO absorbs at most one failed replica per live "
                "replica): MeCeFO cannot absorb this trace")
        if e.rejoin_step < total_steps:
            restarts[e.rank] += 1
            if max_restarts is not None and restarts[e.rank] > max_restarts:
                raise ValueError(
                    f'mecefo "trace" event {name(e)}: rank {e.rank} must be restarted {restarts[e.rank]} times by then, '
                    f"but the launcher restarts a rank at most {max_restarts} times "
                    + ("(mecefo-launch --max-restarts)" if max_restarts else
                       "(no restarts: use mecefo-launch --restart-failed-after SECONDS)"))


def job_trace(trace: Mapping, world: int, total_steps: int, max_restarts: Optional[int]) -> List[TraceEvent]:
    """The TraceEvents of a validated config "trace" for this job: a replayed trace is checked
    (ValueError naming the event), a generated one leaves out what cannot be absorbed."""
    if "events" in trace:
        events = trace_from_events(trace["events"])
        check_trace(events, world, total_steps, max_restarts)
        return events
    return failure_trace(world, total_steps, trace["mtbf_steps"], trace["recovery_steps"], trace["seed"],
                         max_restarts=max_restarts)


def check_job(config, world: int, *, model_parallel: int = 1, train_iters: Optional[int] = None,
              max_restarts: Optional[int] = None) -> List[TraceEvent]:
    """Every check of a MeCeFOConfig's "inject" and "trace" against the job, before anything is
    built: the rules name ranks of the job, a trace runs with T = P = 1 and can be absorbed as
    written. Returns the trace's events (empty without one). Called by the runtime and, earlier,
    by the hosts that can fail fast (the examples, the patched checkouts).

    Raises:
        ValueError: naming the rule, the event or the setting.
    """
    check_rules(config.inject, world)
    if config.trace is None:
        return []
    if model_parallel > 1:
        raise ValueError('mecefo "trace" needs tensor and pipeline parallel size 1 (use "inject" rules / '
                         "--mecefo-inject with tensor or pipeline parallelism)")
    if train_iters is None:
        raise ValueError('mecefo "trace" needs the job\'s length (train_iters) to lay out the failures')
    return job_trace(config.trace, world, train_iters, max_restarts)


class InjectedError(RuntimeError):
    """An "error" rule: the collective of the phase failed on this rank (its peers' completed)."""


class FaultInjector:
    """Kill or hang this process at an exact (rank, step, phase)."""

    def __init__(self, rank: int = 0, incarnation: int = 0) -> None:
        self.rank = rank
        self.incarnation = incarnation
        self.rules: List[dict] = []
        self.trace: List[TraceEvent] = []
        """The job's failure trace (config.trace), as laid out by `for_job`."""
        self.events = None  # an EventLog: the firing time is recorded before the signal
        self.slow: List[dict] = []
        """This rank's slow-downs ({"factor", "from", "to"}; see `stretch`)."""
        self._began = time.monotonic()
        self._slowed: set = set()

    def _add(self, kind: str, rank: int, step, phase: str, incarnation: int = 0) -> "FaultInjector":
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
        self.rules.append({"kind": kind, "rank": rank, "step": step, "phase": phase, "incarnation": incarnation})
        return self

    def add_trace(self, events: Iterable[TraceEvent], phase: str = "backward",
                  hold_until: Optional[int] = None) -> "FaultInjector":
        """Kill each event's rank at its fail step, in the incarnation the event names. With
        `hold_until` (the job's length, when the launcher restarts failed ranks), the job also
        waits at each rejoin step before it for the restarted rank, so the trace plays out as
        written however long a restart takes."""
        for e in events:
            self._add("kill", e.rank, e.fail_step, phase, e.incarnation)
            if hold_until is not None and e.rejoin_step < hold_until:
                self.hold_at(e.rank, e.rejoin_step, e.incarnation + 1)
        return self

    def kill_at(self, rank: int, step, phase: str = "backward", incarnation: int = 0) -> "FaultInjector":
        return self._add("kill", rank, step, phase, incarnation)

    def hang_at(self, rank: int, step, phase: str = "backward", incarnation: int = 0) -> "FaultInjector":
        return self._add("hang", rank, step, phase, incarnation)

    @classmethod
    def for_job(cls, config, job, *, model_parallel: int = 1, train_iters: Optional[int] = None) -> "FaultInjector":
        """This rank's injector for `job` (a LaunchEnv): config.inject's rules, and config.trace laid
        out over the job's `train_iters` steps (checked as `check_job` does; with restarts, the job
        also waits at each rejoin step for the restarted rank).

        Raises:
            ValueError: naming the rule, the event or the setting.
        """
        trace = check_job(config, job.world, model_parallel=model_parallel, train_iters=train_iters,
                          max_restarts=job.max_restarts)
        out = cls.from_rules(config.inject, job.rank, job.incarnation)
        if trace:
            out.trace = trace
            out.add_trace(trace, hold_until=train_iters if job.max_restarts else None)
        return out

    @classmethod
    def from_rules(cls, rules: Iterable[Mapping], rank: int, incarnation: int = 0) -> "FaultInjector":
        inj = cls(rank, incarnation)
        for r in rules:
            if r["kind"] == "slow":
                if int(r["rank"]) == rank:
                    inj.slow.append({"factor": float(r["factor"]), "from": int(r["from"]), "to": r.get("to")})
                continue
            step = r["step"] if r["step"] == "*" else int(r["step"])
            inj._add(r["kind"], int(r["rank"]), step, r.get("phase", "backward"), int(r.get("incarnation", 0)))
        return inj

    def stretch(self, step: int) -> None:
        """At the end of this rank's compute in `step` (the step's statistics, before they are reduced;
        called by the runtime's latch): under a slow-down of factor F,
        wait (F - 1) x the compute since `begin`, so the step's compute takes F times as long. A
        sleep, not a busy loop: a slow GPU does not slow the others, and on a CPU shared by the ranks
        a busy loop would take a core from them (the other replicas would slow down too)."""
        on = [i for i, s in enumerate(self.slow) if s["from"] <= step and (s["to"] is None or step < s["to"])]
        if not on:
            return
        factor = self.slow[on[0]]["factor"]
        if on[0] not in self._slowed:  # once per slow-down, when it first applies
            self._slowed.add(on[0])
            print(f"[mecefo inject] rank {self.rank}: slow x{factor} from step {step}", file=sys.stderr, flush=True)
            if self.events is not None:
                self.events.write("inject", kind="slow", step=step, phase="allreduce", factor=factor)
        time.sleep((factor - 1) * max(0.0, time.monotonic() - self._began))

    def hold_at(self, rank: int, step: int, incarnation: int = 1) -> "FaultInjector":
        """Every member waits at the start of `step` until `incarnation` of `rank` asks to rejoin."""
        return self._add("hold", rank, step, "forward", incarnation)

    def rejoin_step(self, rank: int, incarnation: int) -> Optional[int]:
        """The step a restarted `incarnation` of `rank` rejoins at, if a rule pins it: its trace
        event's rejoin step, or the step of the hold that awaits it. It asks to join only once the
        job has committed the step before (holds.wait_for_rejoin_step), so that step's commit, not
        an earlier one, admits it however fast it restarts; None: it asks as soon as it is up."""
        for e in self.trace:
            if e.rank == rank and e.incarnation == incarnation - 1:
                return e.rejoin_step
        steps = [r["step"] for r in self.rules if r["kind"] == "hold" and (r["rank"], r["incarnation"]) == (rank, incarnation)]
        return min(steps) if steps else None

    def holds(self, step: int) -> List[tuple]:
        """(rank, incarnation) of the restarted ranks the job waits for at the start of `step`."""
        return [(r["rank"], r["incarnation"]) for r in self.rules if r["kind"] == "hold" and r["step"] == step]

    def begin(self) -> None:
        """A step (or its redo) starts: a slow-down stretches the compute from here."""
        self._began = time.monotonic()

    def maybe_fire(self, step: int, phase: str) -> None:
        for rule in self.rules:
            if rule["kind"] != "hold" and rule["step"] in (step, "*") and \
                    (rule["rank"], rule["phase"], rule["incarnation"]) == (self.rank, phase, self.incarnation):
                msg = f"[mecefo inject] rank {self.rank}: {rule['kind']} at step {step} ({phase})"
                print(msg, file=sys.stderr, flush=True)
                if self.events is not None:
                    self.events.write("inject", kind=rule["kind"], step=step, phase=phase)
                if rule["kind"] == "error":
                    raise InjectedError(msg)
                os.kill(os.getpid(), signal.SIGKILL if rule["kind"] == "kill" else signal.SIGSTOP)
