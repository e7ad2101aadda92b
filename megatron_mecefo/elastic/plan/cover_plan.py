"""Pure cover planning: which live replica runs which lost micro-batch, in which mode, with the
predicted step time of every replica. Every rank computes the same plan from the same inputs.

Policies:
* "neighbour": MeCeFO's rule (fold.fold_neighbor): the ring neighbour of a failed replica runs all
  of its k micro-batches besides its own k; the job runs at that replica's pace. With a target
  (the covering budget) each covering replica approximates only as many as keep it within it.
* "spread": the lost micro-batches are dealt over the survivors, in chunks, round the ring from
  the first failed replica's neighbour (topology.ring_after); each survivor approximates as few
  micro-batches as keep its predicted time within the target (its adopted ones first, then its
  own, as `approximate` allows). The chunk sizes are chosen for the fewest approximated
  micro-batches within the target, then the fastest slowest replica (with the approximations off:
  an even deal). The default target is the neighbour rule's own slowest replica, so "spread" is
  never slower than the paper and approximates no more.

Time model: a replica's step time is the sum of its micro-batches' costs (`Costs`: exact,
covering, covering with the attention backward kept by the floor; the floor is applied after the
plan and may slow it). `fold_neighbor` validates the options for both policies.
tests/elastic/test_cover_plan.py checks the plans against brute force.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Optional, Tuple

from megatron_mecefo.elastic.plan.fold import Fold, MicroBatch, fold_neighbor, with_attention_floor
from megatron_mecefo.elastic.plan.topology import CoverMap, ring_after

__all__ = ["COVER_POLICIES", "Costs", "CoverPlan", "plan_cover", "predict"]

COVER_POLICIES = ("neighbour", "spread")
"""config.COVER_CHOICES (config is above elastic/ and imports torch; the simulator imports this module)."""


@dataclasses.dataclass(frozen=True)
class Costs:
    """Seconds (or any unit) of one micro-batch's forward and backward, per mode."""

    exact: float = 1.0
    covering: float = 0.55
    """The covering mode's approximate backward."""
    covering_exact_attention: Optional[float] = None
    """Covering with the attention backward kept (the attention floor); None: as `exact`."""

    def __post_init__(self) -> None:
        if not 0 < self.covering <= self.exact:
            raise ValueError(f"costs need 0 < covering <= exact, got covering {self.covering}, exact {self.exact}")

    def of(self, m: MicroBatch) -> float:
        if not m.covering:
            return self.exact
        if m.exact_attention:
            return self.exact if self.covering_exact_attention is None else self.covering_exact_attention
        return self.covering


@dataclasses.dataclass(frozen=True)
class CoverPlan:
    fold: Fold
    predicted: Dict[int, float]
    """Live replica -> its predicted step time."""
    target: float
    """The time the plan's replicas were kept within where they could be."""
    costs: Costs

    @property
    def slowest(self) -> float:
        return max(self.predicted.values())

    @property
    def approximated(self) -> int:
        return sum(m.covering for mbs in self.fold.assignments.values() for m in mbs)

    def runners(self) -> Dict[int, Tuple[int, ...]]:
        """Failed replica -> the live replicas that run its micro-batches."""
        out: Dict[int, List[int]] = {}
        for r, mbs in sorted(self.fold.assignments.items()):
            for f in sorted({m.replica for m in mbs if m.replica != r}):
                out.setdefault(f, []).append(r)
        return {f: tuple(rs) for f, rs in sorted(out.items())}

    def text(self) -> str:
        """"1->2" (replica 2 runs replica 1's micro-batches), "1->0+2" (spread), or "none"."""
        return ", ".join(f"{f}->{'+'.join(map(str, rs))}" for f, rs in self.runners().items()) or "none"

    def summary(self, k: int) -> dict:
        """For the event log: the costs, the prediction (in normal steps of k exact micro-batches),
        and the micro-batches, as [replica, index, covering], of every replica that runs more than its
        own k exact ones."""
        normal = k * self.costs.exact
        return {"costs": dataclasses.asdict(self.costs), "slowest_ratio": self.slowest / normal,
                "target_ratio": self.target / normal, "approximated": self.approximated,
                "divisor_mha": self.fold.divisor_mha,
                "assignments": {str(r): [[m.replica, m.index, m.covering] for m in mbs]
                                for r, mbs in sorted(self.fold.assignments.items())
                                if len(mbs) != k or any(m.covering or m.replica != r for m in mbs)}}


def predict(fold: Fold, costs: Costs) -> Dict[int, float]:
    """Each live replica's step time under `costs`."""
    return {r: sum(costs.of(m) for m in mbs) for r, mbs in fold.assignments.items()}


