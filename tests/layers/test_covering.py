"""Covering mode of the MeCeFO layers against the exact path, on a tiny LLaMA-style GPT."""

import pytest
import torch
from megatron.core.transformer.spec_utils import build_module

from megatron_mecefo import MeCeFOConfig, check_lowrank_rank, covering, get_gpt_layer_mecefo_spec, set_covering
from megatron_mecefo.approx import CoverPolicy
from megatron_mecefo.approx.memory import SavedTensorMeter
from megatron_mecefo.layers import lowrank_linears
from megatron_mecefo.layers.model import build_gpt
from megatron_mecefo.params import GradGroup, grad_group
from tests.helpers import SEQ, TINY, VOCAB, gpt_loss, grads, make_batch

SKIP_ONLY = dict(skip_attention=True, recompute_ffn=False, lowrank_ffn=False)
LOWRANK_ONLY = dict(skip_attention=False, recompute_ffn=False, lowrank_ffn=True, rank=8)
ALL_THREE = dict(skip_attention=True, recompute_ffn=True, lowrank_ffn=True, rank=8)


def _model(config):
    return build_gpt(config, vocab_size=VOCAB, seq_length=SEQ, seed=5)


def _grads_under(model, batch, policy):
    model.zero_grad()
    with covering(model, policy):
        loss = gpt_loss(model, batch)
    loss.backward()  # after the block: the mode was fixed at forward
    return loss.item(), grads(model)


def test_attention_parameters_get_no_gradient(tiny_config):
    model = _model(tiny_config)
    _, g = _grads_under(model, make_batch(0), CoverPolicy(step=0, **ALL_THREE))
    for name, p in model.named_parameters():
        if grad_group(p) is GradGroup.MHA:
            assert g[name] is None, name
        else:
            assert g[name] is not None and torch.count_nonzero(g[name]) > 0, name


def test_covering_forward_equals_exact_forward(tiny_config):
    model = _model(tiny_config)
    exact = gpt_loss(model, make_batch(1)).item()
    for kw in (SKIP_ONLY, LOWRANK_ONLY, ALL_THREE):
        loss, _ = _grads_under(model, make_batch(1), CoverPolicy(step=0, **kw))
        assert loss == exact, kw


def test_block_input_gradient_is_residual_plus_ffn_path(tiny_config):
    torch.manual_seed(0)
    layer = build_module(get_gpt_layer_mecefo_spec(normalization="RMSNorm"), config=tiny_config, layer_number=1)
    x = torch.randn(SEQ, 2, TINY["hidden_size"], requires_grad=True)
    g = torch.randn(SEQ, 2, TINY["hidden_size"])

    # reference: h from the exact attention sub-block, then d out/d h through the FFN sub-block alone
    with torch.no_grad():
        h, _ = layer._forward_attention(x)
    h_leaf = h.detach().clone().requires_grad_()
    layer._forward_mlp(h_leaf).backward(g)
    expected_dx = h_leaf.grad
    expected_ffn = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    layer.zero_grad()

    layer.mecefo_policy = CoverPolicy(step=0, **SKIP_ONLY)
    with SavedTensorMeter(exclude=layer.parameters()) as covered:
        out, _ = layer(hidden_states=x)
    out.backward(g)
    assert torch.equal(x.grad, expected_dx), "dL/dx must be dL/dh: the residual path plus the FFN block"
    for n, p in layer.named_parameters():
        if n in expected_ffn:
            assert torch.equal(p.grad, expected_ffn[n]), n
        else:
            assert p.grad is None, n

    # nothing of the attention is kept for backward: exactly what the FFN sub-block alone saves
    with SavedTensorMeter(exclude=layer.parameters()) as ffn_only:
        layer._forward_mlp(h.detach().clone().requires_grad_())
    layer.mecefo_policy = None
    with SavedTensorMeter(exclude=layer.parameters()) as exact:
        layer(hidden_states=x)
    assert covered.total == ffn_only.total
    assert covered.total < 0.7 * exact.total


def test_ffn_recompute_gives_the_gradients_of_no_recompute(tiny_config):
    model = _model(tiny_config)
    batch = make_batch(2)
    for base in (SKIP_ONLY, LOWRANK_ONLY, dict(skip_attention=False, lowrank_ffn=False)):
        _, without = _grads_under(model, batch, CoverPolicy(step=0, **{**base, "recompute_ffn": False}))
        model.zero_grad()
        with covering(model, CoverPolicy(step=0, **{**base, "recompute_ffn": True})):
            with SavedTensorMeter(exclude=model.parameters()) as rec:
                loss = gpt_loss(model, batch)
        loss.backward()
        with_rec = grads(model)
        for n in without:
            if without[n] is None:
                assert with_rec[n] is None, n
            else:
                torch.testing.assert_close(with_rec[n], without[n], rtol=0, atol=0, msg=n)
        with covering(model, CoverPolicy(step=0, **{**base, "recompute_ffn": False})):
            with SavedTensorMeter(exclude=model.parameters()) as no_rec:
                gpt_loss(model, batch)
        assert rec.total < no_rec.total, base


