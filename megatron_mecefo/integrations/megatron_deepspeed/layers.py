"""MeCeFO's covering backward on Megatron-DeepSpeed's own layers (megatron/model/transformer.py).

`wrap_model` swaps the class of each dense `ParallelTransformerLayer`'s submodules for a subclass
that only adds a covering path, so parameters, `state_dict` keys and DeepSpeed checkpoints are
unchanged and exact mode runs the upstream `forward` untouched:

* `self_attention` (ParallelAttention): with `skip_attention`, a covering micro-batch runs it
  forward without a graph; the layer's residual carries the whole gradient (MeCeFO §3.1). Its
  parameters and the input norm's are tagged MHA (averaged over non-covering micro-batches only).
* `mlp` (ParallelMLP): with `recompute_ffn`, only its input is kept and the block reruns in
  backward (§3.2); its two linears take the policy from `approx.active_policy()`.
* `mlp.dense_h_to_4h` / `mlp.dense_4h_to_h` (the vendored Column/RowParallelLinear): with
  `lowrank_ffn`, the matmul goes through `approx.lowrank_linear` (§3.3), with the upstream layer's
  tensor-parallel communication done by its own mapping functions around it.

The upstream classes are imported when `wrap_model` runs: Megatron-DeepSpeed's `megatron` package
must be the one on sys.path (its checkout's root), never megatron-core.
"""

from __future__ import annotations

import functools
from typing import List, Optional, Tuple

import torch

from megatron_mecefo.approx import Coverable, activate, active_policy, lowrank_linear, recompute
from megatron_mecefo.approx.lowrank_grad import main_grad_hook
from megatron_mecefo.approx.projector import check_rank, projector_for
from megatron_mecefo.params import GradGroup, tag_parameters

__all__ = ["wrap_model", "covered_linears"]


