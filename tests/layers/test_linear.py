"""Low-rank Column/RowParallelLinear honour Megatron's main_grad (gradient-accumulation-fusion) contract."""

import pytest
import torch

from megatron_mecefo.approx import CoverPolicy, activate
from megatron_mecefo.layers import LowRankColumnParallelLinear, LowRankRowParallelLinear
from megatron_mecefo.layers.model import llama_config
from tests.helpers import TINY

POLICY = CoverPolicy(step=0, rank=4)


def _linear(cls, config):
    torch.manual_seed(0)
    kwargs = dict(config=config, init_method=torch.nn.init.xavier_normal_, bias=False)
    if cls is LowRankColumnParallelLinear:
        return cls(32, 24, gather_output=False, skip_bias_add=False, **kwargs)
    return cls(24, 32, input_is_parallel=True, skip_bias_add=True, **kwargs)


def _exact_dw(lin, x, gy):
    lin.weight.grad = None
    out = lin(x)[0]
    out.backward(gy)
    dw = lin.weight.grad.clone()
    lin.weight.grad = None
    return dw


@pytest.mark.parametrize("cls", [LowRankColumnParallelLinear, LowRankRowParallelLinear])
@pytest.mark.parametrize("megatron_ddp", [True, False], ids=["grad_added_to_main_grad", "plain_main_grad"])
def test_main_grad_accumulation(megatron_world, cls, megatron_ddp):
    lin = _linear(cls, llama_config(**TINY))
    in_f = lin.weight.shape[1]
    x = torch.randn(6, 2, in_f)
    gy = torch.randn(6, 2, lin.weight.shape[0])
    exact = _exact_dw(lin, x, gy)

    # what Megatron DDP sets up, then the fused path's flag (set after construction: no CUDA kernel here)
    lin.weight.main_grad = torch.zeros_like(lin.weight, dtype=torch.float32)
    if megatron_ddp:
        lin.weight.grad_added_to_main_grad = False
    lin.gradient_accumulation_fusion = True
    for micro in range(2):
        with activate(POLICY):
            out = lin(x)[0]
        out.backward(gy)
    v = lin._mecefo_projector.basis
    torch.testing.assert_close(lin.weight.main_grad, 2 * exact @ v @ v.T, rtol=1e-5, atol=1e-6)
    if megatron_ddp:
        assert lin.weight.grad_added_to_main_grad is True
        assert lin.weight.grad is not None and lin.weight.grad.shape == lin.weight.shape  # dummy, as upstream
    else:
        assert lin.weight.grad is None


@pytest.mark.parametrize("cls", [LowRankColumnParallelLinear, LowRankRowParallelLinear])
def test_exact_when_no_policy_or_lowrank_off(megatron_world, cls):
    lin = _linear(cls, llama_config(**TINY))
    x = torch.randn(6, 2, lin.weight.shape[1])
    gy = torch.randn(6, 2, lin.weight.shape[0])
    exact = _exact_dw(lin, x, gy)
    with activate(CoverPolicy(step=0, lowrank_ffn=False)):
        got = _exact_dw(lin, x, gy)
    assert torch.equal(exact, got)
    assert lin._mecefo_projector is None