def plan_cover(cover: CoverMap, k: int, costs: Costs, *, policy: str = "neighbour", target: Optional[float] = None,
               approximate: str = "all", skip_attention: bool = True, attention_floor: float = 0.0) -> CoverPlan:
    """The plan of one generation (see the module docstring).

    Args:
        cover: the generation's cover map (its live replicas; "spread" ignores who it names as
            covering).
        k: micro-batches per replica per step.
        target: the slowest replica's time to stay within (in `costs`' unit; a covering budget B is
            B * k * costs.exact). None: the neighbour rule's own slowest replica; "neighbour" then
            approximates as the paper does.
        approximate, skip_attention, attention_floor: as fold.fold_neighbor.
    """
    if policy not in COVER_POLICIES:
        raise ValueError(f"cover policy must be one of {COVER_POLICIES}, got {policy!r}")
    neighbour = fold_neighbor(cover, k, approximate=approximate, skip_attention=skip_attention,
                              attention_floor=attention_floor)
    if target is None:
        target = max(predict(neighbour, costs).values())
        if policy == "neighbour":
            return CoverPlan(neighbour, predict(neighbour, costs), target, costs)
    live, failed = list(cover.live), cover.failed
    if policy == "neighbour":
        adopted = {r: [MicroBatch(f, j, False) for f in cover.adopted_by(r) for j in range(k)] for r in live}
    else:
        lost = [MicroBatch(f, j, False) for f in failed for j in range(k)]
        adopted = {}
        for r, c in zip(ring_after(live, failed[0]) if failed else live, _split(len(lost), len(live), k, costs, target,
                                                                                 approximate)):
            adopted[r], lost = lost[:c], lost[c:]
    assignments = {}
    for r in live:
        mbs = [MicroBatch(r, j, False) for j in range(k)] + adopted[r]
        x = _part(len(adopted[r]), k, costs, target, approximate)[1]
        # adopted ones first (from the end of the list), then own
        assignments[r] = [dataclasses.replace(m, covering=i >= len(mbs) - x) for i, m in enumerate(mbs)]
    fold = with_attention_floor(assignments, cover.grid.dp, k, skip_attention=skip_attention,
                                attention_floor=attention_floor)
    return CoverPlan(fold, predict(fold, costs), target, costs)


def _part(c: int, k: int, costs: Costs, target: float, approximate: str) -> Tuple[bool, int, float]:
    """(within the target, approximated, time) of a survivor that adopts `c` micro-batches and
    approximates as few as keep it within `target` (all it may when that is not enough). One that
    adopts none runs exactly, as under the paper's rule."""
    n = k + c
    cap = 0 if c == 0 else {"all": n, "adopted": c, "none": 0}[approximate]
    over = n * costs.exact - target
    if over <= 1e-9:
        need = 0
    elif costs.covering < costs.exact:
        need = math.ceil(over / (costs.exact - costs.covering) - 1e-9)
    else:
        need = cap + 1
    x = min(need, cap)
    return need <= cap, x, (n - x) * costs.exact + x * costs.covering


def _split(lost: int, survivors: int, k: int, costs: Costs, target: float, approximate: str) -> List[int]:
    """How many lost micro-batches each survivor adopts, largest first: the fewest approximated
    within the target, then the fastest slowest survivor; if no split keeps every survivor within
    the target, the fastest slowest. A survivor's count to approximate jumps with what it adopts
    (a rounded-up share), so an even deal is not always best: a dynamic programme over the
    survivors (identical, so only the multiset of counts matters; at most `lost` of them adopt any,
    so O(min(survivors, lost) x lost^2))."""
    parts = [_part(c, k, costs, target, approximate) for c in range(lost + 1)]
    # at most `lost` survivors adopt any: the DP runs over those, the rest adopt none
    placed, idle = min(survivors, lost), survivors - min(survivors, lost)

    def best(feasible_only: bool):
        if feasible_only and idle and not parts[0][0]:
            return None
        start = parts[0][2] if idle else 0.0
        # table[u]: (key, counts) of u micro-batches over the survivors placed so far
        table = {0: ((0, start) if feasible_only else (start, 0), ())}
        for _ in range(placed):
            nxt = {}
            for u, (key, counts) in table.items():
                for c in range(lost - u + 1):
                    ok, x, t = parts[c]
                    if feasible_only and not ok:
                        continue
                    cand = ((key[0] + x, max(key[1], t)) if feasible_only else (max(key[0], t), key[1] + x),
                            tuple(sorted(counts + (c,), reverse=True)))
                    if u + c not in nxt or cand < nxt[u + c]:
                        nxt[u + c] = cand
            table = nxt
        found = table.get(lost)
        return found and (found[0], found[1] + (0,) * idle)

    found = best(True) or best(False)
    return list(found[1])

