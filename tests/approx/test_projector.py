import pytest
import torch

from megatron_mecefo.approx import lowrank_linear
from megatron_mecefo.approx.projector import (LowRankProjector, input_subspace, observe_gradients, projector_for,
                                               top_right_singular_vectors)

pytestmark = pytest.mark.unit


def _decaying(out_f, in_f, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(out_f, in_f, generator=g))
    v, _ = torch.linalg.qr(torch.randn(in_f, in_f, generator=g))
    s = torch.logspace(0, -3, in_f)
    return (u * s) @ v.T


def test_exact_basis_spans_top_right_singular_vectors():
    w = torch.randn(48, 32, generator=torch.Generator().manual_seed(0))
    v = top_right_singular_vectors(w, 8, method="exact")
    _, _, vh = torch.linalg.svd(w, full_matrices=False)
    ref = vh[:8].T
    assert v.shape == (32, 8)
    torch.testing.assert_close(v @ v.T, ref @ ref.T, rtol=0, atol=1e-5)
    torch.testing.assert_close(v.T @ v, torch.eye(8), rtol=0, atol=1e-5)


def test_randomized_basis_close_to_exact_and_leaves_rng_untouched():
    w = _decaying(96, 64)
    state = torch.get_rng_state()
    v1 = top_right_singular_vectors(w, 8, method="randomized", seed=3)
    assert torch.equal(state, torch.get_rng_state()), "randomized SVD must not consume the training RNG"
    v2 = top_right_singular_vectors(w, 8, method="randomized", seed=3)
    assert torch.equal(v1, v2), "same seed, same basis on every rank"
    ref = top_right_singular_vectors(w, 8, method="exact")
    assert torch.linalg.norm(v1 @ v1.T - ref @ ref.T) / torch.linalg.norm(ref @ ref.T) < 1e-2


def test_auto_switches_on_size():
    w = _decaying(96, 64)
    exact = top_right_singular_vectors(w, 4, method="exact")
    auto_small = top_right_singular_vectors(w, 4, method="auto", exact_max_dim=64)
    torch.testing.assert_close(auto_small, exact, rtol=0, atol=0)
    auto_big = top_right_singular_vectors(w, 4, method="auto", exact_max_dim=63, seed=1)
    randomized = top_right_singular_vectors(w, 4, method="randomized", seed=1)
    assert torch.equal(auto_big, randomized)


def test_bf16_weight_gets_bf16_basis_from_fp32_svd():
    w = _decaying(64, 48).to(torch.bfloat16)
    v = top_right_singular_vectors(w, 6, method="exact")
    assert v.dtype == torch.bfloat16 and v.device == w.device
    ref = top_right_singular_vectors(w.float(), 6, method="exact")
    torch.testing.assert_close(v.float() @ v.float().T, ref @ ref.T, rtol=0, atol=2e-2)


@pytest.mark.parametrize("rank", [0, -1, 32, 40])
def test_rank_out_of_range(rank):
    with pytest.raises(ValueError, match="rank"):
        top_right_singular_vectors(torch.randn(48, 32), rank)


def test_refresh_every_tau_steps_counted():
    p = LowRankProjector(4, 3)
    w = torch.randn(16, 12)
    refreshed = [step for step in range(10) if p.maybe_refresh(w, step)]
    assert refreshed == [0, 3, 6, 9]
    assert p.num_refreshes == 4
    # several micro-batches of one step refresh once
    assert not p.maybe_refresh(w, 9) and not p.maybe_refresh(w, 10)
    # a step going backwards (reload from an older checkpoint) refreshes
    assert p.maybe_refresh(w, 5) and p.last_refresh_step == 5


def test_refresh_uses_current_weight():
    p = LowRankProjector(2, 2, svd_method="exact")
    w = _decaying(16, 12)
    p.maybe_refresh(w, 0)
    first = p.basis.clone()
    w2 = _decaying(16, 12, seed=7)
    p.maybe_refresh(w2, 1)
    assert torch.equal(p.basis, first), "not due yet"
    p.maybe_refresh(w2, 2)
    torch.testing.assert_close(p.basis @ p.basis.T, (lambda v: v @ v.T)(top_right_singular_vectors(w2, 2, method="exact")))


def test_project_and_back_shapes():
    p = LowRankProjector(4, 10)
    with pytest.raises(RuntimeError, match="before maybe_refresh"):
        p.project(torch.randn(3, 12))
    p.maybe_refresh(torch.randn(16, 12), 0)
    x = torch.randn(5, 3, 12)
    assert p.project(x).shape == (5, 3, 4)
    assert p.project_back(p.project(x)).shape == (5, 3, 12)


