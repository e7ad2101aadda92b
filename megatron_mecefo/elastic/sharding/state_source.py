"""Where a sharded optimizer state starts from: pieces of the flat range [0, numel) of a checkpoint.

    source = StateSource(numel, pieces, origin="DIR/global_step6 (DeepSpeed ZeRO stage 1, 2 ranks)")
    sharded.load(source)            # elastic/sharding/zero.py: each rank reads the ranges it will hold

A piece is a range of the flat state (the optimizer's parameters in param-group order) with a
reader per key (AdamW: "exp_avg", "exp_avg_sq"; "master": fp32 masters of lower-precision
parameters) and its scalars (AdamW: "step"). The readers of each format build the pieces:
MeCeFO's shard files (elastic/sharding/zero.py), DeepSpeed's ZeRO partitions
(deepspeed_hook/zero_checkpoint.py), Megatron's distributed optimizer
(integrations/megatron_lm/dist_checkpoint.py). Readers are called lazily, so a rank touches only
the pieces its ranges overlap (files opened with mmap).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Sequence

import torch

__all__ = ["Piece", "StateSource"]


@dataclasses.dataclass(frozen=True)
class Piece:
    start: int
    end: int
    tensor: Callable[[str, int, int], torch.Tensor]
    """(key, lo, hi) -> the values of [start + lo, start + hi), flat (any floating dtype): a reader
    may read only that part."""
    scalars: Dict[str, float] = dataclasses.field(default_factory=dict)
    """The optimizer's scalars for the piece (missing ones: a fresh optimizer's)."""


class StateSource:
    """The flat optimizer state of a checkpoint, as pieces that cover [0, numel)."""

    def __init__(self, numel: int, pieces: Sequence[Piece], keys: Sequence[str], origin: str) -> None:
        self.numel, self.keys, self.origin = numel, list(keys), origin
        self.pieces = sorted((p for p in pieces if p.start < p.end), key=lambda p: p.start)
        reach = 0
        for p in self.pieces:
            if p.start > reach:
                break
            reach = max(reach, p.end)
        if reach < numel:
            raise ValueError(f"{origin}: the optimizer state covers [0, {reach}) of {numel} elements; "
                             "this checkpoint cannot resume the optimizer")

    def check(self, numel: int, keys: Sequence[str]) -> None:
        """Raise ValueError when the state is not of an optimizer of `numel` elements with `keys`."""
        if numel != self.numel:
            raise ValueError(f"{self.origin}: optimizer state of {self.numel} elements; this model's optimizer has "
                             f"{numel} (another model, or another tensor/pipeline layout)")
        missing = sorted(set(keys) - set(self.keys))
        if missing:
            raise ValueError(f"{self.origin}: the optimizer state has {sorted(self.keys)}, this job's optimizer "
                             f"needs {missing} too (another optimizer, or fp32 masters the checkpoint does not hold)")

    def read(self, key: str, start: int, end: int) -> torch.Tensor:
        """The fp32 values of `key` in [start, end)."""
        out = torch.zeros(end - start)
        for p in self._overlapping(start, end):
            lo, hi = max(start, p.start), min(end, p.end)
            out[lo - start:hi - start] = p.tensor(key, lo - p.start, hi - p.start).reshape(-1).float()
        return out

    def scalars(self, fresh: Dict[str, torch.Tensor], start: int, end: int) -> List[torch.Tensor]:
        """Each scalar of `fresh` (name -> a fresh optimizer's value) per element of [start, end)."""
        out = [torch.full((end - start,), float(v)) for v in fresh.values()]
        for p in self._overlapping(start, end):
            lo, hi = max(start, p.start), min(end, p.end)
            for i, k in enumerate(fresh):
                if k in p.scalars:
                    out[i][lo - start:hi - start] = float(p.scalars[k])
        return out

    def _overlapping(self, start: int, end: int):
        return (p for p in self.pieces if p.start < end and start < p.end)
