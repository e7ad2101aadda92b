"""The other systems, as engine policies (see engine.py): each a few lines of its published rule.

* `DropSamples` (torchft): a failed replica group's samples are dropped until it heals; the others
  go on at full step speed; each failure discards the in-flight step of every group.
* `Spread` (ReCoVer): the failed replicas' micro-batches are redistributed exactly over the
  survivors; a step waits for the busiest, which runs ceil(D m / (D - f)) of the m micro-batches
  a replica normally runs (speed (D - f) / D when m is large); nothing approximate or dropped.
* `Reconfigure` (Oobleck; Bamboo with `pipeline_stages`): every failure and every repair re-instantiates pipeline templates for
  the nodes left (`reconfig_s`, the in-flight step lost); throughput follows a table of nodes
  alive (default: proportional to them); below `min_domains` no template fits and training stops
  until a repair. Bamboo's redundant computation lets a predecessor run a lost stage at 1.5x step
  time, but with more than 2.5 % of the workers overloaded it re-rendezvouses at once (its rule),
  so on a cluster of tens of nodes every failure is a reconfiguration to whole pipelines.
* `Reroute` (ReCycle, needs pipelines): a failed server's micro-batches go to the same-stage servers
  of the other pipelines, which fit them into their 1F1B bubbles (decoupled weight gradients): with
  f of D replicas down in one stage, e = ceil(f m / (D - f)) extra micro-batches per peer and
  iteration time x max(1, (m + e + (P - 1)(1 - absorbed)) / (m + P - 1)), worst stage; exact, nothing dropped.
* `SparePool` (recovery onto spares: a replicated-optimizer swap, NVRx in-process restart, an
  in-job restart from replicated local checkpoints): S spare domains idle while healthy; a failure
  swaps one in (downtime `restart_s`, rolls back `lost_s`); with none left the job waits for a repair.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, FrozenSet, Optional

from megatron_mecefo.elastic.plan.topology import Grid
from megatron_mecefo.sim.engine import Rate, Transition
from megatron_mecefo.sim.trace import Failure

__all__ = ["DropSamples", "Reconfigure", "Reroute", "Spread", "SparePool", "extra_micro_batches"]


def extra_micro_batches(failed: int, replicas: int, per_replica: int) -> int:
    """Micro-batches the busiest survivor runs on top of its own when the `failed` replicas' are
    dealt out evenly over the others (a micro-batch is not split)."""
    return math.ceil(failed * per_replica / (replicas - failed))


def _failed_replicas(grid: Grid, gpus_per_node: int, down: FrozenSet[int]) -> int:
    """Replicas with a rank on a domain that is down (a replica needs all its ranks)."""
    return len({grid.replica_of(r) for d in down for r in range(d * gpus_per_node, (d + 1) * gpus_per_node)})


@dataclasses.dataclass
class DropSamples:
    grid: Grid
    gpus_per_node: int = 1
    detect_s: float = 5.0
    step_s: float = 1.0
    overhead: float = 1.0
    """Steady-state step time over a plain job's (cross-replica reduction over its own transport)."""

    def rate(self, down):
        f = _failed_replicas(self.grid, self.gpus_per_node, down)
        if f == self.grid.dp:
            return Rate(speed=0.0, cause="no_replica_left")
        return Rate(speed=1.0 / self.overhead, dropped=f / self.grid.dp, cause="overhead")

    def on_failure(self, down, failure: Failure):
        return Transition(downtime_s=self.detect_s, lost_s=self.step_s / 2, cause="recovery")

    def on_repair(self, down, domain):
        return Transition()  # the healed group joins at the next quorum


@dataclasses.dataclass
class Spread:
    grid: Grid
    gpus_per_node: int = 1
    transition_s: float = 5.0
    step_s: float = 1.0
    micro_batches: int = 8

    def rate(self, down):
        f, d, m = _failed_replicas(self.grid, self.gpus_per_node, down), self.grid.dp, self.micro_batches
        if f == d:
            return Rate(speed=0.0, cause="no_replica_left")
        return Rate(speed=m / (m + extra_micro_batches(f, d, m)), cause="degraded")

    def on_failure(self, down, failure):
        return Transition(downtime_s=self.transition_s, lost_s=self.step_s / 2, cause="recovery")

    def on_repair(self, down, domain):
        return Transition(downtime_s=self.transition_s, cause="recovery")


