"""Chaos: seeded random failure schedules, a runner, and the invariants every run must satisfy.

A `Schedule` is a list of injected faults (kill = SIGKILL, hang = SIGSTOP) at exact (rank, step,
phase, incarnation) points, plus the launcher's restart delay. `random_schedule(seed, ...)` draws
the orders real clusters see: several failures close together, the lowest rank (the one that
decides commits), the covering neighbour of an earlier victim, a rank while it is being restarted
(phases "join" and "transfer" of incarnation 1), failures during a recovery. `run_schedule` runs a
training script under mecefo-launch with those faults; `check_run` reads the script's JSONL logs
and the launcher's exit status and returns the violated invariants (an empty list is a pass):

  (a) the run ends within `time_bound(...)`, computed from the configured timeouts;
  (b) if it finishes (exit 0): every step 0..N-1 was committed by one generation, consumed every
      micro-batch of the global batch exactly once, and the replicas were bit-identical at the start
      of every step (`param_sha256` in the step records);
  (c) if it cannot finish: it gave up cleanly (exit 3): a rank recorded why, the reason is a real
      impossibility (the recorded survivors cannot be covered, or no rank with the state is left),
      and when a rank holding the state gave up, a checkpoint of the last committed step exists.

Script-specific checks (final parameters against a fault-free reference) are the caller's. A
failing schedule is reproduced with `Schedule.flags()` on the same command line.
"""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Union

from megatron_mecefo.elastic.plan.fold import fold_neighbor
from megatron_mecefo.elastic.plan.topology import CoverMap, Grid, ring_cover
from megatron_mecefo.errors import NoCoverAvailable
from megatron_mecefo.log import read_jsonl

__all__ = ["Fault", "Schedule", "random_schedule", "straggler_schedule", "run_schedule", "check_run", "check_steps",
           "generation_plans", "time_bound", "RunResult"]

_TRAIN_PHASES = ("forward", "backward", "allreduce", "optimizer", "recovery", "admit")
_REJOIN_PHASES = ("join", "transfer", "forward", "allreduce")


@dataclasses.dataclass(frozen=True)
class Fault:
    kind: str
    """"kill" (SIGKILL), "hang" (SIGSTOP), or "hold" (every rank waits at `step` until incarnation
    `incarnation` of `rank` asks to rejoin: a later fault keyed to the rejoin fires on any machine)."""
    rank: int
    step: Union[int, str]
    """The step it fires at, or "*" (the first time the rank reaches `phase`)."""
    phase: str
    incarnation: int = 0
    factor: float = 1.0
    """A "slow" fault: the rank's compute takes this many times as long from `step` ..."""
    until: Optional[int] = None
    """... up to this step (None: to the end)."""

    def flag(self) -> str:
        if self.kind == "slow":
            return f"slow:{self.rank}:{self.factor:g}:{self.step}" + (f":{self.until}" if self.until is not None else "")
        if self.kind == "hold":
            return f"hold:{self.rank}:{self.step}:{self.incarnation}"
        text = f"{self.kind}:{self.rank}:{self.step}:{self.phase}"
        return text + (f":{self.incarnation}" if self.incarnation else "")


