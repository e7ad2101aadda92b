"""GPT layer specs with MeCeFO's covering backward, derived from Megatron-Core's local spec.

Extend by spec, not by fork: the stock spec is built first and only three entries are swapped with
`dataclasses.replace`, so every other upstream default survives:

    module                    TransformerLayer      -> MeCeFOTransformerLayer
    mlp.submodules.linear_fc1 ColumnParallelLinear  -> LowRankColumnParallelLinear
    mlp.submodules.linear_fc2 RowParallelLinear     -> LowRankRowParallelLinear

Megatron-LM users select it with

    --spec megatron_mecefo.layers.specs mecefo_gpt_layer_spec

(`--spec` imports the named object and uses it uncalled; its norms follow `--normalization`).
LLaMA-style models need no special spec: RMSNorm, SwiGLU (`gated_linear_unit`) and rotary
embeddings are TransformerConfig / GPTModel options. MoE layers and Transformer Engine linears are
not supported by the low-rank FFN gradient and are refused with a clear error.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron_mecefo.layers.compat import ConfigNorm, mlp_submodules, replace_mlp_submodules
from megatron_mecefo.layers.linear import LowRankColumnParallelLinear, LowRankRowParallelLinear
from megatron_mecefo.layers.transformer_layer import MeCeFOTransformerLayer

__all__ = ["get_gpt_layer_mecefo_spec", "to_mecefo_spec", "mecefo_gpt_layer_spec"]

_LOWRANK = {ColumnParallelLinear: LowRankColumnParallelLinear, RowParallelLinear: LowRankRowParallelLinear}


def _lowrank(linear, which: str):
    if linear in _LOWRANK.values():
        return linear
    if linear not in _LOWRANK:
        raise ValueError(
            f"MeCeFO's low-rank FFN gradient needs Megatron-Core's local ColumnParallelLinear/"
            f"RowParallelLinear for {which}; the spec has {getattr(linear, '__name__', linear)!r}. "
            "Use get_gpt_layer_mecefo_spec() (built on get_gpt_layer_local_spec)."
        )
    return _LOWRANK[linear]


def to_mecefo_spec(spec: ModuleSpec) -> ModuleSpec:
    """Turn a dense GPT TransformerLayer spec into its MeCeFO twin (see the module docstring).

    Raises:
        ValueError: the spec is not a dense TransformerLayer with local FFN linears.
    """
    if not (isinstance(spec.module, type) and issubclass(spec.module, TransformerLayer)):
        raise ValueError(f"to_mecefo_spec expects a TransformerLayer spec, got module {spec.module!r}")
    sub = spec.submodules
    mlp_sub = mlp_submodules(sub.mlp)
    if not hasattr(mlp_sub, "linear_fc1"):
        raise ValueError("to_mecefo_spec supports dense MLP layers only (MoE is not supported)")
    mlp = replace_mlp_submodules(
        sub.mlp,
        linear_fc1=_lowrank(mlp_sub.linear_fc1, "linear_fc1"),
        linear_fc2=_lowrank(mlp_sub.linear_fc2, "linear_fc2"),
    )
    return dataclasses.replace(spec, module=MeCeFOTransformerLayer, submodules=dataclasses.replace(sub, mlp=mlp))


def get_gpt_layer_mecefo_spec(
    num_experts: Optional[int] = None,
    moe_grouped_gemm: Optional[bool] = False,
    qk_layernorm: Optional[bool] = False,
    multi_latent_attention: Optional[bool] = False,
    normalization: Optional[str] = None,
    qk_l2_norm: Optional[bool] = False,
) -> ModuleSpec:
    """`get_gpt_layer_local_spec` with MeCeFO's covering backward; same arguments.

    Args:
        num_experts: must be None (dense FFN); MoE is not supported.
        moe_grouped_gemm: must be False.
        qk_layernorm: layernorm on queries and keys (attention side, unaffected by MeCeFO).
        multi_latent_attention: use MLA for the attention (skipped in covering mode like MHA).
        normalization: "LayerNorm" (default) or "RMSNorm" for LLaMA-style models.
        qk_l2_norm: L2 norm on queries and keys.

    Returns:
        A ModuleSpec for GPTModel's `transformer_layer_spec`.
    """
    if num_experts or moe_grouped_gemm:
        raise ValueError("get_gpt_layer_mecefo_spec: MoE (num_experts / moe_grouped_gemm) is not supported")
    return to_mecefo_spec(
        get_gpt_layer_local_spec(
            qk_layernorm=qk_layernorm,
            multi_latent_attention=multi_latent_attention,
            normalization=normalization,
            qk_l2_norm=qk_l2_norm,
        )
    )


def _module_level_spec() -> ModuleSpec:
    spec = get_gpt_layer_mecefo_spec()
    sub = dataclasses.replace(spec.submodules, input_layernorm=ConfigNorm, pre_mlp_layernorm=ConfigNorm)
    return dataclasses.replace(spec, submodules=sub)


mecefo_gpt_layer_spec: ModuleSpec = _module_level_spec()
"""For `--spec megatron_mecefo.layers.specs mecefo_gpt_layer_spec`; norms follow config.normalization."""
