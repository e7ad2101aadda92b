"""FFN recomputation for covering micro-batches (MeCeFO §3.2).

Keeps only the FFN block's input and reruns the block in backward, with
torch.utils.checkpoint's non-reentrant implementation (works under autograd hooks, with inputs
that do not require grad, and on CPU, unlike Megatron's reentrant CheckpointFunction which saves
CUDA RNG states). RNG state is restored for the rerun, so dropout masks match.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.utils.checkpoint

from megatron_mecefo.approx.mode import CoverPolicy, activate

__all__ = ["recompute"]


def recompute(fn: Callable[..., Any], *args, policy: Optional[CoverPolicy] = None, **kwargs) -> Any:
    """Run `fn(*args, **kwargs)` keeping only its inputs; recompute its activations in backward.

    `policy` is re-activated around both the forward and the rerun, so submodules that read
    `active_policy()` (low-rank linears) make the same choice twice even though backward runs
    after the covering block has ended.
    """

    def run(*a, **kw):
        with activate(policy):
            return fn(*a, **kw)

    return torch.utils.checkpoint.checkpoint(
        run, *args, use_reentrant=False, preserve_rng_state=True, **kwargs
    )
