"""Linear map with an exact forward and MeCeFO's low-rank weight gradient (MeCeFO §3.3, Eq. 5).

For y = x W^T + b, with W (out, in) and the projector's basis V (in, r):

    forward:   y = x W^T + b                    (exact; saves x V (tokens, r) instead of x)
    backward:  G_x = G_y W                       (exact)
               G_b = sum over tokens of G_y      (exact)
               G_W ~ (G_y^T (x V)) V^T           (2brm + 2rmn FLOPs instead of 2bmn)

Plain torch, no distribution: callers that shard W (tensor parallelism) do their communication
around this function and give it the local shard and a projector of that shard.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from megatron_mecefo.approx.projector import LowRankProjector

__all__ = ["LowRankWeightGradLinear", "lowrank_linear", "main_grad_hook"]

WGradHook = Callable[[torch.Tensor], Optional[torch.Tensor]]


class LowRankWeightGradLinear(torch.autograd.Function):
    """autograd.Function behind `lowrank_linear`; takes the basis V as a tensor."""

    @staticmethod
    def forward(ctx, x, weight, bias, basis, wgrad_hook):
        # x: (..., in), weight: (out, in), bias: (out,) or None, basis V: (in, r)
        y = torch.matmul(x, weight.t())  # same op order as Megatron's linear, so forwards match
        if bias is not None:
            y = y + bias
        xv = torch.matmul(x, basis)  # (..., r): all that backward needs of x
        ctx.save_for_backward(xv, weight, basis)
        ctx.has_bias = bias is not None
        ctx.wgrad_hook = wgrad_hook
        return y

    @staticmethod
    def backward(ctx, grad_y):
        xv, weight, basis = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.matmul(grad_y, weight)  # (..., in), exact
        gy = grad_y.reshape(-1, grad_y.shape[-1])  # (tokens, out)
        if ctx.needs_input_grad[1]:
            small = torch.matmul(gy.t(), xv.reshape(-1, xv.shape[-1]))  # (out, r)
            grad_w = torch.matmul(small, basis.t())  # (out, in)
            if ctx.wgrad_hook is not None:
                grad_w = ctx.wgrad_hook(grad_w)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = gy.sum(dim=0)
        return grad_x, grad_w, grad_b, None, None


def lowrank_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    projector: LowRankProjector,
    wgrad_hook: Optional[WGradHook] = None,
) -> torch.Tensor:
    """y = x W^T + b whose weight gradient is (G_y^T (x V)) V^T with V = projector's basis.

    Args:
        x: input (..., in).
        weight: W (out, in).
        bias: b (out,) or None.
        projector: gives V (in, r), W's or x's own; call `projector.maybe_refresh(weight, step)` first.
        wgrad_hook: called with the approximate G_W in backward; what it returns is handed to
            autograd as W's gradient (None: nothing is). Lets Megatron accumulate into main_grad.

    Returns:
        y (..., out), exact.
    """
    basis = projector.basis_for(x)
    if basis.shape[0] != weight.shape[1]:
        raise ValueError(
            f"projector basis has {basis.shape[0]} rows but the weight has {weight.shape[1]} input features"
        )
    return LowRankWeightGradLinear.apply(x, weight, bias, basis, wgrad_hook)


def main_grad_hook(weight: torch.Tensor) -> WGradHook:
    """A `wgrad_hook` for Megatron's gradient-accumulation-fusion contract: the approximate G_W is
    added into `weight.main_grad` (read now, at forward time, as Megatron does), and a dummy gradient
    is handed to autograd exactly as Megatron's fused path does (the fused kernel itself is not used)."""
    main_grad = weight.main_grad

    def hook(grad_weight: torch.Tensor) -> Optional[torch.Tensor]:
        main_grad.add_(grad_weight.to(main_grad.dtype))
        if not hasattr(weight, "grad_added_to_main_grad"):
            return None
        # A dummy gradient keeps Megatron DDP's backward hooks on the main thread (as upstream).
        weight.grad_added_to_main_grad = True
        if getattr(weight, "zero_out_wgrad", False):
            return torch.zeros(main_grad.shape, dtype=grad_weight.dtype, device=main_grad.device)
        return torch.empty(main_grad.shape, dtype=grad_weight.dtype, device=main_grad.device)

    return hook
