"""The gradient arithmetic of a MeCeFO step: one flat fp32 all-reduce (SUM) of every gradient and
a few statistics over a data-parallel group, then MeCeFO's divisors (paper, Sec. 3: attention
gradients averaged over the micro-batches that computed them, everything else over the whole
global batch). Knows tensors and a group, not the protocol around them (runtime.py)."""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import torch

from megatron_mecefo.elastic.comm import groups
from megatron_mecefo.params import GradGroup, grad_group

__all__ = ["reduce_with_divisors", "divisor_scale"]


def reduce_with_divisors(group, params: Sequence[torch.nn.Parameter], stats: Sequence[float], *, divisor: int,
                         divisor_mha: int, attr: str = "grad",
                         should_abort: Optional[Callable[[], bool]] = None) -> List[float]:
    """All-reduce the SUMMED gradients of `params` (and `stats`) over `group`; divide.

    Args:
        divisor, divisor_mha: the fold's divisors of non-attention and attention gradients (an
            attention divisor of 0: no member computed an attention gradient; it is zero).
        attr: "grad" (replaced by the reduced tensor, in the parameter's dtype) or "main_grad"
            (Megatron's DDP buffers, written in place so they stay what its optimizer reads).
        should_abort: polled while waiting; True ends the wait (groups.allreduce_sum_).

    Returns:
        The summed `stats`.

    Raises:
        whatever the collective raises (a peer failed); the gradients are then unchanged.
    """
    grads = [getattr(p, attr, None) for p in params]
    grads = [g if g is not None else torch.zeros_like(p) for p, g in zip(params, grads)]
    device = grads[0].device if grads else torch.device("cpu")
    flat = torch.cat([g.detach().reshape(-1).float() for g in grads]
                     + [torch.tensor(list(stats), dtype=torch.float32, device=device)])
    groups.allreduce_sum_(group, flat, should_abort=should_abort)
    offset = 0
    for p, g in zip(params, grads):
        n = g.numel()
        reduced = flat[offset:offset + n] * divisor_scale(p, divisor, divisor_mha)
        if attr == "grad":
            p.grad = reduced.view_as(p).to(p.dtype)
        else:
            g.copy_(reduced.view_as(g))
        offset += n
    return flat[offset:].cpu().tolist()


def divisor_scale(p: torch.Tensor, divisor: int, divisor_mha: int) -> float:
    """What `p`'s summed gradient is multiplied by: 1 / the fold's divisor of its group (attention
    gradients: the micro-batches that computed one; 0 when none did)."""
    if grad_group(p) is GradGroup.MHA:
        return 1.0 / divisor_mha if divisor_mha else 0.0
    return 1.0 / divisor