def test_state_dict_roundtrip_is_tensor_only():
    p = LowRankProjector(4, 10)
    p.maybe_refresh(torch.randn(16, 12), 7)
    state = p.state_dict()
    assert all(isinstance(v, torch.Tensor) for v in state.values())
    q = LowRankProjector(4, 10)
    q.load_state_dict(state)
    assert torch.equal(q.basis, p.basis) and q.last_refresh_step == 7 and q.num_refreshes == 1
    assert not q.maybe_refresh(torch.randn(16, 12), 8)
    with pytest.raises(ValueError, match="rank"):
        LowRankProjector(3, 10).load_state_dict(state)


@pytest.mark.parametrize(
    "kwargs, match",
    [(dict(rank=0, tau=1), "rank"), (dict(rank=2, tau=0), "tau"), (dict(rank=2, tau=1, svd_method="qr"), "svd_method")],
)
def test_invalid_arguments(kwargs, match):
    rank, tau = kwargs.pop("rank"), kwargs.pop("tau")
    with pytest.raises(ValueError, match=match):
        LowRankProjector(rank, tau, **kwargs)


# -- the activation basis ------------------------------------------------------------------------


def _lowrank_wgrad(x, w, projector, step=0):
    w = w.detach().clone().requires_grad_()
    projector.maybe_refresh(w, step)
    g = torch.Generator().manual_seed(9)
    gy = torch.randn(*x.shape[:-1], w.shape[0], generator=g)
    lowrank_linear(x, w, None, projector).backward(gy)
    return w.grad, gy.reshape(-1, w.shape[0]).t() @ x.reshape(-1, x.shape[-1])


def test_activation_basis_reproduces_the_gradient_of_a_low_rank_input_exactly():
    """G_W = G_y^T x has x's row space: when x has rank <= r (few tokens, or rank-deficient
    inputs) the activation basis spans it and the low-rank gradient is the exact one; W's basis is not."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(24, 32, generator=g)
    low_rank_x = (torch.randn(4, 10, 5, generator=g) @ torch.randn(5, 32, generator=g))  # 40 tokens of rank 5
    few_tokens = torch.randn(1, 6, 32, generator=g)  # 6 tokens
    for x in (low_rank_x, few_tokens):
        got, exact = _lowrank_wgrad(x, w, LowRankProjector(8, 100, basis="activation"))
        torch.testing.assert_close(got, exact, rtol=1e-4, atol=1e-4)
        by_weight, _ = _lowrank_wgrad(x, w, LowRankProjector(8, 100, basis="weight", svd_method="exact"))
        assert torch.linalg.norm(by_weight - exact) > 0.3 * torch.linalg.norm(exact)


def test_activation_basis_beats_the_weight_basis_on_an_anisotropic_input():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 64, generator=g) @ _decaying(64, 64, seed=2)  # decaying spectrum, as trained inputs have
    w = torch.randn(48, 64, generator=g)
    errors = {}
    for basis in ("weight", "activation"):
        got, exact = _lowrank_wgrad(x, w, LowRankProjector(8, 100, basis=basis, svd_method="exact"))
        errors[basis] = (torch.linalg.norm(got - exact) / torch.linalg.norm(exact)).item()
    assert errors["activation"] < 0.6 * errors["weight"], errors


def test_input_subspace_is_orthonormal_seeded_and_leaves_the_rng_untouched():
    x = torch.randn(128, 40, generator=torch.Generator().manual_seed(3))
    state = torch.get_rng_state()
    q1, q2, q3 = input_subspace(x, 6, seed=5), input_subspace(x, 6, seed=5), input_subspace(x, 6, seed=6)
    assert torch.equal(torch.get_rng_state(), state)
    assert q1.shape == (40, 6) and torch.equal(q1, q2) and not torch.equal(q1, q3)
    torch.testing.assert_close(q1.T @ q1, torch.eye(6), rtol=0, atol=1e-5)
    bf16 = input_subspace(x.bfloat16(), 6, seed=5)
    assert bf16.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="rank must satisfy"):
        input_subspace(x, 40)


def test_activation_basis_draws_per_step_and_never_refreshes_from_the_weight():
    """The draw is seeded by the step: a redone step gets the same basis, the next another."""
    x = torch.randn(3, 20, 16, generator=torch.Generator().manual_seed(4))
    w = torch.randn(12, 16)
    p = LowRankProjector(4, 1, basis="activation")
    assert not p.maybe_refresh(w, 0) and p.num_refreshes == 0 and p.basis is None
    first, again = p.basis_for(x), p.basis_for(x)
    p.maybe_refresh(w, 1)
    assert torch.equal(first, again) and not torch.equal(first, p.basis_for(x))
    with pytest.raises(ValueError, match="basis must be one of"):
        LowRankProjector(4, 1, basis="output")


# -- the gradient basis --------------------------------------------------------------------------


def test_gradient_basis_of_a_rank_r_gradient_reproduces_it_exactly():
    """V = top right singular vectors of the observed aggregate G: a micro-batch whose inputs lie in
    G's row space (as G's own micro-batches do when G has rank <= r) gets its exact gradient."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(24, 32, generator=g)
    rows = torch.randn(6, 32, generator=g)  # G's row space: rank 6 <= r = 8
    aggregate = torch.randn(24, 6, generator=g) @ rows
    p = LowRankProjector(8, 100, basis="gradient")
    assert p.observe_gradient(aggregate, 3, exact=True) and p.from_gradient
    torch.testing.assert_close(aggregate @ p.basis @ p.basis.T, aggregate, rtol=1e-4, atol=1e-4)
    x = (torch.randn(2, 10, 6, generator=g) @ rows)  # a micro-batch from the same row space
    got, exact = _lowrank_wgrad(x, w, p, step=4)
    torch.testing.assert_close(got, exact, rtol=1e-4, atol=1e-4)
    # V spans G's top right singular vectors (a full-rank G: compare with the exact SVD's)
    full = _decaying(40, 32, seed=6)
    p.observe_gradient(full, 5, exact=True)
    top = top_right_singular_vectors(full, 8, method="exact")
    assert torch.linalg.norm(top.T @ p.basis @ p.basis.T @ top - torch.eye(8)) < 1e-2
    by_weight, _ = _lowrank_wgrad(x, w, LowRankProjector(8, 100, basis="weight", svd_method="exact"))
    assert torch.linalg.norm(by_weight - exact) > 0.3 * torch.linalg.norm(exact)


