"""Fail-slow in the cluster simulator: slow GPUs and links, with and without rebalancing.

A fail-slow episode slows one GPU (and so its whole replica: the replica runs at its slowest
position's pace) or, for a share `job_wide_share` of episodes (a congested data-parallel link),
every replica at once, by a factor, for a while. A synchronous step lasts as long as its slowest
replica or its slowest link, whichever is slower. Without rebalancing the job runs at the pace of the slowest replica; with it, the
runtime's own planner (elastic/plan/rebalance.py) moves whole micro-batches off the replicas it
knows are slow, `window` steps after a slowdown or a recovery shows (the watch's decision delay),
and only for replicas slower than `threshold` (a change smaller than the watch's band is not
re-planned). A job-wide episode cannot be rebalanced: every replica waits for the same link.

The model's numbers (presets.py, each with its source; docs/results.md quotes them):

* duration: log-uniform between 30 s and 10 h, the range FALCON reports for a 10,000-GPU
  production cluster (arXiv 2410.12588, ATC '25 as Greyhound: "tens of seconds to nearly ten
  hours");
* rate: per GPU, Poisson; calibrated (`calibrate`) so that the unmitigated slowdown of the
  reference job is FALCON's 1.34x average delay of job completion time; the study's own rate and
  job sizes were not reachable, so the rate is a calibration, not a measurement;
* severity: log-uniform between 1.1x and 3x (assumed: FALCON's severity distribution was not
  reachable; Greyhound's artifact slows GPUs by 10-30 % by locking clocks, and this project's
  benchmark injects 1.25x-2x).

The planner sees the true factors (a perfect measurement: the runtime's per-micro-batch reading,
which includes per-step fixed costs, is not modelled). Exactness: healthy replicas beyond those
that can receive a moved micro-batch never receive one, so the planner runs on the slow replicas
plus that many healthy ones (the lowest indices, where its ties go) with the same result.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import random
import statistics
from typing import Dict, List, Optional, Tuple

from megatron_mecefo.elastic.plan.cover_plan import Costs
from megatron_mecefo.elastic.plan.fold import Fold, MicroBatch
from megatron_mecefo.elastic.plan.rebalance import rebalance, replica_times
from megatron_mecefo.elastic.plan.topology import Grid
from megatron_mecefo.sim import presets

__all__ = ["Slow", "FailSlowModel", "Rebalance", "run", "calibrate", "FALCON_JCT_DELAY"]

HOUR = presets.HOUR
FALCON_JCT_DELAY = presets.FALCON_JCT_DELAY


@dataclasses.dataclass(frozen=True, order=True)
class Slow:
    t: float
    gpu: int
    factor: float
    duration_s: float
    job_wide: bool = False


@dataclasses.dataclass(frozen=True)
class FailSlowModel:
    per_gpu_per_hour: float
    duration_s: Tuple[float, float] = presets.FAILSLOW_DURATION_S
    severity: Tuple[float, float] = presets.FAILSLOW_SEVERITY
    job_wide_share: float = presets.FAILSLOW_JOB_WIDE_SHARE
    """Episodes that slow every replica (a congested data-parallel link)."""

    def __post_init__(self) -> None:
        if not self.per_gpu_per_hour >= 0:
            raise ValueError(f"fail-slow rate must be >= 0, got {self.per_gpu_per_hour}")
        if not 0 < self.duration_s[0] <= self.duration_s[1] or not 1 < self.severity[0] <= self.severity[1]:
            raise ValueError(f"need 0 < duration lo <= hi and 1 < severity lo <= hi, got {self.duration_s}, {self.severity}")
        if not 0 <= self.job_wide_share <= 1:
            raise ValueError(f"job_wide_share must be in [0, 1], got {self.job_wide_share}")

    def trace(self, gpus: int, hours: float, seed: int) -> List[Slow]:
        rng = random.Random(seed)
        rate, t, out = self.per_gpu_per_hour * gpus / HOUR, 0.0, []
        while rate > 0:
            t += rng.expovariate(rate)
            if t >= hours * HOUR:
                break
            out.append(Slow(t, rng.randrange(gpus), _log_uniform(rng, *self.severity),
                            _log_uniform(rng, *self.duration_s), rng.random() < self.job_wide_share))
        return out


@dataclasses.dataclass(frozen=True)
class Rebalance:
    threshold: float = 1.2
    window: int = 5


def _log_uniform(rng: random.Random, lo: float, hi: float) -> float:
    return math.exp(rng.uniform(math.log(lo), math.log(hi)))


class _Job:
    """Replica factors now, the planner's view of them, and the step time they give."""

    def __init__(self, grid: Grid, k: int, policy: Optional[Rebalance]) -> None:
        self.grid, self.k, self.policy = grid, k, policy
        self.per_replica = grid.tp * grid.pp
        self.active: Dict[int, List[float]] = {}  # replica -> factors of its active episodes
        self.job_wide: List[float] = []
        self.planned: Dict[int, float] = {}
        self.version: Dict[int, int] = {}
        self.replans = 0

    def factor(self, r: int) -> float:
        return max(self.active.get(r) or [1.0])

    def step_time(self) -> float:
        """Relative to a healthy step: the slowest replica's factor x its share of micro-batches, or a
        congested link's factor where that is slower (the step waits for whichever is slowest; the
        two are not compounded)."""
        wide = max(self.job_wide or [1.0])
        slow = {r for r, fs in self.active.items() if fs} | set(self.planned)
        if not slow:
            return wide
        if not self.planned:
            return max(wide, max(self.factor(r) for r in slow))
        healthy = [r for r in range(self.grid.dp) if r not in slow]
        pool = healthy[:len(self.planned) * (self.k - 1)]
        fold = Fold({r: tuple(MicroBatch(r, j, False) for j in range(self.k)) for r in sorted(slow | set(pool))},
                    divisor=self.grid.dp * self.k, divisor_mha=self.grid.dp * self.k)
        plan = rebalance(fold, self.planned, Costs())
        times = replica_times(plan, Costs(), {r: self.factor(r) for r in slow})
        return max(wide, max(times.values()) / self.k)

    def decide(self, r: int) -> bool:
        """The watch's rule on replica r after a whole window at its current factor. True: re-planned."""
        f, planned, band = self.factor(r), self.planned.get(r), (self.policy.threshold - 1) / 2
        if planned is None and f > self.policy.threshold:
            self.planned[r] = f
        elif planned is not None and f < 1 + band:
            del self.planned[r]
        elif planned is not None and abs(f / planned - 1) > band:
            self.planned[r] = f
        else:
            return False
        self.replans += 1
        return True


