"""MeCeFO's gradient of one step computed in one process: the reference the runtime must match.

Runs every live replica's micro-batches of a `Fold` on one model (covering micro-batches under the
given `CoverPolicy`) and applies the runtime's divisors. Used by tests (against the gradient a real
degraded step applies) and by benchmarks/convergence.py (against the exact gradient).
"""

from __future__ import annotations

from typing import Callable, Dict, Optional

import torch

from megatron_mecefo.approx import CoverPolicy, covering
from megatron_mecefo.elastic.plan.fold import Fold, MicroBatch, micro_batch_policy
from megatron_mecefo.params import GradGroup, grad_group

__all__ = ["reference_gradient"]


def reference_gradient(model: torch.nn.Module, fold: Fold, loss_of: Callable[[MicroBatch], torch.Tensor],
                       policy: Optional[CoverPolicy] = None) -> Dict[str, torch.Tensor]:
    """{parameter name: averaged gradient} of one step.

    Args:
        loss_of: the mean loss of a micro-batch (runs the model's forward).
        policy: the covering ranks' policy; None computes the exact data-parallel gradient of the
            same micro-batches (every divisor = the global batch's micro-batch count).
    """
    model.zero_grad(set_to_none=True)
    for micro_batches in fold.assignments.values():
        for m in micro_batches:
            with covering(model, micro_batch_policy(policy, m)):
                loss = loss_of(m)
            loss.backward()
    out = {}
    for name, p in model.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        divisor = fold.divisor_mha if (policy is not None and grad_group(p) is GradGroup.MHA) else fold.divisor
        out[name] = g / divisor if divisor else torch.zeros_like(g)  # no exact attention data: no update
    return out