def test_gradient_basis_refresh_rules():
    """W's basis until a gradient is seen; an exact step's gradient always replaces V; during
    covering (inexact aggregates) only every tau steps; a step that went back (a reload) falls back to W."""
    w, gen = torch.randn(20, 16), torch.Generator().manual_seed(7)
    grads = [torch.randn(20, 16, generator=gen) for _ in range(4)]
    p = LowRankProjector(4, 3, basis="gradient", svd_method="exact")
    assert p.maybe_refresh(w, 0) and not p.from_gradient
    torch.testing.assert_close(p.basis, top_right_singular_vectors(w, 4, method="exact"))
    state = torch.get_rng_state()
    assert p.observe_gradient(grads[0], 1, exact=True) and p.from_gradient
    assert torch.equal(torch.get_rng_state(), state), "the randomized SVD draws from a private stream"
    v1 = p.basis.clone()
    assert not p.maybe_refresh(w, 2) and torch.equal(p.basis, v1), "covering keeps the gradient's basis"
    assert not p.observe_gradient(grads[1], 2, exact=False) and torch.equal(p.basis, v1)
    assert not p.observe_gradient(grads[1], 3, exact=False)
    assert p.observe_gradient(grads[2], 4, exact=False), "tau = 3 steps since step 1"
    assert p.observe_gradient(grads[3], 5, exact=True)
    assert p.maybe_refresh(w, 2) and not p.from_gradient, "a reload to an earlier step"
    assert not LowRankProjector(4, 3, basis="weight").observe_gradient(grads[0], 1, exact=True)


def test_observe_gradients_finds_the_marked_linears_and_reads_the_hosts_gradient():
    class Marked(torch.nn.Linear):
        mecefo_lowrank = True

    from megatron_mecefo.approx import CoverPolicy

    model = torch.nn.Sequential(Marked(16, 12), torch.nn.Linear(12, 12), Marked(12, 16))
    for m in model:
        m.weight.main_grad = torch.randn_like(m.weight)
    policy = CoverPolicy(step=7, rank=4, tau=10, basis="gradient")
    assert observe_gradients(model, policy, 7, exact=True) == 0, "no .grad yet"
    assert observe_gradients(model, policy, 7, exact=True, grad_attr="main_grad") == 2
    for m in (model[0], model[2]):
        p = projector_for(m, policy)
        assert p.from_gradient and p.last_refresh_step == 7 and p.basis.shape == (m.in_features, 4)
    assert not hasattr(model[1], "_mecefo_projectors")
    weight_policy = CoverPolicy(step=7, rank=4, tau=10)
    assert observe_gradients(model, weight_policy, 7, exact=True, grad_attr="main_grad") == 0


def test_the_runtime_refuses_the_gradient_basis_with_a_sharded_optimizer():
    """A sharded optimizer reduces each rank's range only: no rank holds a whole aggregated gradient."""
    from megatron_mecefo.config import LaunchEnv, MeCeFOConfig
    from megatron_mecefo.elastic.runtime import ElasticRuntime

    with pytest.raises(ValueError, match='"basis": "gradient" needs every weight\'s aggregated gradient'):
        job = LaunchEnv(rank=0, world=2, local_rank=0, master_addr="127.0.0.1", master_port=1, incarnation=0,
                        mecefo_launcher=False)
        ElasticRuntime(MeCeFOConfig(enable=True, basis="gradient"), job, sharding=object())  # before the store
