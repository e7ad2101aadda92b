"""The run-time switch between the exact backward and MeCeFO's covering backward.

A covering rank (one that also runs a failed neighbour's micro-batches) switches its layers into
covering mode per micro-batch, with no module rebuild. This module owns only that switch:

* `CoverPolicy` says which approximations a covering micro-batch gets (MeCeFO §3.1-3.3).
* `set_covering` / `covering` flip every `Coverable` module of a model; they know no layer internals,
  so the fault-tolerance runtime can drive them without importing Megatron.
* `activate` / `active_policy` carry the decision a layer took at its forward down to its submodules
  (the FFN linears), and into recomputation, which runs later in backward when the model's flag may
  already describe another micro-batch.

It does not decide *when* a rank covers (the runtime does) and holds no tensors.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Iterator, Optional

import torch

__all__ = [
    "CoverPolicy",
    "Coverable",
    "active_policy",
    "activate",
    "set_covering",
    "covering",
    "SVD_METHODS",
    "BASES",
]

SVD_METHODS = ("auto", "exact", "randomized")
BASES = ("weight", "activation", "gradient")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CoverPolicy:
    """What a covering micro-batch does differently from the exact one.

    Built by `MeCeFOConfig.cover_policy(step)`; plain data so it can be snapshotted per micro-batch.
    """

    step: int
    """Optimizer step of this micro-batch; drives the refresh of the low-rank bases."""
    skip_attention: bool = True
    """Attention runs forward only; its backward is the residual path (MeCeFO §3.1)."""
    recompute_ffn: bool = False
    """Keep only each FFN block's input and recompute the rest in backward (MeCeFO §3.2)."""
    lowrank_ffn: bool = True
    """FFN weight gradients projected onto `rank` input directions (MeCeFO §3.3)."""
    basis: str = "weight"
    """Those directions: "weight" (top right singular vectors of W, the paper), "activation"
    (the dominant directions of the micro-batch's own FFN input) or "gradient" (top right singular
    vectors of W's last aggregated gradient, see projector.py)."""
    rank: int = 64
    """Rank r of the projection; must be < min(out, in) of every (local) FFN weight."""
    tau: int = 200
    """Steps between refreshes of a projection basis."""
    svd_method: str = "auto"
    """'exact' (torch.linalg.svd), 'randomized' (torch.svd_lowrank) or 'auto' (exact up to
    `svd_exact_max_dim`)."""
    svd_exact_max_dim: int = 4096
    """With 'auto': exact SVD when min(out, in) <= this, randomized above."""

    def __post_init__(self) -> None:
        if self.rank <= 0:
            raise ValueError(f"CoverPolicy.rank must be > 0, got {self.rank}")
        if self.tau <= 0:
            raise ValueError(f"CoverPolicy.tau must be > 0, got {self.tau}")
        if self.basis not in BASES:
            raise ValueError(f"CoverPolicy.basis must be one of {BASES}, got {self.basis!r}")
        if self.svd_method not in SVD_METHODS:
            raise ValueError(f"CoverPolicy.svd_method must be one of {SVD_METHODS}, got {self.svd_method!r}")


class Coverable:
    """Mixin for modules that read a per-module `mecefo_policy` at forward (None = exact)."""

    mecefo_policy: Optional[CoverPolicy] = None


_ACTIVE: contextvars.ContextVar[Optional[CoverPolicy]] = contextvars.ContextVar(
    "mecefo_active_policy", default=None
)


def active_policy() -> Optional[CoverPolicy]:
    """The policy of the covering forward in progress on this thread, or None when exact."""
    return _ACTIVE.get()


@contextlib.contextmanager
def activate(policy: Optional[CoverPolicy]) -> Iterator[None]:
    """Make `policy` visible to `active_policy()` inside the block (None = exact)."""
    token = _ACTIVE.set(policy)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def set_covering(model: torch.nn.Module, policy: Optional[CoverPolicy]) -> int:
    """Switch every `Coverable` module of `model` to `policy` (None = exact backward).

    Takes effect at the next forward; a forward already run keeps the mode it ran with.

    Args:
        model: a model, or a wrapper of one (DeepSpeed engine, DDP): all submodules are visited.
        policy: the covering policy, or None for the exact backward.

    Returns:
        The number of modules switched.

    Raises:
        ValueError: a policy was given but the model has no MeCeFO layers.
    """
    count = 0
    for module in model.modules():
        if isinstance(module, Coverable):
            module.mecefo_policy = policy
            count += 1
    if policy is not None and count == 0:
        raise ValueError(
            "set_covering: the model has no MeCeFO layers; build its transformer layers with "
            "megatron_mecefo.get_gpt_layer_mecefo_spec() (or --spec megatron_mecefo.layers.specs "
            "mecefo_gpt_layer_spec)"
        )
    return count


@contextlib.contextmanager
def covering(model: torch.nn.Module, policy: Optional[CoverPolicy]) -> Iterator[torch.nn.Module]:
    """Run the forwards inside the block in covering mode; restores the previous modes on exit.

    The backward of those forwards may run after the block: the mode is fixed at forward time.
    """
    previous = [(m, m.mecefo_policy) for m in model.modules() if isinstance(m, Coverable)]
    set_covering(model, policy)
    try:
        yield model
    finally:
        for module, old in previous:
            module.mecefo_policy = old
