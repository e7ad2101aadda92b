"""MeCeFO as the runtime runs it: the ring cover plan of `elastic/plan/topology.py`, per event.

A failed domain (a GPU, or a node of g GPUs: ranks in Megatron's order) retires every replica it
holds a rank of; each retired replica is adopted by the next live, non-covering replica on the
ring (`ring_cover`, the runtime's own function), and the runtime's fold (`fold_neighbor`) says
which micro-batches each live replica runs and which go through the approximate backward. A
covering micro-batch costs `cover_ratio / 2` of an exact one (the paper's rule runs two micro-batch
loads approximately for `cover_ratio`); every step waits for the busiest replica, so with the
paper's rule speed = 1 / cover_ratio and 2 f of D replicas' data is approximate; with
`approximate="adopted"` the covering replica runs its own exact: 1 / (1 + cover_ratio / 2).

A failure costs the detection and regroup (measured: `recovery_s`) plus the in-flight step, redone
by the survivors; a repair costs the rejoin (state transfer and regroup). When no neighbour is left
(`NoCoverAvailable`) the job gives up with a checkpoint of its last committed step (nothing is
lost) and is restarted (`restart_s`) on the replicas left, which then run the whole global batch
between them (speed = live / D, exact) until repairs let replicas rejoin in-process.

The cover policy is the runtime's planner (`elastic/plan/cover_plan.py`), with a covering micro-batch
at `cover_ratio / 2` of an exact one: `cover="neighbour"` (the paper's rule, above) or "spread"
(the lost micro-batches dealt over the survivors, as few approximated as keep the slowest replica
within the paper's time, or within `budget` normal steps). A what-if beside it:
* `sharded=True` (the sharded optimizer, elastic/sharding/zero.py): every failure and rejoin re-shards the
  optimizer state (`reshard_s` more), and a replica whose shard copy sat on a replica that failed
  with it (the next live one on the ring: in one domain, or already down) loses that range:
  `on_shard_loss` "give_up" ends the job (a restart and the work since the last periodic
  checkpoint, `shard_loss_lost_s`), "reinit" rebuilds the range and goes on (counted, no time).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import FrozenSet, Optional

from megatron_mecefo.elastic.plan.cover_plan import Costs, plan_cover
from megatron_mecefo.elastic.plan.topology import Grid, ring_cover
from megatron_mecefo.errors import NoCoverAvailable
from megatron_mecefo.sim.engine import Rate, Transition
from megatron_mecefo.sim.trace import Failure

__all__ = ["MeCeFO"]

_COVERS = {}
"""(replicas, replicas down) -> (live, cover map or None): shared by every policy instance, so the
variants compared on one trace plan each state once."""


@dataclasses.dataclass
class MeCeFO:
    grid: Grid
    gpus_per_node: int = 1
    cover_ratio: float = 1.2
    """A covering rank's step time over a normal rank's (benchmarks/covering_cost.py)."""
    step_s: float = 1.0
    """A normal step's wall time (the in-flight step lost per failure)."""
    recovery_s: float = 2.0
    """Crash to the first degraded step (benchmarks/recovery.py)."""
    rejoin_s: float = 2.0
    """A repaired domain's rejoin: state transfer and regroup."""
    restart_s: float = 600.0
    """Give-up to training again (a new job on the replicas left, reading the checkpoint)."""
    approximate: str = "all"
    """The runtime's `approximate` option: "all" (the paper) or "adopted" (own micro-batches exact)."""
    cover: str = "neighbour"
    """The runtime's cover policy: "neighbour" (the paper) or "spread"."""
    budget: Optional[float] = None
    """The runtime's covering_budget: the slowest replica's time while covering, in normal steps."""
    micro_batches: int = 8
    """Micro-batches per replica and step (the spread's granularity)."""
    sharded: bool = False
    reshard_s: float = 0.0
    on_shard_loss: str = "give_up"
    shard_loss_lost_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.cover_ratio > 0:
            raise ValueError(f"cover_ratio must be > 0, got {self.cover_ratio}")
        if self.on_shard_loss not in ("give_up", "reinit"):
            raise ValueError(f'on_shard_loss must be "give_up" or "reinit", got {self.on_shard_loss!r}')
        if self.approximate not in ("all", "adopted"):
            raise ValueError(f'approximate must be "all" or "adopted", got {self.approximate!r}')
        if self.micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {self.micro_batches}")
        self._fallback = False  # gave up: the replicas left run without covering until all are back
        g = self.gpus_per_node
        self._replicas = [{self.grid.replica_of(r) for r in range(d * g, (d + 1) * g)}  # per domain
                          for d in range(self.grid.world // g)]
        # the ring plans replicas; a grid of replicas gives the same plan at a fraction of the cost
        self._ring = Grid(dp=self.grid.dp)
        self._plans = {}
        self._rates = {}
        self.shard_losses = 0

    def counters(self):
        return {"shard_losses": self.shard_losses} if self.sharded else {}

    def _plan(self, down: FrozenSet[int]):
        """(live replicas, the ring's cover map or None when no cover exists, the fold's Rate),
        memoized: a state recurs often (one or two domains down) and planning is the main cost."""
        key = frozenset().union(*(self._replicas[d] for d in down)) if down else frozenset()
        plan = self._plans.get(key)
        if plan is None:
            live, cover = self._cover(key)
            plan = self._plans[key] = (live, cover, None if cover is None else self._fold_rate(cover))
        return plan

    def _cover(self, retired: FrozenSet[int]):
        shared = _COVERS.get((self.grid.dp, retired))
        if shared is None:
            if len(_COVERS) > 500_000:
                _COVERS.clear()
            live = tuple(r for r in range(self.grid.dp) if r not in retired)
            try:
                cover = ring_cover(self._ring, live)
            except NoCoverAvailable:
                cover = None
            shared = _COVERS[(self.grid.dp, retired)] = (live, cover)
        return shared

    def _fold_rate(self, cover) -> Rate:
        if not cover.degraded:
            return Rate(speed=1.0)
        # the rate depends only on how many replicas adopt how many (spread: on how many are live and
        # failed): plan once per such shape
        shape = (len(cover.live), len(cover.failed)) if self.cover == "spread" else \
            (len(cover.live), tuple(sorted(Counter(cover.cover.values()).values())))
        if shape not in self._rates:
            self._rates[shape] = self._fold(cover)
        return self._rates[shape]

    def _fold(self, cover) -> Rate:
        k = self.micro_batches
        plan = plan_cover(cover, k, Costs(covering=min(1.0, self.cover_ratio / 2)), policy=self.cover,
                          target=None if self.budget is None else self.budget * k, approximate=self.approximate)
        fold = plan.fold
        busiest = max(sum(self.cover_ratio / 2 if m.covering else 1.0 for m in mbs) / k
                      for mbs in fold.assignments.values())
        covering = sum(m.covering for mbs in fold.assignments.values() for m in mbs)
        # a covering rank faster than a normal one (measured below 1 at LLaMA-1B size on CPU) still
        # waits for the others at the reduction
        return Rate(speed=1.0 / max(1.0, busiest), approx=covering / fold.divisor)

    def rate(self, down: FrozenSet[int]) -> Rate:
        live, cover, rate = self._plan(down)
        if self._fallback:
            return Rate(speed=len(live) / self.grid.dp, cause="fewer_replicas")
        return rate

    def on_failure(self, down: FrozenSet[int], failure: Failure) -> Transition:
        if self._fallback:
            return Transition()  # a replica fewer; the next restart is a repair's
        live, cover, _ = self._plan(down)
        before = self._plan(down - {failure.domain})[0]
        if live == before:
            return Transition()  # its replica was retired already: an idle rank
        if cover is None:
            self._fallback = True
            return Transition(downtime_s=self.restart_s, fatal=True, cause="restart")
        if self.sharded and self._loses_a_shard(before, live):
            self.shard_losses += 1
            if self.on_shard_loss == "give_up":
                return Transition(downtime_s=self.restart_s, lost_s=self.shard_loss_lost_s, fatal=True, cause="restart")
        return Transition(downtime_s=self.recovery_s + self.reshard_s, lost_s=self.step_s / 2, cause="recovery")

    @staticmethod
    def _loses_a_shard(before, live) -> bool:
        """Some newly retired replica's copy holder (the next replica on the ring that was live) is gone too."""
        gone = [r for r in before if r not in live]
        return any(before[(before.index(r) + 1) % len(before)] not in live for r in gone)

    def on_repair(self, down: FrozenSet[int], domain: int) -> Transition:
        if self._fallback and self._plan(down)[1] is not None:
            self._fallback = False  # coverable again: back to the neighbour scheme
        return Transition(downtime_s=self.rejoin_s + self.reshard_s, cause="recovery")
