"""Exact mode is bit-identical to stock Megatron-Core (TP=1 here, TP=2 in test_tensor_parallel.py)."""

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

from megatron_mecefo import get_gpt_layer_mecefo_spec, mecefo_gpt_layer_spec
from megatron_mecefo.layers.model import build_gpt, llama_config
from tests.helpers import SEQ, TINY, VOCAB, gpt_loss, make_batch


def _train(model, steps=3, lr=0.1):
    losses, grads = [], []
    for step in range(steps):
        model.zero_grad()
        loss = gpt_loss(model, make_batch(step))
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        with torch.no_grad():
            for p in model.parameters():
                p.add_(p.grad, alpha=-lr)
    return losses, grads


def _check_identical(stock_spec, ours_spec, **cfg):
    config = llama_config(**TINY, dropout=0.1, **cfg)
    torch.manual_seed(7)
    stock = build_gpt(config, vocab_size=VOCAB, seq_length=SEQ, spec=stock_spec, seed=3)
    torch.manual_seed(7)
    ours = build_gpt(config, vocab_size=VOCAB, seq_length=SEQ, spec=ours_spec, seed=3)
    torch.manual_seed(11)
    model_parallel_cuda_manual_seed(11)  # same dropout streams (default and tensor-parallel) for both
    ls, gs = _train(stock)
    torch.manual_seed(11)
    model_parallel_cuda_manual_seed(11)
    lo, go = _train(ours)
    assert ls == lo
    for a, b in zip(gs, go):
        assert a.keys() == b.keys()
        for n in a:
            assert torch.equal(a[n], b[n]), n


def test_exact_mode_bit_identical_rmsnorm_swiglu(megatron_world):
    _check_identical(get_gpt_layer_local_spec(normalization="RMSNorm"), get_gpt_layer_mecefo_spec(normalization="RMSNorm"))


def test_exact_mode_bit_identical_layernorm_gelu_bias(megatron_world):
    cfg = dict(normalization="LayerNorm", gated_linear_unit=False, activation_func=torch.nn.functional.gelu, add_bias_linear=True)
    _check_identical(get_gpt_layer_local_spec(), get_gpt_layer_mecefo_spec(), **cfg)
    _check_identical(get_gpt_layer_local_spec(), mecefo_gpt_layer_spec, **cfg)