@functools.lru_cache(maxsize=None)
def _classes():
    """The covering subclasses, built on the upstream classes of the `megatron` package in use."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.tensor_parallel import mappings
    from megatron.model.transformer import ParallelAttention, ParallelMLP

    class MeCeFOParallelAttention(Coverable, ParallelAttention):
        def forward(self, hidden_states, attention_mask, *args, **kwargs):
            policy = self.mecefo_policy
            if policy is None or not policy.skip_attention or not torch.is_grad_enabled():
                return super().forward(hidden_states, attention_mask, *args, **kwargs)
            with torch.no_grad():  # every rank of the replica runs the same micro-batch: TP stays in step
                output, bias = super().forward(hidden_states, attention_mask, *args, **kwargs)
            return output, (bias.detach() if bias is not None else None)

    class MeCeFOParallelMLP(Coverable, ParallelMLP):
        def forward(self, hidden_states):
            policy = self.mecefo_policy
            if policy is None or not torch.is_grad_enabled():
                return super().forward(hidden_states)
            if policy.recompute_ffn:
                return recompute(super().forward, hidden_states, policy=policy)
            with activate(policy):
                return super().forward(hidden_states)

    def _lowrank(layer, x):
        policy = active_policy()
        projector = projector_for(layer, policy)
        projector.maybe_refresh(layer.weight, policy.step)
        fused = layer.gradient_accumulation_fusion and hasattr(layer.weight, "main_grad")
        return projector, (main_grad_hook(layer.weight) if fused else None)

    def _use_lowrank(layer) -> bool:
        policy = active_policy()
        return policy is not None and policy.lowrank_ffn and layer.weight.requires_grad and torch.is_grad_enabled()

    class MeCeFOColumnParallelLinear(ColumnParallelLinear):
        mecefo_lowrank = True  # found by approx.projector.observe_gradients

        def forward(self, input_, weight=None):
            if weight is not None or not _use_lowrank(self):
                return super().forward(input_, weight)
            if self.sequence_parallel:  # all-gather; reduce-scatter of G_x in backward
                x = mappings.gather_from_sequence_parallel_region(input_, True)
            else:  # identity; all-reduce of G_x in backward (the stock path's async all-reduce)
                x = mappings.copy_to_tensor_model_parallel_region(input_)
            projector, hook = _lowrank(self, x)
            bias = self.bias if not self.skip_bias_add else None
            output = lowrank_linear(x, self.weight, bias, projector, wgrad_hook=hook)
            if self.gather_output:
                output = mappings.gather_from_tensor_model_parallel_region(output)
            return output, (self.bias if self.skip_bias_add else None)

    class MeCeFORowParallelLinear(RowParallelLinear):
        mecefo_lowrank = True  # found by approx.projector.observe_gradients

        def forward(self, input_):
            if not _use_lowrank(self) or not self.input_is_parallel:
                return super().forward(input_)
            projector, hook = _lowrank(self, input_)
            output = lowrank_linear(input_, self.weight, None, projector, wgrad_hook=hook)
            if self.sequence_parallel:
                output = mappings.reduce_scatter_to_sequence_parallel_region(output)
            else:
                output = mappings.reduce_from_tensor_model_parallel_region(output)
            if self.skip_bias_add:
                return output, self.bias
            return (output + self.bias if self.bias is not None else output), None

    return {ParallelAttention: MeCeFOParallelAttention, ParallelMLP: MeCeFOParallelMLP,
            ColumnParallelLinear: MeCeFOColumnParallelLinear, RowParallelLinear: MeCeFORowParallelLinear}


def _swap(module: torch.nn.Module, classes) -> None:
    if type(module) not in classes:
        raise ValueError(f"MeCeFO supports the dense {', '.join(c.__name__ for c in classes)} layers of "
                         f"Megatron-DeepSpeed; this model has {type(module).__module__}.{type(module).__name__}")
    module.__class__ = classes[type(module)]


def wrap_model(model: torch.nn.Module, rank: Optional[int]) -> torch.nn.Module:
    """Give every transformer layer of `model` the covering path (in place; returns `model`).

    Args:
        rank: the low-rank gradient's rank r, checked against every local FFN weight (None: the
            low-rank gradient is off).

    Raises:
        ValueError: a layer MeCeFO does not cover (MoE, FPDT or Transformer Engine attention, cross
            attention), or r >= min(out, in) of an FFN weight shard.
    """
    from megatron.model.transformer import ParallelTransformerLayer

    classes = _classes()
    layers = [m for m in model.modules() if isinstance(m, ParallelTransformerLayer)]
    if not layers:
        raise ValueError("MeCeFO found no ParallelTransformerLayer in the model (Transformer Engine layers "
                         "(--transformer-impl transformer_engine) are not supported)")
    for layer in layers:
        if getattr(layer, "num_experts", 1) > 1 or getattr(layer, "ds_sequence_parallel_fpdt", False):
            raise ValueError("MeCeFO supports dense layers only: not DeepSpeed-MoE (--num-experts > 1) or FPDT "
                             "(--ds-sequence-parallel-fpdt)")
        if hasattr(layer, "inter_attention"):
            raise ValueError("MeCeFO supports decoder-only (GPT) layers: this layer has cross attention")
        _swap(layer.self_attention, classes)
        _swap(layer.mlp, classes)
        _swap(layer.mlp.dense_h_to_4h, classes)
        _swap(layer.mlp.dense_4h_to_h, classes)
        tag_parameters(layer.self_attention, GradGroup.MHA)
        tag_parameters(layer.input_layernorm, GradGroup.MHA)
    if rank is not None:
        check_rank(rank, covered_linears(model), key="--mecefo-rank")
    return model


def covered_linears(model: torch.nn.Module) -> List[Tuple[str, torch.Tensor]]:
    """(name, weight) of the FFN linears that take the low-rank gradient."""
    cls = tuple(c for base, c in _classes().items() if base.__name__.endswith("ParallelLinear"))
    return [(f"{n}.weight", m.weight) for n, m in model.named_modules() if isinstance(m, cls)]