@dataclasses.dataclass
class Reroute:
    grid: Grid
    gpus_per_node: int = 1
    micro_batches: int = 8
    absorbed: float = 1.0
    transition_s: float = 5.0
    step_s: float = 1.0

    def __post_init__(self) -> None:
        if self.grid.pp < 2:
            raise ValueError("ReCycle reroutes into pipeline bubbles: it needs --pp > 1")

    def rate(self, down):
        g, grid, m, p = self.gpus_per_node, self.grid, self.micro_batches, self.grid.pp
        dead = {r for d in down for r in range(d * g, (d + 1) * g)}
        worst = 1.0
        for stage in range(p):  # a stage's failed replicas: any of its (tp) ranks down
            f = len({grid.replica_of(r) for r in dead if grid.position(r)[1] == stage})
            if f == grid.dp:
                return Rate(speed=0.0, cause="no_replica_left")
            e = extra_micro_batches(f, grid.dp, m)
            worst = max(worst, (m + e + (p - 1) * (1 - self.absorbed)) / (m + p - 1))
        return Rate(speed=1.0 / worst)

    def on_failure(self, down, failure):
        return Transition(downtime_s=self.transition_s, lost_s=self.step_s / 2, cause="recovery")

    def on_repair(self, down, domain):
        return Transition(downtime_s=self.transition_s, cause="recovery")


@dataclasses.dataclass
class SparePool:
    spares: int
    restart_s: float
    lost_s: float
    """Progress rolled back per failure (half a step; half a local checkpoint interval)."""
    overhead: float = 1.0
    """Steady-state step time over a plain job's (e.g. local checkpoint writes)."""

    def rate(self, down):
        if len(down) > self.spares:
            return Rate(speed=0.0, cause="waiting_for_repair")
        return Rate(speed=1.0 / self.overhead, cause="overhead")

    def on_failure(self, down, failure):
        if len(down) > self.spares:  # no spare left: the job stops until a repair (rate 0)
            return Transition(lost_s=self.lost_s)
        return Transition(downtime_s=self.restart_s, lost_s=self.lost_s, cause="restart")

    def on_repair(self, down, domain):
        if len(down) == self.spares:  # the job was waiting for this domain: it restarts with it
            return Transition(downtime_s=self.restart_s, cause="restart")
        return Transition()  # back in the spare pool


@dataclasses.dataclass
class Reconfigure:
    domains: int
    reconfig_s: float
    step_s: float = 1.0
    min_domains: int = 1
    throughput: Optional[Dict[int, float]] = None
    """Throughput by domains alive (any unit); None: proportional to the domains alive."""
    pipeline_stages: Optional[int] = None
    """Bamboo: only whole pipelines of this many domains train (the rest wait as standby)."""

    def _speed(self, alive: int) -> float:
        if alive < self.min_domains:
            return 0.0
        if self.pipeline_stages:
            return (alive // self.pipeline_stages) / (self.domains // self.pipeline_stages)
        if self.throughput is None:
            return alive / self.domains
        return self.throughput[min(alive, max(self.throughput))] / self.throughput[max(self.throughput)]

    def rate(self, down):
        speed = self._speed(self.domains - len(down))
        return Rate(speed=speed, cause="fewer_nodes" if speed else "no_template_fits")

    def on_failure(self, down, failure):
        return Transition(downtime_s=self.reconfig_s, lost_s=self.step_s, cause="reconfigure")

    def on_repair(self, down, domain):
        alive = self.domains - len(down)
        if self.pipeline_stages and alive // self.pipeline_stages == (alive - 1) // self.pipeline_stages:
            return Transition()  # into the standby queue: not yet a whole pipeline
        return Transition(downtime_s=self.reconfig_s, cause="reconfigure")
