import dataclasses

import pytest
import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec, build_module, import_module

from megatron_mecefo import get_gpt_layer_mecefo_spec, mecefo_gpt_layer_spec
from megatron_mecefo.layers import (
    LowRankColumnParallelLinear,
    LowRankRowParallelLinear,
    MeCeFOTransformerLayer,
    to_mecefo_spec,
)
from megatron_mecefo.layers.model import build_gpt, llama_config
from megatron_mecefo.params import GradGroup, grad_group, split_by_group
from tests.helpers import SEQ, TINY, VOCAB


def _layer(spec, config):
    torch.manual_seed(0)
    return build_module(spec, config=config, layer_number=1)


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_layer_has_stock_parameters_and_state_dict(megatron_world, normalization):
    config = llama_config(**TINY, normalization=normalization)
    stock = _layer(get_gpt_layer_local_spec(normalization=normalization), config)
    ours = _layer(get_gpt_layer_mecefo_spec(normalization=normalization), config)
    assert isinstance(ours, MeCeFOTransformerLayer)
    assert isinstance(ours.mlp.linear_fc1, LowRankColumnParallelLinear)
    assert isinstance(ours.mlp.linear_fc2, LowRankRowParallelLinear)
    h, f = TINY["hidden_size"], TINY["ffn_hidden_size"]
    # two norms (weight, + bias for LayerNorm) + qkv (3h*h) + proj (h*h) + fc1 (2f*h, SwiGLU) + fc2 (h*f)
    norms = 2 * h * (2 if normalization == "LayerNorm" else 1)
    expected = norms + 3 * h * h + h * h + 2 * f * h + h * f
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in stock.parameters()) == expected
    assert list(ours.state_dict().keys()) == list(stock.state_dict().keys())
    for (n, a), (_, b) in zip(stock.state_dict().items(), ours.state_dict().items()):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), n


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_module_level_spec_follows_config_normalization(megatron_world, normalization):
    # what Megatron-LM's `--spec megatron_mecefo.layers.specs mecefo_gpt_layer_spec` resolves to
    spec = import_module(["megatron_mecefo.layers.specs", "mecefo_gpt_layer_spec"])
    assert spec is mecefo_gpt_layer_spec and isinstance(spec, ModuleSpec)
    config = llama_config(**TINY, normalization=normalization)
    ours = _layer(spec, config)
    stock = _layer(get_gpt_layer_local_spec(normalization=normalization), config)
    assert type(ours.input_layernorm) is type(stock.input_layernorm)
    assert type(ours.pre_mlp_layernorm) is type(stock.pre_mlp_layernorm)
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in stock.parameters())


def test_attention_parameters_are_tagged(megatron_world):
    model = build_gpt(llama_config(**TINY), vocab_size=VOCAB, seq_length=SEQ)
    mha = sorted(n for n, p in model.named_parameters() if grad_group(p) is GradGroup.MHA)
    expected = sorted(
        f"decoder.layers.{i}.{s}"
        for i in range(TINY["num_layers"])
        for s in ("input_layernorm.weight", "self_attention.linear_qkv.weight", "self_attention.linear_proj.weight")
    )
    assert mha == expected
    groups = split_by_group(model.named_parameters())
    assert sorted(n for n, _ in groups[GradGroup.MHA]) == expected
    assert len(groups[GradGroup.DEFAULT]) == len(list(model.parameters())) - len(expected)


def test_refuses_moe_and_non_local_linears(megatron_world):
    with pytest.raises(ValueError, match="MoE"):
        get_gpt_layer_mecefo_spec(num_experts=4)
    spec = get_gpt_layer_local_spec()

    class OtherLinear(torch.nn.Module):
        pass

    mlp = dataclasses.replace(spec.submodules.mlp, submodules=dataclasses.replace(spec.submodules.mlp.submodules, linear_fc1=OtherLinear))
    bad = dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, mlp=mlp))
    with pytest.raises(ValueError, match="local ColumnParallelLinear/RowParallelLinear for linear_fc1.*OtherLinear"):
        to_mecefo_spec(bad)
    with pytest.raises(ValueError, match="TransformerLayer spec"):
        to_mecefo_spec(ModuleSpec(module=torch.nn.Linear))
    # idempotent
    twice = to_mecefo_spec(get_gpt_layer_mecefo_spec())
    assert twice.submodules.mlp.submodules.linear_fc1 is LowRankColumnParallelLinear