def test_lowrank_weight_gradient_is_projected_exact_gradient(tiny_config):
    model = _model(tiny_config)
    batch = make_batch(3)
    exact = _grads_under(model, batch, None)[1]
    _, cov = _grads_under(model, batch, CoverPolicy(step=0, **LOWRANK_ONLY))
    linears = dict(lowrank_linears(model))
    assert len(linears) == 2 * TINY["num_layers"]
    for name in exact:
        module_name = name.rsplit(".", 1)[0]
        if module_name in linears:
            v = linears[module_name]._mecefo_projector.basis
            assert v.shape == (linears[module_name].weight.shape[1], 8)
            torch.testing.assert_close(cov[name], exact[name] @ v @ v.T, rtol=1e-4, atol=1e-6, msg=name)
            assert not torch.allclose(cov[name], exact[name], atol=1e-4), name
        else:
            # the input gradient of the low-rank linears is exact, so nothing else changes
            torch.testing.assert_close(cov[name], exact[name], rtol=1e-5, atol=1e-7, msg=name)


def test_activation_basis_projects_on_each_linears_own_input(tiny_config):
    """basis "activation" reaches every FFN linear: its gradient is the exact one projected on the
    range finder's basis of the input that linear saw (fc1: the normed hidden; fc2: the activation)."""
    from megatron_mecefo.approx.projector import input_subspace

    model = _model(tiny_config)
    batch = make_batch(3)
    exact = _grads_under(model, batch, None)[1]
    linears = dict(lowrank_linears(model))
    seen = {}
    hooks = [m.register_forward_hook(lambda m, inp, out, n=n: seen.__setitem__(n, inp[0].detach()))
             for n, m in linears.items()]
    _, cov = _grads_under(model, batch, CoverPolicy(step=7, basis="activation", **LOWRANK_ONLY))
    for h in hooks:
        h.remove()
    for module_name, lin in linears.items():
        name = module_name + ".weight"
        v = input_subspace(seen[module_name], 8, seed=7)  # the projector's seed 0 + step 7
        torch.testing.assert_close(cov[name], exact[name] @ v @ v.T, rtol=1e-4, atol=1e-6, msg=name)
        weight_basis = lin._mecefo_projector
        assert weight_basis.source == "activation" and weight_basis.basis is None  # no SVD of W was made
        assert not torch.allclose(cov[name], exact[name], atol=1e-4), name


def test_switching_policies_keeps_each_basis(tiny_config):
    """A micro-batch under another policy (here the activation basis) does not throw away the weight
    basis: back under the first policy, no new SVD is made before tau steps."""
    model = _model(tiny_config)
    weight, activation = CoverPolicy(step=0, **LOWRANK_ONLY), CoverPolicy(step=0, basis="activation", **LOWRANK_ONLY)
    for policy in (weight, activation, weight, activation):
        _grads_under(model, make_batch(1), policy)
    for name, lin in lowrank_linears(model):
        by_source = {p.source: p for p in lin._mecefo_projectors.values()}
        assert by_source["weight"].num_refreshes == 1 and by_source["activation"].num_refreshes == 0, name


def test_basis_refreshed_every_tau_steps(tiny_config):
    model = _model(tiny_config)
    policy = dict(LOWRANK_ONLY, tau=4)
    for step in range(10):
        for micro in range(2):
            _grads_under(model, make_batch(10 * step + micro), CoverPolicy(step=step, **policy))
    for name, lin in lowrank_linears(model):
        p = lin._mecefo_projector
        assert p.num_refreshes == 3 and p.last_refresh_step == 8, name  # steps 0, 4, 8


def test_mode_is_fixed_per_microbatch_at_forward(tiny_config):
    """Forward mb1 covering, mb2 exact, then backward both (as pipeline schedules do)."""
    model = _model(tiny_config)
    b1, b2 = make_batch(4), make_batch(5)
    policy = CoverPolicy(step=0, **ALL_THREE)
    _, g1 = _grads_under(model, b1, policy)
    _, g2 = _grads_under(model, b2, None)

    model.zero_grad()
    set_covering(model, policy)
    l1 = gpt_loss(model, b1)
    set_covering(model, None)
    l2 = gpt_loss(model, b2)
    set_covering(model, policy)  # a later change must not affect the recompute of l1
    (l1 + l2).backward()
    set_covering(model, None)
    for n, p in model.named_parameters():
        expected = g2[n] if g1[n] is None else g1[n] + g2[n]
        torch.testing.assert_close(p.grad, expected, rtol=1e-5, atol=1e-7, msg=n)


def test_back_to_exact_after_covering(tiny_config):
    model = _model(tiny_config)
    batch = make_batch(6)
    _, before = _grads_under(model, batch, None)
    _grads_under(model, batch, CoverPolicy(step=0, **ALL_THREE))
    _, after = _grads_under(model, batch, None)
    for n in before:
        assert torch.equal(before[n], after[n]), n


def test_check_lowrank_rank_against_ffn_sizes(tiny_config):
    model = _model(tiny_config)
    check_lowrank_rank(model, 63)  # fc1 is 192x64, fc2 is 64x96: limit 64
    with pytest.raises(ValueError, match=r"mecefo.rank=64 is out of range for FFN weight decoder.layers.0.mlp.linear_fc1 \(local shard 192x64\)"):
        check_lowrank_rank(model, 64)
    with pytest.raises(ValueError, match="0 < mecefo.rank < min"):
        check_lowrank_rank(model, 0)
    cfg = MeCeFOConfig(enable=True, rank=80)
    with pytest.raises(ValueError, match="mecefo.rank=80"):
        check_lowrank_rank(model, cfg.rank)
