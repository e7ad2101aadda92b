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

The exact-attention floor: when so many replicas cover that the share of micro-batches with an
exact attention backward would fall below `attention_floor` (with two of four replicas down, the
paper's rule leaves none: attention learns from nothing), covering micro-batches keep their
attention backward (`exact_attention`), the covering replicas' own ones first, spread over the
replicas, until the share reaches the floor. The FFN approximations stay on for them.

A fold policy is any function (cover, k, options) -> Fold; `fold_neighbor` is MeCeFO's.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Dict, List, Tuple

from megatron_mecefo.elastic.plan.topology import CoverMap

__all__ = ["MicroBatch", "Fold", "FoldPolicy", "fold_neighbor", "with_attention_floor", "micro_batch_policy", "sample_range", "APPROXIMATE_MODES"]

APPROXIMATE_MODES = ("all", "adopted", "none")


@dataclasses.dataclass(frozen=True)
class MicroBatch:
    replica: int
    """Original data-parallel index whose data this is."""
    index: int
    """Micro-batch index within that replica's share of the step, 0 <= index < k."""
    covering: bool
    """Run in MeCeFO covering mode (approximate backward)."""
    exact_attention: bool = False
    """A covering micro-batch that keeps its attention backward (the exact-attention floor)."""


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
    cover: CoverMap,
    micro_batches_per_replica: int,
    *,
    approximate: str = "all",
    skip_attention: bool = True,
    attention_floor: float = 0.0,
) -> Fold:
    """MeCeFO's fold: each covering replica runs its own and its adopted micro-batches.

    Args:
        cover: the generation's cover map.
        micro_batches_per_replica: k, gradient-accumulation steps of one replica.
        approximate: which micro-batches of a covering replica run in covering mode: "all" (the
            paper), "adopted" (own stay exact) or "none" (everything exact: the fold alone).
        skip_attention: whether covering mode skips the attention backward (then covering
            micro-batches produce no attention gradient).
        attention_floor: the least share of the step's micro-batches that run an exact attention
            backward (0: none kept, the paper's rule); covering micro-batches keep theirs to reach it.
    """
    if approximate not in APPROXIMATE_MODES:
        raise ValueError(f"approximate must be one of {APPROXIMATE_MODES}, got {approximate!r}")
    k = micro_batches_per_replica
    if k < 1:
        raise ValueError(f"micro_batches_per_replica must be >= 1, got {k}")
    if not 0.0 <= attention_floor <= 1.0:
        raise ValueError(f"attention_floor must be in [0, 1], got {attention_floor!r}")
    assignments: Dict[int, List[MicroBatch]] = {}
    for replica in cover.live:
        adopted = cover.adopted_by(replica)
        covering = bool(adopted)
        own_cov = covering and approximate == "all"
        adopt_cov = covering and approximate in ("all", "adopted")
        mbs = [MicroBatch(replica, j, own_cov) for j in range(k)]
        mbs += [MicroBatch(f, j, adopt_cov) for f in adopted for j in range(k)]
        assignments[replica] = mbs

    return with_attention_floor(assignments, cover.grid.dp, k, skip_attention=skip_attention,
                                attention_floor=attention_floor)


def with_attention_floor(assignments: Dict[int, List[MicroBatch]], dp: int, k: int, *, skip_attention: bool,
                         attention_floor: float) -> Fold:
    """The Fold of `assignments` (live replica -> its micro-batches, own first): covering
    micro-batches keep their attention backward until `attention_floor` of the dp * k are exact
    there (own ones first, round-robin over the replicas), and the divisors that follow."""
    assignments = {r: list(mbs) for r, mbs in assignments.items()}

    def exact_attention() -> int:
        return sum(1 for mbs in assignments.values() for m in mbs
                   if not (m.covering and skip_attention) or m.exact_attention)

    if skip_attention and attention_floor > 0:
        need = math.ceil(attention_floor * dp * k - 1e-9)
        # own micro-batches first (the replica's own data), round-robin over the covering replicas
        slots = sorted(((m.replica != live, j, live) for live, mbs in assignments.items()
                        for j, m in enumerate(mbs) if m.covering), key=lambda t: (t[0], t[1] % k, t[1], t[2]))
        have = exact_attention()
        for _, j, live in slots:
            if have >= need:
                break
            assignments[live][j] = dataclasses.replace(assignments[live][j], exact_attention=True)
            have += 1
    return Fold({r: tuple(mbs) for r, mbs in assignments.items()}, divisor=dp * k, divisor_mha=exact_attention())


def micro_batch_policy(policy, m: MicroBatch):
    """The covering policy (a CoverPolicy) micro-batch `m` runs with: None (exact) unless it covers;
    one kept by the exact-attention floor runs with its attention backward."""
    if policy is None or not m.covering:
        return None
    return dataclasses.replace(policy, skip_attention=False) if m.exact_attention else policy


def sample_range(step: int, replica: int, index: int, *, micro_batch_size: int, dp: int, k: int) -> range:
    """Global sample indices of micro-batch `index` of original replica `replica` at `step`."""
    global_batch = dp * k * micro_batch_size
    start = step * global_batch + (replica * k + index) * micro_batch_size
    return range(start, start + micro_batch_size)