@dataclasses.dataclass(frozen=True)
class Schedule:
    seed: int
    world: int
    steps: int
    faults: tuple
    restart_after: Optional[float]
    """Seconds before mecefo-launch restarts a failed rank; None: no restarts."""
    tp: int = 1
    pp: int = 1
    """Tensor and pipeline parallel sizes: `world` ranks hold world / (tp * pp) replicas."""

    @property
    def grid(self) -> Grid:
        return Grid(tp=self.tp, pp=self.pp, dp=self.world // (self.tp * self.pp))

    def flags(self) -> List[str]:
        """The script's `--mecefo-inject` flags."""
        return [x for f in self.faults for x in ("--mecefo-inject", f.flag())]

    def launcher_flags(self) -> List[str]:
        return [] if self.restart_after is None else ["--restart-failed-after", f"{self.restart_after:g}"]

    def describe(self) -> str:
        return (f"seed {self.seed}: mecefo-launch --nproc-per-node {self.world} {' '.join(self.launcher_flags())} "
                f"SCRIPT ... {' '.join(self.flags())}")


def random_schedule(seed: int, world: int, steps: int, *, max_faults: int = 4,
                    restart_choices: Sequence[Optional[float]] = (0.5, 1.0, 2.0, 4.0, None)) -> Schedule:
    """A deterministic random schedule of 1..max_faults faults over `steps` steps of `world` ranks."""
    rng = random.Random(seed)
    restart_after = rng.choice(tuple(restart_choices))
    n = rng.randint(1, max_faults)
    anchor = rng.randrange(1, max(2, steps - 2))
    faults, victims = [], []
    for i in range(n):
        kind = "hang" if rng.random() < 0.3 else "kill"
        roll = rng.random()
        if victims and restart_after is not None and roll < 0.25:  # a restarted victim, while it comes back
            rank, inc = rng.choice(victims), 1
            step = "*" if rng.random() < 0.6 else min(steps - 1, anchor + rng.randint(0, 6))
            phase = rng.choice(_REJOIN_PHASES)
        else:
            if roll < 0.45:
                rank = 0  # the lowest rank decides commits and publishes plans
            elif victims and roll < 0.7:
                rank = (victims[-1] + 1) % world  # the neighbour that covers the last victim
            else:
                rank = rng.randrange(world)
            # the first fault starts a recovery; later ones may strike during it
            inc, phase = 0, rng.choice(_TRAIN_PHASES[:4] if i == 0 else _TRAIN_PHASES + ("recovery",))
            step = min(steps - 1, anchor + (0 if i == 0 else rng.choice((0, 0, 1, 1, 2, 3, 5))))
            if phase == "admit":  # whenever a restarted rank is let back in
                step = "*"
        faults.append(Fault(kind, rank, step, phase, inc))
        victims.append(rank)
        anchor = step if isinstance(step, int) else anchor
    return Schedule(seed, world, steps, tuple(faults), restart_after)


def straggler_schedule(seed: int, world: int, steps: int) -> Schedule:
    """`random_schedule`'s kills and hangs with one or two slow-downs (1.5x to 3x, some transient)
    laid over them: one before the first fault, so a rebalanced plan is in place when it strikes,
    the other anywhere."""
    base = random_schedule(seed, world, steps)
    rng = random.Random(10_000 + seed)
    first = min(f.step for f in base.faults if isinstance(f.step, int)) if any(
        isinstance(f.step, int) for f in base.faults) else steps // 2
    slow = []
    for i in range(rng.randint(1, 2)):
        start = rng.randrange(0, max(1, first - 2)) if i == 0 else rng.randrange(0, steps - 2)
        until = None if rng.random() < 0.5 else min(steps, start + rng.randint(3, 12))
        slow.append(Fault("slow", rng.randrange(world), start, "allreduce", 0, rng.choice((1.5, 2.0, 3.0)), until))
    return dataclasses.replace(base, faults=base.faults + tuple(slow))


def time_bound(*, faults: int, collective_timeout_s: float, agree_timeout_s: float, heartbeat_timeout_s: float,
               restart_after: Optional[float], startup_s: float, fault_free_s: float) -> float:
    """The longest a run may take: a fault-free run, plus per fault a detection (collective
    timeout), an agreement that waits out its deadline twice, a commit decision timeout, a
    heartbeat, a restart and a start-up."""
    per_fault = collective_timeout_s + 3 * agree_timeout_s + heartbeat_timeout_s + (restart_after or 0) + startup_s
    return fault_free_s + startup_s + faults * per_fault


@dataclasses.dataclass
class RunResult:
    returncode: Optional[int]
    """None: the run did not end within its limit and was killed."""
    elapsed_s: float
    stdout: str
    stderr: str


def run_schedule(schedule: Schedule, script: Sequence[str], out: Path, *, limit_s: float,
                 launcher_args: Sequence[str] = (), cwd: Optional[str] = None,
                 env: Optional[Dict[str, str]] = None) -> RunResult:
    """Run `script` (path + its arguments) under mecefo-launch with the schedule's faults.

    The launcher runs in its own session; past `limit_s` the whole process group is killed and the
    result has returncode None (a hang)."""
    cmd = [sys.executable, "-m", "megatron_mecefo.elastic.launch", "--nproc-per-node", str(schedule.world),
           "--master-port", "0", "--max-restarts", "10", *schedule.launcher_flags(), *launcher_args,
           *script, *schedule.flags()]
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with open(out / "launcher.out", "w") as fo, open(out / "launcher.err", "w") as fe:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=fo, stderr=fe, start_new_session=True)
        try:
            code: Optional[int] = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
    return RunResult(code, time.monotonic() - t0, (out / "launcher.out").read_text(errors="replace"),
                     (out / "launcher.err").read_text(errors="replace"))


