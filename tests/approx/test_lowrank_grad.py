import pytest
import torch

from megatron_mecefo.approx import LowRankProjector, lowrank_linear
from megatron_mecefo.approx.lowrank_grad import LowRankWeightGradLinear
from megatron_mecefo.approx.memory import SavedTensorMeter

pytestmark = pytest.mark.unit


def _setup(dtype=torch.float32, tokens=(3, 5), out_f=12, in_f=10, rank=4, seed=0):
    rank = min(rank, min(out_f, in_f) - 1)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*tokens, in_f, generator=g, dtype=dtype, requires_grad=True)
    w = torch.randn(out_f, in_f, generator=g, dtype=dtype, requires_grad=True)
    b = torch.randn(out_f, generator=g, dtype=dtype, requires_grad=True)
    gy = torch.randn(*tokens, out_f, generator=g, dtype=dtype)
    p = LowRankProjector(rank, 100, svd_method="exact")
    p.maybe_refresh(w, 0)
    return x, w, b, gy, p


def _exact(x, w, b, gy):
    x2, w2, b2 = (t.detach().clone().requires_grad_() for t in (x, w, b))
    (torch.matmul(x2, w2.t()) + b2).backward(gy)
    return x2.grad, w2.grad, b2.grad


def test_forward_is_exact():
    x, w, b, _, p = _setup()
    torch.testing.assert_close(lowrank_linear(x, w, b, p), torch.matmul(x, w.t()) + b, rtol=0, atol=0)


def test_weight_grad_equals_formula_and_projected_exact_grad():
    x, w, b, gy, p = _setup()
    lowrank_linear(x, w, b, p).backward(gy)
    gx, gw, gb = _exact(x, w, b, gy)
    v = p.basis
    formula = (gy.reshape(-1, 12).t() @ (x.detach().reshape(-1, 10) @ v)) @ v.t()
    torch.testing.assert_close(w.grad, formula, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(w.grad, gw @ v @ v.t(), rtol=1e-5, atol=1e-5)
    # input and bias gradients stay exact
    torch.testing.assert_close(x.grad, gx, rtol=0, atol=0)
    torch.testing.assert_close(b.grad, gb, rtol=1e-6, atol=1e-6)
    assert torch.linalg.norm(w.grad - gw) > 1e-3, "rank 4 < 10 must actually approximate"


def test_full_rank_basis_gives_exact_weight_grad():
    x, w, b, gy, _ = _setup(in_f=10, out_f=12)
    q, _ = torch.linalg.qr(torch.randn(10, 10, dtype=torch.float32))  # orthogonal: V V^T = I
    LowRankWeightGradLinear.apply(x, w, b, q, None).backward(gy)
    _, gw, _ = _exact(x, w, b, gy)
    torch.testing.assert_close(w.grad, gw, rtol=1e-5, atol=1e-5)


def test_gradcheck_float64():
    x, w, b, _, _ = _setup(dtype=torch.float64, tokens=(2, 3), out_f=5, in_f=4)
    q, _ = torch.linalg.qr(torch.randn(4, 4, dtype=torch.float64))
    assert torch.autograd.gradcheck(lambda x, w, b: LowRankWeightGradLinear.apply(x, w, b, q, None), (x, w, b))
    # with a rank-2 basis the input and bias gradients are still exact
    v = q[:, :2].contiguous()
    wd = w.detach()
    assert torch.autograd.gradcheck(lambda x, b: LowRankWeightGradLinear.apply(x, wd, b, v, None), (x, b))


def test_saves_projected_input_not_input():
    x, w, b, gy, p = _setup(tokens=(6, 7), in_f=10, rank=3)
    with SavedTensorMeter(exclude=[w, b]) as meter:
        lowrank_linear(x, w, b, p)
    assert (6, 7, 10) not in meter.shapes
    assert (6, 7, 3) in meter.shapes


def test_wgrad_hook_receives_grad_and_decides_what_autograd_gets():
    x, w, b, gy, p = _setup()
    seen = []

    def hook(gw):
        seen.append(gw.clone())
        return None

    lowrank_linear(x, w, b, p, wgrad_hook=hook).backward(gy)
    assert len(seen) == 1 and seen[0].shape == w.shape
    assert w.grad is None
    assert x.grad is not None


def test_basis_row_mismatch_raises():
    x, w, b, _, _ = _setup(in_f=10)
    p = LowRankProjector(2, 5)
    p.maybe_refresh(torch.randn(8, 6), 0)
    with pytest.raises(ValueError, match="input features"):
        lowrank_linear(x, w, b, p)


def test_bf16_runs_and_keeps_dtype():
    x, w, b, gy, p = _setup(dtype=torch.bfloat16)
    y = lowrank_linear(x, w, b, p)
    y.backward(gy)
    assert y.dtype == w.grad.dtype == x.grad.dtype == torch.bfloat16