def run(trace: List[Slow], grid: Grid, hours: float, *, micro_batches: int = 8, step_s: float = 10.0,
        policy: Optional[Rebalance] = None) -> Dict[str, float]:
    """The job through `trace` for `hours`: `slowdown` (wall time over healthy time for the same
    steps), `throughput` (its inverse), `replans` and the share of time any replica was slow."""
    job = _Job(grid, micro_batches, policy)
    events: List[tuple] = []  # (t, order: ends and decisions before starts, episode, kind, payload)
    for i, s in enumerate(trace):
        heapq.heappush(events, (s.t, 1, i, "start", s))
    horizon, t, progress, slow_time = hours * HOUR, 0.0, 0.0, 0.0
    step = 1.0
    while events and events[0][0] < horizon:
        when, _, i, kind, s = heapq.heappop(events)
        progress += (when - t) / step
        slow_time += (when - t) * (step > 1.0)
        t = when
        if kind in ("start", "end"):
            bucket = job.job_wide if s.job_wide else job.active.setdefault(s.gpu // job.per_replica, [])
            if kind == "start":
                bucket.append(s.factor)
                heapq.heappush(events, (when + s.duration_s, 0, i, "end", s))
            else:
                bucket.remove(s.factor)
            step = job.step_time()
            if policy is not None and not s.job_wide:
                r = s.gpu // job.per_replica
                job.version[r] = job.version.get(r, 0) + 1
                # the watch decides after `window` steps at the new pace
                heapq.heappush(events, (when + policy.window * step_s * step, 0, i, "decide", (r, job.version[r])))
        elif job.version.get(s[0]) == s[1] and job.decide(s[0]):
            step = job.step_time()
    progress += (horizon - t) / step
    slow_time += (horizon - t) * (step > 1.0)
    return {"slowdown": horizon / progress, "throughput": progress / horizon, "replans": job.replans,
            "slow_time_share": slow_time / horizon}


def mean_slowdown(model: FailSlowModel, grid: Grid, hours: float, seeds: int, **kw) -> float:
    gpus = grid.tp * grid.pp * grid.dp
    return statistics.mean(run(model.trace(gpus, hours, seed), grid, hours, **kw)["slowdown"] for seed in range(seeds))


def calibrate(grid: Grid, hours: float, seeds: int, *, target: float = FALCON_JCT_DELAY, **model_kw) -> FailSlowModel:
    """The per-GPU rate at which the unmitigated job on `grid` is `target` times slower (bisection
    on a log scale; the slowdown grows with the rate)."""
    lo, hi = 1e-7, 1.0
    for _ in range(40):
        mid = math.sqrt(lo * hi)
        if mean_slowdown(FailSlowModel(mid, **model_kw), grid, hours, seeds) < target:
            lo = mid
        else:
            hi = mid
        if hi / lo < 1.01:
            break
    return FailSlowModel(math.sqrt(lo * hi), **model_kw)