def step_records(log_dir: Path, world: int) -> Dict[int, List[dict]]:
    by_step: Dict[int, List[dict]] = defaultdict(list)
    for r in range(world):
        for rec in read_jsonl(log_dir / f"steps_rank{r}.jsonl"):
            by_step[rec["step"]].append(rec)
    return by_step


def events(log_dir: Path, world: int, name: str) -> List[dict]:
    return [e for r in range(world) for e in read_jsonl(log_dir / f"events_rank{r}.jsonl") if e["event"] == name]


def generation_plans(log_dir: Path, world: int) -> Dict:
    """Generation -> its plan's assignments as the regroup events logged them (replicas absent run
    their own k micro-batches); (generation, step) -> the plan from that step on where a rebalance
    event (fail-slow) replaced it."""
    plans: Dict = {e["generation"]: e["plan"]["assignments"] for e in events(log_dir, world, "regroup") if "plan" in e}
    plans.update({(e["generation"], e["step"]): e["plan"]["assignments"] for e in events(log_dir, world, "rebalance")})
    return plans


def _plan_at(plans: Dict, generation: int, step: int) -> Optional[dict]:
    """The assignments generation `generation` ran `step` with (`generation_plans`), or None."""
    since = [s for g, s in (key for key in plans if isinstance(key, tuple)) if g == generation and s <= step]
    return plans[(generation, max(since))] if since else plans.get(generation)


def check_steps(records: Dict[int, List[dict]], grid: Grid, k: int, last: int,
                plans: Optional[Dict[int, dict]] = None, first: int = 0) -> List[str]:
    """The violations in the step records (`step_records`) of a run that committed steps
    first..last-1 (`first`: the step it loaded): each step committed by one generation, each
    (tp, pp) position's ranks together ran the global batch exactly once, and held bit-identical
    shards at its start. `plans` (`generation_plans`) tells what a rank that died after a commit
    ran; without it, the neighbour rule's fold."""
    bad = []
    steps = list(range(first, last))
    if sorted(records) != steps:
        bad.append(f"committed steps are not {first}..{last - 1}: missing {sorted(set(steps) - set(records))[:10]}, "
                   f"extra {sorted(set(records) - set(steps))[:10]}")
    full = [(d, j) for d in range(grid.dp) for j in range(k)]
    for step in sorted(records):
        bad += _check_step(step, records, grid, k, full, plans or {})
        if len(bad) > 12:
            break
    return bad


def _died_after_commit(step: int, records: Dict[int, List[dict]], grid: Grid, k: int, plans: Dict[int, dict]) -> tuple:
    """Members of the generation that committed `step` but never wrote its record: SIGKILLed
    between the store's commit decision and their write. Legitimate only if the generation never
    went on with them. Returns ((tp, pp) position -> the micro-batches they ran, violations)."""
    recs = records[step]
    generation, live = recs[0]["generation"], recs[0]["live"]
    silent = sorted(set(live) - {r["rank"] for r in recs})
    plan = CoverMap(grid, tuple(grid.live_replicas(live)), {int(f): c for f, c in recs[0]["cover"].items()})
    ran: Dict[tuple, list] = defaultdict(list)
    bad = []
    for rank in silent:
        later = [s for s in records if s > step and any(
            r["generation"] == generation and rank in r["live"] for r in records[s])]
        if later:
            bad.append(f"rank {rank} has no record of step {step}, yet generation {generation} went on with it "
                       f"(step {later[0]})")
        replica, assignments = grid.replica_of(rank), _plan_at(plans, generation, step)
        if assignments is not None:
            ran[grid.position(rank)] += [(m[0], m[1]) for m in assignments.get(str(replica),
                                                                                [[replica, j] for j in range(k)])]
        else:
            ran[grid.position(rank)] += [(m.replica, m.index) for m in fold_neighbor(plan, k).micro_batches(replica)]
    return ran, bad


