"""Fail-slow: a slow replica sheds micro-batches to the faster ones. Pure; every rank computes the
same from the same numbers.

Speeds: each committed step, every live replica's compute seconds per micro-batch (its slowest
position's) arrive summed in the step's statistics, so every rank sees the same numbers (the
runtime's part, elastic/rebalancing.py). `SlowWatch` turns them into the slowdown factors a plan
uses, one per replica, over the median replica's (the lower median: of two replicas, the faster,
so the factor is against a normal speed):

* a replica whose factor stays above `threshold` for `window` committed steps is slow; its planned
  factor is the median of its last `window` factors;
* a slow replica whose factor (measured on the micro-batches it still runs) stays below
  1 + (threshold - 1) / 2 for `window` steps is healthy again;
* a slow replica's planned factor is replaced (by its window's median) only when its whole window
  lies more than a share (threshold - 1) / 2 above or below it: a re-plan per real change of speed,
  none on noise or in the middle of a change.

With P pipeline stages a replica's step also holds the pipeline's fill and drain, about P - 1
micro-batch slots whatever its count (1F1B), so a speed is seconds per slot (`slots`), not per
micro-batch: a healthy replica dealt fewer micro-batches would otherwise read slower (at P = 2, k = 2,
one micro-batch of four reads 1.5x) and never be found recovered.

A replica above `retire_above` (retire_slower_than) over a whole window is named in `too_slow`: the
runtime retires it if the others can cover it. A new generation starts a new watch (the runtime
resets it): its members saw the same steps.

Plan: `rebalance(fold, factors, costs)` moves micro-batches, whole and in the mode the cover plan
gave them (the math does not change: the same micro-batches in the same global batch, the same
divisors), from the replica predicted slowest to the one that would finish it soonest, while that
one ends below the slowest's time (replica time = factor x the costs of its micro-batches): with
equal costs, the least slowest time there is. Every replica keeps at least one micro-batch.
tests/elastic/test_rebalance.py checks it against brute force.
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
from typing import Deque, Dict, Mapping, Optional

from megatron_mecefo.elastic.plan.cover_plan import Costs
from megatron_mecefo.elastic.plan.fold import Fold

__all__ = ["SlowWatch", "rebalance", "replica_times", "slots"]


def slots(micro_batches, costs: Costs, pp: int = 1) -> float:
    """The exact micro-batches' worth of time a pipeline replica of `pp` stages takes to run
    `micro_batches` (fold.MicroBatch): their costs plus the fill and drain; 0 for none."""
    work = sum(costs.of(m) for m in micro_batches)
    return (work + (pp - 1) * costs.exact) / costs.exact if work > 0 else 0.0


class SlowWatch:
    """The slow replicas of one generation and their planned factors (see the module docstring)."""

    def __init__(self, threshold: float, window: int, retire_above: Optional[float] = None) -> None:
        if not threshold > 1 or window < 2:
            raise ValueError(f"a slow replica needs threshold > 1 and window >= 2, got {threshold}, {window}")
        self.threshold, self.window, self.retire_above = threshold, window, retire_above
        self.band = (threshold - 1) / 2
        self.recovered_below = 1 + self.band
        self._seen: Dict[int, Deque[float]] = {}
        self.factors: Dict[int, float] = {}
        """Replica -> its planned slowdown factor (> 1); replicas not named run at 1."""
        self.too_slow: Dict[int, float] = {}
        """Replica -> its factor, for replicas above `retire_above` over a whole window."""

    def observe(self, per_micro_batch: Mapping[int, float]) -> bool:
        """One committed step's seconds per micro-batch by live replica. True: the factors changed."""
        times = {r: t for r, t in per_micro_batch.items() if t > 0}
        if len(times) < 2:
            return False
        median = statistics.median_low(times.values())
        changed = False
        for r, t in sorted(times.items()):
            seen = self._seen.setdefault(r, collections.deque(maxlen=self.window))
            seen.append(t / median)
            if len(seen) < self.window:
                continue
            now, planned = statistics.median(seen), self.factors.get(r)
            if self.retire_above is not None and min(seen) > self.retire_above and r not in self.too_slow:
                self.too_slow[r] = now
                changed = True
            if planned is None and min(seen) > self.threshold:
                self.factors[r] = now
            elif planned is not None and max(seen) < self.recovered_below:
                del self.factors[r]
            elif planned is not None and (min(seen) / planned - 1 > self.band or 1 - max(seen) / planned > self.band):
                self.factors[r] = now
            else:
                continue
            changed = True
            seen.clear()  # the next decision on this replica reads steps of the new plan only
        return changed


def replica_times(fold: Fold, costs: Costs, factors: Mapping[int, float]) -> Dict[int, float]:
    """Each live replica's predicted step time: its factor x its micro-batches' costs."""
    return {r: factors.get(r, 1.0) * sum(costs.of(m) for m in mbs) for r, mbs in fold.assignments.items()}


def rebalance(fold: Fold, factors: Mapping[int, float], costs: Costs) -> Fold:
    """`fold` with micro-batches moved off slow replicas (see the module docstring). Deterministic:
    ties go to the lowest replica."""
    assignments = {r: list(mbs) for r, mbs in fold.assignments.items()}
    times = replica_times(fold, costs, factors)
    while True:
        slowest = max(sorted(times), key=lambda r: times[r])
        if len(assignments[slowest]) < 2:
            break
        m = assignments[slowest][-1]
        after = {r: times[r] + factors.get(r, 1.0) * costs.of(m) for r in sorted(times) if r != slowest}
        to = min(after, key=lambda r: after[r])
        # the times, sorted from the slowest, fall in lexicographic order with every move: it ends
        if not after[to] < times[slowest] - 1e-12:
            break
        assignments[to].append(assignments[slowest].pop())
        times[to], times[slowest] = after[to], times[slowest] - factors.get(slowest, 1.0) * costs.of(m)
    return dataclasses.replace(fold, assignments={r: tuple(mbs) for r, mbs in assignments.items()})
