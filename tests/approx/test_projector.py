import pytest
import torch

from megatron_mecefo.approx.projector import LowRankProjector, top_right_singular_vectors

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