def _check_step(step: int, by_step: Dict[int, List[dict]], grid: Grid, k: int, full: list,
                plans: Dict[int, dict]) -> List[str]:
    bad, records = [], by_step[step]
    if len({r["generation"] for r in records}) != 1:
        bad.append(f"step {step} committed by several generations: {sorted({r['generation'] for r in records})}")
        return bad
    ranks = [r["rank"] for r in records]
    if len(ranks) != len(set(ranks)):
        bad.append(f"step {step} committed twice by one rank: {sorted(ranks)}")
    silent, why = _died_after_commit(step, by_step, grid, k, plans)
    bad += why
    for position in sorted({grid.position(r) for r in ranks} | set(silent)):
        recs = [r for r in records if grid.position(r["rank"]) == position]
        where = f" at position (tp, pp) = {position}" if grid.tp * grid.pp > 1 else ""
        mbs = sorted([(m[0], m[1]) for r in recs for m in r["micro_batches"]] + silent.get(position, []))
        if mbs != full:
            bad.append(f"step {step} did not consume the global batch exactly once{where}: {mbs}")
        if len({r.get("param_sha256") for r in recs}) > 1:
            bad.append(f"replicas differ at the start of step {step}{where}")
    return bad


def check_run(result: RunResult, log_dir: Path, schedule: Schedule, *, k: int, bound_s: float) -> tuple:
    """Check the invariants of one run. Returns (outcome, violations): outcome is "finished",
    "gave_up" or "failed"; violations is a list of strings (empty: the run ended well)."""
    bad: List[str] = []
    world, grid = schedule.world, schedule.grid
    if result.returncode is None:
        return "failed", [f"did not end within {result.elapsed_s:.0f} s (hung)"]
    if result.elapsed_s > bound_s:
        bad.append(f"took {result.elapsed_s:.0f} s, over the bound of {bound_s:.0f} s")
    records = step_records(log_dir, world)
    if result.returncode == 0:
        bad += check_steps(records, grid, k, schedule.steps, generation_plans(log_dir, world))
        return ("finished" if not bad else "failed"), bad
    if result.returncode != 3:
        return "failed", bad + [f"launcher exit status {result.returncode} (expected 0, or 3 for a clean give-up)"]
    last = max(records) + 1 if records else 0
    bad += check_steps(records, grid, k, last, generation_plans(log_dir, world))
    gave_up = events(log_dir, world, "gave_up")
    roots = [e for e in gave_up if e["kind"] != "JobAborted"]
    if not roots and "no rank of the job is left running" not in result.stderr:
        bad.append("exit 3 but no rank recorded why it gave up")
    for e in roots:
        if e["kind"] == "NoCoverAvailable":
            try:
                ring_cover(grid, e["members"])
                bad.append(f"gave up for no cover although survivors {e['members']} can be covered")
            except NoCoverAvailable:
                pass
        elif e["kind"] == "ShardLost":  # sharded state: owner and copy holder failed together
            if sum(f.kind in ("kill", "hang") for f in schedule.faults) < 2:
                bad.append(f"lost a shard of the optimizer state with fewer than two failures: {e['reason']}")
        elif e["kind"] != "StateLost":
            bad.append(f"gave up for {e['kind']}: {e['reason']}")
    # a checkpoint is owed when a rank of a whole surviving replica held the state (a replica that lost
    # a rank holds only some shards)
    holders = [e for e in gave_up if e.get("has_state")]
    if grid.tp * grid.pp > 1 and roots:
        whole = set(grid.live_replicas(roots[0]["members"]))
        holders = [e for e in holders if grid.replica_of(e["rank"]) in whole]
    written = [e for e in gave_up if e.get("checkpoint")]
    if holders and not written:
        bad.append(f"ranks {[e['rank'] for e in holders]} held the state but no checkpoint was written")
    for e in written:
        if e["step"] != last:
            bad.append(f"checkpoint of step {e['step']}, but {last} steps were committed")
        if not Path(e["checkpoint"]).exists():
            bad.append(f"checkpoint {e['checkpoint']} does not exist")
    if "the job gave up" not in result.stderr:
        bad.append("the launcher did not say why the job ended")
    return ("gave_up" if not bad else "failed"), bad
