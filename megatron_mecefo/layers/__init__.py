"""Megatron-Core integration of MeCeFO, by spec only (see specs.py)."""

from megatron_mecefo.layers.cpu import enable_cpu_support
from megatron_mecefo.layers.linear import (
    LowRankColumnParallelLinear,
    LowRankRowParallelLinear,
    check_lowrank_rank,
    lowrank_linears,
)
from megatron_mecefo.layers.specs import get_gpt_layer_mecefo_spec, mecefo_gpt_layer_spec, to_mecefo_spec
from megatron_mecefo.layers.transformer_layer import MeCeFOTransformerLayer

__all__ = [
    "LowRankColumnParallelLinear",
    "LowRankRowParallelLinear",
    "MeCeFOTransformerLayer",
    "check_lowrank_rank",
    "enable_cpu_support",
    "get_gpt_layer_mecefo_spec",
    "lowrank_linears",
    "mecefo_gpt_layer_spec",
    "to_mecefo_spec",
]
