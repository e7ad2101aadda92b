"""Pure folding of a global batch onto the live replicas, and the gradient weights it implies.

The global batch of a step is `dp * k` micro-batches, micro-batch j of original replica d holding
samples `step * global + (d * k + j) * mb ... + mb`: a pure function of (step, d, j), so any rank
can compute any other rank's data and every sample is consumed exactly once per step whatever
fails. Under a cover map each live replica runs its own k micro-batches plus the k of every
replica it adopts.

Gradient weights (MECEFO.md, "Gradient averaging after a failure"): every rank SUMS its
micro-batch gradients; after the all-reduce SUM,
* non-attention parameters are divided by the original number of micro-batches, dp * k;
* attention parameters (GradGroup.MHA) by the number of micro-batches run with an exact attention
  backward, since covering micro-batches contribute no attention gradient.

A fold policy is any function (plan, k, options) -> Fold; `fold_neighbor` is MeCeFO's.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Tuple

from megatron_mecefo.elastic.topology import CoverMap

__all__ = ["MicroBatch", "Fold", "FoldPolicy", "fold_neighbor", "sample_range", "APPROXIMATE_MODES"]

APPROXIMATE_MODES = ("all", "adopted", "none")


@dataclasses.dataclass(frozen=True)
class MicroBatch:
    replica: int
    """Original data-parallel index whose data this is."""
    index: int
    """Micro-batch index within that replica's share of the step, 0 <= index < k."""
    covering: bool
    """Run in MeCeFO covering mode (approximate backward)."""


@dataclasses.dataclass(frozen=True)
class Fold:
    """What every live replica runs in one step, and the gradient divisors."""

    assignments: Dict[int, Tuple[MicroBatch, ...]]
    """live replica -> its micro-batches, own first, in a fixed order."""
    divisor: int
    """Non-attention gradients: the original number of micro-batches, dp * k."""
    divisor_mha: int
    """Attention gradients: micro-batches run with an exact attention backward."""

    def micro_batches(self, replica: int) -> Tuple[MicroBatch, ...]:
        return self.assignments[replica]

    def all_micro_batches(self) -> List[Tuple[int, int]]:
        return sorted((m.replica, m.index) for mbs in self.assignments.values() for m in mbs)


FoldPolicy = Callable[..., Fold]


def fold_neighbor(
    plan: CoverMap,
    micro_batches_per_replica: int,
    *,
    approximate: str = "all",
    skip_attention: bool = True,
) -> Fold:
    """MeCeFO's fold: each covering replica runs its own and its adopted micro-batches.

    Args:
        plan: the generation's cover map.
        micro_batches_per_replica: k, gradient-accumulation steps of one replica.
        approximate: which micro-batches of a covering replica run in covering mode: "all" (the
            paper), "adopted" (own stay exact) or "none" (everything exact: the fold alone).
        skip_attention: whether covering mode skips the attention backward (then covering
            micro-batches produce no attention gradient).
    """
    if approximate not in APPROXIMATE_MODES:
        raise ValueError(f"approximate must be one of {APPROXIMATE_MODES}, got {approximate!r}")
    k = micro_batches_per_replica
    if k < 1:
        raise ValueError(f"micro_batches_per_replica must be >= 1, got {k}")
    assignments: Dict[int, Tuple[MicroBatch, ...]] = {}
    exact_attention = 0
    for replica in plan.live:
        adopted = plan.adopted_by(replica)
        covering = bool(adopted)
        own_cov = covering and approximate == "all"
        adopt_cov = covering and approximate in ("all", "adopted")
        mbs = [MicroBatch(replica, j, own_cov) for j in range(k)]
        mbs += [MicroBatch(f, j, adopt_cov) for f in adopted for j in range(k)]
        assignments[replica] = tuple(mbs)
        exact_attention += sum(1 for m in mbs if not (m.covering and skip_attention))
    return Fold(assignments, divisor=plan.grid.dp * k, divisor_mha=exact_attention)


def sample_range(step: int, replica: int, index: int, *, micro_batch_size: int, dp: int, k: int) -> range:
    """Global sample indices of micro-batch `index` of original replica `replica` at `step`."""
    global_batch = dp * k * micro_batch_size
    start = step * global_batch + (replica * k + index) * micro_batch_size
    return range(start, start + micro_batch_size)
