"""The runtime's fail-slow part (config "rebalance"): every replica's speed, agreed without the store,
and the plan that follows it (the planning itself is pure: plan/rebalance.py).

Each step, every rank puts its compute seconds per micro-batch (exact-equivalent: a covering one
counts as the generation's agreed covering cost) into its replica's slot of D slots summed with the
step's statistics (`statistics`, `take`): after the reduction every member of a (tp, pp) position's
group holds the same numbers. A committed step feeds them to the generation's `SlowWatch`; when the
factors change, the next step boundary installs the generation's cover plan rebalanced for them
(`at_boundary`), on every member at the same step; a new factor that deals the same micro-batches
is no change of plan (no event). A new generation starts from its own cover plan
and a new watch: its members, joiners included, have seen the same committed steps since.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence

from megatron_mecefo.elastic.current import Current
from megatron_mecefo.elastic.leaving import retire
from megatron_mecefo.elastic.plan.cover_plan import CoverPlan
from megatron_mecefo.elastic.plan.rebalance import SlowWatch, rebalance, replica_times, slots
from megatron_mecefo.elastic.plan.topology import ring_cover
from megatron_mecefo.errors import NoCoverAvailable

__all__ = ["Rebalancing"]


class Rebalancing:
    """One rank's view of the replicas' speeds (see the module docstring).

    Args:
        now: where this rank stands (its plan is replaced at step boundaries).
        threshold, window, retire_above: MeCeFOConfig.rebalance_threshold / rebalance_window /
            retire_slower_than.
        replica_min: the element-wise MIN of a list over this rank's replica (as is at T = P = 1).
        may_retire: a replica can leave without losing state (False: a sharded optimizer state
            without neighbour copies).
        events, log: the runtime's event log and logger.
    """

    def __init__(self, now: Current, *, threshold: float, window: int, retire_above: Optional[float] = None,
                 replica_min: Callable[[list], list] = lambda flags: flags, may_retire: bool = True, events,
                 log) -> None:
        self.now, self.threshold, self.window, self.retire_above = now, threshold, window, retire_above
        self._replica_min, self._may_retire, self._events, self._log = replica_min, may_retire, events, log
        self._generation: Optional[int] = None
        self._base: Optional[CoverPlan] = None
        self._watch = SlowWatch(threshold, window, retire_above)
        self._pending = False
        self.replans = 0
        """Changes of plan for speed so far (events "rebalance")."""

    def statistics(self, seconds: float, ran: Sequence) -> List[float]:
        """This rank's slots of the step's statistics: D numbers, its seconds per exact micro-batch
        (the pipeline's fill and drain counted: plan/rebalance.slots) in its replica's slot (a
        replica's ranks of one position are one per group)."""
        work = slots(ran, self.now.plan.costs, self.now.grid.pp)
        out = [0.0] * self.now.grid.dp
        if work > 0:
            out[self.now.replica] = seconds / work
        return out

    def take(self, summed: List[float]) -> Dict[int, float]:
        """The D slots off the end of `summed` (in place): seconds per micro-batch by live replica."""
        dp = self.now.grid.dp
        slots = summed[len(summed) - dp:]
        del summed[len(summed) - dp:]
        return {r: slots[r] for r in self.now.cover.live}

    def committed(self, speeds: Optional[Dict[int, float]]) -> None:
        """The step whose `take` gave `speeds` (this position's) committed on every member. A
        replica's speed is its slowest position's: with T or P > 1 one MIN of the negated numbers
        over the replica's ranks (all of them committed the step alike) gives every rank the same."""
        live = sorted(self.now.cover.live)
        slowest = self._replica_min([-(speeds or {}).get(r, 0.0) for r in live])
        speeds = {r: -v for r, v in zip(live, slowest)}
        if self._generation == self.now.generation and self._watch.observe(speeds):
            self._pending = True

    def at_boundary(self) -> None:
        """A step boundary: a new generation starts over; changed factors are installed."""
        now = self.now
        if self._generation != now.generation:
            self._generation, self._base = now.generation, now.plan
            self._watch, self._pending = SlowWatch(self.threshold, self.window, self.retire_above), False
            return
        if not self._pending:
            return
        self._pending = False
        if self._watch.too_slow:
            self._retire_too_slow()
        base, factors = self._base, dict(self._watch.factors)
        fold = rebalance(base.fold, factors, base.costs) if factors else base.fold
        if fold.assignments == now.plan.fold.assignments:  # a new factor, the same deal: no change of plan
            return
        predicted = replica_times(fold, base.costs, factors)
        now.plan = CoverPlan(fold, predicted, base.target, base.costs) if factors else base
        self.replans += 1
        normal = now.k * base.costs.exact
        counts = {str(r): len(mbs) for r, mbs in sorted(fold.assignments.items())}
        self._events.write("rebalance", step=now.step, generation=now.generation,
                           factors={str(r): round(f, 4) for r, f in sorted(factors.items())},
                           micro_batches=counts, slowest_ratio=max(predicted.values()) / normal,
                           replans=self.replans, plan=now.plan.summary(now.k))
        if factors:
            self._log.warning("step %d: replicas %s slow (x%s): micro-batches per replica %s, slowest replica "
                              "%.2fx a normal step predicted", now.step, sorted(factors),
                              "/".join(f"{f:.2f}" for _, f in sorted(factors.items())), counts,
                              max(predicted.values()) / normal)
        else:
            self._log.warning("step %d: no replica slow any more: back to the generation's plan", now.step)

    def _retire_too_slow(self) -> None:
        """Replicas above retire_slower_than leave as failed (exit 4; restarted, they rejoin), each
        only if the others can still cover every lost replica; every member decides alike. The
        others find them gone in this step's collectives and recover as from a crash."""
        now, too_slow = self.now, dict(self._watch.too_slow)
        self._watch.too_slow.clear()  # decided once per window
        out: List[int] = []
        for r in sorted(too_slow) if self._may_retire else ():
            stay = [rank for rep in now.cover.live if rep != r and rep not in out
                    for rank in now.grid.ranks_of_replica(rep)]
            try:
                ring_cover(now.grid, stay)
            except NoCoverAvailable:
                continue
            out.append(r)
        kept = sorted(set(too_slow) - set(out))
        self._events.write("retire_slow", step=now.step, generation=now.generation, replicas=out, kept=kept,
                           factors={str(r): round(f, 4) for r, f in sorted(too_slow.items())})
        if kept:
            self._log.warning("step %d: replicas %s are slower than retire_slower_than (%s) but stay: %s", now.step,
                              kept, self.retire_above, "the others could not cover them" if self._may_retire else
                              "a sharded optimizer state without neighbour copies would lose their shards")
        if now.replica in out:
            f = too_slow[now.replica]
            retire(self._events, now.rank, now.generation, now.members,
                   f"its replica {now.replica} is x{f:.2f} slower than the median, above retire_slower_than "
                   f"({self.retire_above})", reason="slow", step=now.step, factor=f)
        if out:
            self._log.warning("step %d: replicas %s retired as failed (slower than retire_slower_than %s)",
                              now.step, out, self.retire_above)
