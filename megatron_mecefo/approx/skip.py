"""Skip-connection backward for a residual branch (MeCeFO §3.1, attention).

For h = x + MHA(norm(x)), a covering rank runs the whole block forward without building a graph
and lets the gradient flow through the residual only: dL/dx = dL/dh. The branch's parameters get
no gradient, and none of its activations are kept for backward. The forward value is exactly the
exact-mode value (the same ops run, only without autograd).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["forward_with_residual_grad", "ResidualOnlyGrad"]


class ResidualOnlyGrad(torch.autograd.Function):
    """Returns `value` (computed without a graph) and routes its gradient to `residual` unchanged."""

    @staticmethod
    def forward(ctx, value, residual):
        # value: (s, b, h) computed under no_grad; residual: x, the block input, same shape
        if value.shape != residual.shape:
            raise ValueError(f"value {tuple(value.shape)} and residual {tuple(residual.shape)} differ in shape")
        return value.view_as(value)

    @staticmethod
    def backward(ctx, grad):
        return None, grad


def forward_with_residual_grad(block: Callable[..., Any], x: torch.Tensor, *args, **kwargs) -> Any:
    """Run `block(x, *args, **kwargs)` (which computes x + branch(x)) with an identity backward to x.

    `block` may return a tensor or a tuple whose first element is the block output; other elements
    are returned as computed (without a graph).
    """
    with torch.no_grad():
        out = block(x, *args, **kwargs)
    if not (x.requires_grad and torch.is_grad_enabled()):
        return out
    # detach: a block may re-enable grad inside (Megatron's bias-dropout-add runs under
    # torch.enable_grad), which would leave a stray graph edge from x through the residual add.
    if isinstance(out, tuple):
        return (ResidualOnlyGrad.apply(out[0].detach(), x),) + tuple(out[1:])
    return ResidualOnlyGrad.apply(out.detach(), x)
