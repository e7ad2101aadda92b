"""SavedTensorMeter: bytes autograd keeps for backward, the activation memory MeCeFO reduces.

Counts the distinct storages packed by saved-tensor hooks while it is active, leaving out
parameters (they are resident anyway). Checkpointed regions count their saved inputs only, which
is what they hold. Used by tests and benchmarks/covering_cost.py; plain torch, no side effects.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Tuple

import torch

__all__ = ["SavedTensorMeter"]


class SavedTensorMeter:
    """Context manager: `with SavedTensorMeter(model.parameters()) as m: loss = model(x)`; `m.total`."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._exclude = {p.untyped_storage().data_ptr() for p in exclude}
        self.storages: Dict[int, int] = {}
        self.shapes: List[Tuple[int, ...]] = []

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self._exclude:
            self.storages[ptr] = storage.nbytes()
            self.shapes.append(tuple(t.shape))
        return t

    def __enter__(self) -> "SavedTensorMeter":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    @property
    def total(self) -> int:
        """Bytes of distinct non-parameter storages saved for backward."""
        return sum(self.storages.values())
