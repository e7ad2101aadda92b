import pytest
import torch

from megatron_mecefo.approx import (
    CoverPolicy,
    Coverable,
    active_policy,
    covering,
    forward_with_residual_grad,
    recompute,
    set_covering,
)
from megatron_mecefo.approx.memory import SavedTensorMeter

pytestmark = pytest.mark.unit


class Block(torch.nn.Module):
    """h = x + branch(norm(x)); branch has a nonlinearity so it saves activations."""

    def __init__(self, d=8):
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.lin1 = torch.nn.Linear(d, 2 * d)
        self.lin2 = torch.nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.lin2(torch.tanh(self.lin1(self.norm(x)))), "context"


def test_skip_forward_value_identical_and_gradient_identity():
    torch.manual_seed(0)
    block = Block()
    x = torch.randn(4, 3, 8, requires_grad=True)
    exact, _ = block(x)
    with SavedTensorMeter(exclude=block.parameters()) as meter:
        out, ctx = forward_with_residual_grad(block, x)
    assert ctx == "context"
    assert torch.equal(out, exact)
    assert meter.total == 0, "no activations of the branch are kept"
    g = torch.randn_like(out)
    out.backward(g)
    assert torch.equal(x.grad, g), "dL/dx = dL/dh"
    assert all(p.grad is None for p in block.parameters())


def test_skip_without_grad_is_plain_forward():
    block = Block()
    x = torch.randn(2, 8)
    out, _ = forward_with_residual_grad(block, x)
    assert not out.requires_grad


def test_recompute_identical_gradients_with_dropout_and_saves_only_input():
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Dropout(0.5), torch.nn.Linear(32, 8))
    x = torch.randn(16, 8, requires_grad=True)

    torch.manual_seed(5)
    mlp(x).square().sum().backward()
    ref = [p.grad.clone() for p in mlp.parameters()] + [x.grad.clone()]
    mlp.zero_grad()
    x.grad = None

    torch.manual_seed(5)
    with SavedTensorMeter(exclude=mlp.parameters()) as meter:
        y = recompute(mlp, x)
    y.square().sum().backward()
    got = [p.grad for p in mlp.parameters()] + [x.grad]
    for a, b in zip(ref, got):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert meter.shapes == [(16, 8)], "only the block input is kept"


def test_recompute_reactivates_policy_in_backward():
    policy = CoverPolicy(step=3)
    seen = []

    def fn(x):
        seen.append(active_policy())
        return torch.sin(x)

    x = torch.randn(4, requires_grad=True)
    y = recompute(fn, x, policy=policy)
    assert active_policy() is None
    y.sum().backward()
    assert seen == [policy, policy], "forward and its rerun in backward see the same policy"


class Leaf(torch.nn.Module, Coverable):
    pass


def test_set_covering_and_context_manager():
    model = torch.nn.Sequential(Leaf(), torch.nn.Linear(2, 2), Leaf())
    policy = CoverPolicy(step=0)
    assert set_covering(model, policy) == 2
    assert all(m.mecefo_policy is policy for m in model if isinstance(m, Leaf))
    set_covering(model, None)
    with covering(model, policy):
        assert model[0].mecefo_policy is policy
    assert model[0].mecefo_policy is None and model[2].mecefo_policy is None


def test_set_covering_without_mecefo_layers_is_an_error():
    with pytest.raises(ValueError, match="get_gpt_layer_mecefo_spec"):
        set_covering(torch.nn.Linear(2, 2), CoverPolicy(step=0))
    assert set_covering(torch.nn.Linear(2, 2), None) == 0


@pytest.mark.parametrize("kwargs", [dict(rank=0), dict(tau=0), dict(svd_method="lanczos")])
def test_cover_policy_validates(kwargs):
    with pytest.raises(ValueError):
        CoverPolicy(step=0, **kwargs)
