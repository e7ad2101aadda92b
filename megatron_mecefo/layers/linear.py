"""Megatron-Core Column/RowParallelLinear whose weight gradient turns low-rank in covering mode.

Exact mode is the stock layer, untouched. In covering mode (an active `CoverPolicy` with
`lowrank_ffn`) the matmul goes through `approx.lowrank_linear`, with the tensor-parallel
communication of the stock path done by Megatron's own mapping functions around it:

* column-parallel, TP > 1: input copied to the TP region (all-reduce of G_x in backward);
* sequence parallel: input all-gathered (reduce-scatter of G_x in backward);
* row-parallel: the input is already the local shard; the output reduction stays in the stock
  `forward`, which is not overridden.

Each rank projects with the top-r right singular vectors of its own weight shard, so no extra
communication is needed; r must be < min(out, in) of the local shard.

Megatron's `main_grad` contract is honoured: with `gradient_accumulation_fusion` the approximate
G_W is added into `weight.main_grad`, `grad_added_to_main_grad` is set, and a dummy gradient is
returned exactly as Megatron's fused path does (the fused CUDA kernel itself is not used; the
addition is a plain `add_`).
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)

from megatron_mecefo.approx import CoverPolicy, LowRankProjector, active_policy, lowrank_linear
from megatron_mecefo.approx.lowrank_grad import main_grad_hook
from megatron_mecefo.approx.projector import check_rank, projector_for

__all__ = [
    "LowRankColumnParallelLinear",
    "LowRankRowParallelLinear",
    "lowrank_linears",
    "check_lowrank_rank",
]

logger = logging.getLogger(__name__)


class _LowRankMixin:
    """Shared covering-mode matmul of the two low-rank linears."""

    _mecefo_projector: Optional[LowRankProjector] = None
    mecefo_lowrank = True  # approx.projector.observe_gradients finds the FFN linears by this

    def mecefo_projector(self, policy: CoverPolicy) -> LowRankProjector:
        """The projector of this layer's weight for `policy`'s settings (created on first use)."""
        return projector_for(self, policy)

    def _lowrank_forward_impl(
        self,
        input: torch.Tensor,
        weight: torch.Tensor,
        *,
        bias: Optional[torch.Tensor] = None,
        gradient_accumulation_fusion: bool = False,
        allreduce_dgrad: bool = False,
        sequence_parallel: bool = False,
        tp_group=None,
        grad_output_buffer=None,
        **_unused,
    ) -> torch.Tensor:
        policy = active_policy()
        if grad_output_buffer is not None:
            raise RuntimeError(
                "MeCeFO low-rank linears do not support deferred weight-gradient compute "
                "(defer_embedding_wgrad_compute); it is meant for the output layer, not the FFN"
            )
        if tp_group is None:
            tp_group = self.tp_group
        if sequence_parallel:
            input = gather_from_sequence_parallel_region(input, tensor_parallel_output_grad=True, group=tp_group)
        elif allreduce_dgrad:
            input = copy_to_tensor_model_parallel_region(input, group=tp_group)
        projector = self.mecefo_projector(policy)
        projector.maybe_refresh(weight, policy.step)
        hook = main_grad_hook(weight) if gradient_accumulation_fusion and hasattr(weight, "main_grad") else None
        return lowrank_linear(input, weight, bias, projector, wgrad_hook=hook)

    def _use_lowrank(self, weight: torch.Tensor, args: tuple) -> bool:
        policy = active_policy()
        return policy is not None and policy.lowrank_ffn and weight.requires_grad and not args


class LowRankColumnParallelLinear(_LowRankMixin, ColumnParallelLinear):
    """ColumnParallelLinear (FFN fc1 / gate+up) with a low-rank weight gradient in covering mode."""

    def _forward_impl(self, input, weight, *args, **kwargs):
        if not self._use_lowrank(weight, args):
            return super()._forward_impl(input, weight, *args, **kwargs)
        return self._lowrank_forward_impl(input, weight, **kwargs)


class LowRankRowParallelLinear(_LowRankMixin, RowParallelLinear):
    """RowParallelLinear (FFN fc2 / down) with a low-rank weight gradient in covering mode."""

    def _forward_impl(self, input, weight, *args, **kwargs):
        if not self._use_lowrank(weight, args):
            return super()._forward_impl(input, weight, *args, **kwargs)
        return self._lowrank_forward_impl(input, weight, **kwargs)


def lowrank_linears(model: torch.nn.Module):
    """(name, module) of every low-rank linear in `model`."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, _LowRankMixin)]


def check_lowrank_rank(model: torch.nn.Module, rank: int, *, key: str = "mecefo.rank") -> None:
    """Raise ValueError unless 0 < rank < min(out, in) of every (local) low-rank FFN weight.

    Call before training so a bad rank fails at start-up rather than at the first failure.
    """
    check_rank(rank, [(n, m.weight) for n, m in lowrank_linears(model) if m.weight is not None], key=key)
