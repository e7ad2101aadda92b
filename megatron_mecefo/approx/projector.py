"""LowRankProjector: the basis V of MeCeFO's low-rank weight gradient (MeCeFO §3.3).

For a linear map y = x W^T with W of shape (out, in), the weight gradient G_W = G_y^T x is
approximated by (G_y^T (x V)) V^T = G_W V V^T, the exact gradient projected onto the input
directions V (in, r). Three sources of V (`basis`):

* "weight" (the paper): the top-r right singular vectors of W itself, recomputed every `tau` steps.
* "activation": the dominant directions of the micro-batch's own input x (tokens, in), found per
  micro-batch by a randomized range finder. G_W's rows are combinations of x's rows, so this is
  the subspace that matters; on a trained model its error is 2-3x lower than W's at the same r
  (benchmarks/lowrank_basis.py). Costs about 3 x tokens x in x r multiply-adds per micro-batch.
* "gradient": the top-r right singular vectors of W's aggregated gradient, which every rank holds
  after the all-reduce. The step driver shows each projector that gradient after every committed
  step (`observe_gradient`): a step without covering anywhere (exact) always refreshes V, so a rank
  that starts covering projects on the last exact step's gradient; a step with covering refreshes
  it only every `tau` steps (its gradient is partly projected on V already). A randomized SVD
  (q = r + 8, one power iteration: about 4 x out x in x q multiply-adds per FFN weight) per exact
  step, so this basis costs a little on healthy steps too. Until a gradient has been seen (start of
  training, a rank that rejoined) W's basis stands in.

The projector owns V and when to recompute it. It knows nothing of autograd (see lowrank_grad.py)
or of distribution: under tensor parallelism each rank projects with a basis of its own shard's
input (row-parallel) or of the full input (column-parallel), with no communication.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch

from megatron_mecefo.approx.mode import BASES, SVD_METHODS

__all__ = ["BASES", "LowRankProjector", "check_rank", "input_subspace", "observe_gradients", "projector_for",
           "top_right_singular_vectors"]


def top_right_singular_vectors(
    weight: torch.Tensor,
    rank: int,
    *,
    method: str = "auto",
    exact_max_dim: int = 4096,
    oversample: int = 8,
    niter: int = 2,
    seed: int = 0,
) -> torch.Tensor:
    """Top-`rank` right singular vectors of a 2-D `weight` (out, in), as an (in, rank) matrix.

    The decomposition runs in fp32 (bf16/fp16 SVD is unsupported or inaccurate) and the result is
    cast back to `weight`'s dtype, on `weight`'s device. The randomized method draws from a private,
    seeded RNG stream, so it neither perturbs the training RNG (dropout) nor differs between ranks
    holding the same weight.
    """
    if weight.dim() != 2:
        raise ValueError(f"expected a 2-D weight, got shape {tuple(weight.shape)}")
    if not 0 < rank < min(weight.shape):
        raise ValueError(
            f"rank must satisfy 0 < rank < min(out, in) = {min(weight.shape)} for a weight of shape "
            f"{tuple(weight.shape)}; got rank={rank}"
        )
    w = weight.detach().float()
    use_exact = method == "exact" or (method == "auto" and min(w.shape) <= exact_max_dim)
    if use_exact:
        _, _, vh = torch.linalg.svd(w, full_matrices=False)  # vh: (k, in)
        v = vh[:rank].T
    else:
        q = min(rank + oversample, min(w.shape))
        devices = [w.device] if w.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            _, _, v = torch.svd_lowrank(w, q=q, niter=niter)  # v: (in, q)
        v = v[:, :rank]
    return v.to(dtype=weight.dtype).contiguous()


@torch.no_grad()
def input_subspace(x: torch.Tensor, rank: int, *, niter: int = 1, seed: int = 0) -> torch.Tensor:
    """An orthonormal (in, rank) basis of the dominant row directions of `x` (..., in).

    A randomized range finder on x^T (Halko, Martinsson & Tropp 2011, Alg. 4.4): Q = orth(x^T Omega)
    for a Gaussian Omega (tokens, rank), then `niter` power iterations Q = orth(x^T (x Q)). With
    tokens <= rank, Q spans every row of x, so G_y^T x is reproduced exactly. Runs in fp32 and is
    cast back to x's dtype; Omega comes from a private generator seeded with `seed`, so the training
    RNG is untouched and a redone step draws the same basis.
    """
    x2 = x.detach().reshape(-1, x.shape[-1]).float()
    if not 0 < rank < x2.shape[1]:
        raise ValueError(f"rank must satisfy 0 < rank < in = {x2.shape[1]}; got rank={rank}")
    gen = torch.Generator(device=x2.device).manual_seed(seed)
    omega = torch.randn((x2.shape[0], rank), generator=gen, device=x2.device)
    q, _ = torch.linalg.qr(x2.t() @ omega)
    for _ in range(niter):
        q, _ = torch.linalg.qr(x2.t() @ (x2 @ q))
    return q.to(x.dtype).contiguous()


class LowRankProjector:
    """Owns V (in, r) for one weight: W's basis refreshed every `tau` steps, the input's basis
    drawn per micro-batch (`basis="activation"`), or the aggregated gradient's (`basis="gradient"`).

    Args:
        rank: r, the number of directions kept.
        tau: refresh period of the weight basis in optimizer steps (also computed on first use).
        svd_method: 'exact', 'randomized' or 'auto' (exact when min(out, in) <= exact_max_dim).
        exact_max_dim: threshold of 'auto'.
        seed: seed of the randomized SVD's (and the range finder's) private RNG stream.
        basis: "weight", "activation" or "gradient" (see the module docstring).
        niter: power iterations of the activation basis's range finder.
    """

    def __init__(
        self,
        rank: int,
        tau: int,
        *,
        svd_method: str = "auto",
        exact_max_dim: int = 4096,
        seed: int = 0,
        basis: str = "weight",
        niter: int = 1,
    ) -> None:
        if not isinstance(rank, int) or rank <= 0:
            raise ValueError(f"LowRankProjector: rank must be a positive int, got {rank!r}")
        if not isinstance(tau, int) or tau <= 0:
            raise ValueError(f"LowRankProjector: tau must be a positive int, got {tau!r}")
        if svd_method not in SVD_METHODS:
            raise ValueError(f"LowRankProjector: svd_method must be one of {SVD_METHODS}, got {svd_method!r}")
        if basis not in BASES:
            raise ValueError(f"LowRankProjector: basis must be one of {BASES}, got {basis!r}")
        self.rank = rank
        self.tau = tau
        self.source = basis
        self.niter = niter
        self.step = 0
        self.svd_method = svd_method
        self.exact_max_dim = exact_max_dim
        self.seed = seed
        self.basis: Optional[torch.Tensor] = None  # V: (in, r)
        self.last_refresh_step: Optional[int] = None
        self.num_refreshes = 0
        self.from_gradient = False
        """True when V comes from an observed gradient (basis "gradient"); False: from W."""

    def needs_refresh(self, step: int) -> bool:
        """True when no basis exists, `tau` steps have passed, or the step went backwards (reload)."""
        if self.basis is None or self.last_refresh_step is None:
            return True
        return step < self.last_refresh_step or step - self.last_refresh_step >= self.tau

    @torch.no_grad()
    def maybe_refresh(self, weight: torch.Tensor, step: int) -> bool:
        """Recompute V from `weight` if due at `step` (weight basis; the activation basis only
        notes the step, which seeds its draw; the gradient basis uses W's only until it has seen a
        gradient). Returns True when it was recomputed."""
        self.step = step
        if self.source == "activation" or (self.from_gradient and step >= self.last_refresh_step):
            return False
        if not self.needs_refresh(step):
            return False
        self.from_gradient = False
        self.basis = top_right_singular_vectors(
            weight,
            self.rank,
            method=self.svd_method,
            exact_max_dim=self.exact_max_dim,
            seed=self.seed + step,
        )
        self.last_refresh_step = step
        self.num_refreshes += 1
        return True

    @torch.no_grad()
    def observe_gradient(self, grad: torch.Tensor, step: int, *, exact: bool) -> bool:
        """Show the gradient basis W's aggregated gradient `grad` (out, in) of committed step `step`
        (`exact`: no micro-batch of the job ran in covering mode). Returns True when V was recomputed."""
        if self.source != "gradient":
            return False
        if not exact and self.from_gradient and step - self.last_refresh_step < self.tau:
            return False
        g = grad.detach().float()
        q = min(self.rank + 8, min(g.shape))  # check_rank: rank < min(out, in)
        devices = [g.device] if g.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):  # the training RNG is untouched
            torch.manual_seed(self.seed + step)
            _, _, v = torch.svd_lowrank(g, q=q, niter=1)
        self.basis = v[:, :self.rank].to(grad.dtype).contiguous()
        self.last_refresh_step = step
        self.from_gradient = True
        self.num_refreshes += 1
        return True

    def basis_for(self, x: torch.Tensor) -> torch.Tensor:
        """V for a micro-batch whose input is `x`: W's current basis, or x's own (activation)."""
        if self.source == "activation":
            return input_subspace(x, self.rank, niter=self.niter, seed=self.seed + self.step)
        return self._require_basis()

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in) -> x V (..., r)."""
        return torch.matmul(x, self._require_basis())

    def project_back(self, g: torch.Tensor) -> torch.Tensor:
        """g (..., r) -> g V^T (..., in)."""
        return torch.matmul(g, self._require_basis().T)

    def _require_basis(self) -> torch.Tensor:
        if self.basis is None:
            raise RuntimeError("LowRankProjector used before maybe_refresh() computed its basis")
        return self.basis

    def state_dict(self) -> Dict[str, torch.Tensor]:
        """Tensor-only state (safe for torch.save / distributed checkpoint)."""
        state = {"num_refreshes": torch.tensor(self.num_refreshes), "from_gradient": torch.tensor(self.from_gradient)}
        if self.basis is not None:
            state["basis"] = self.basis
            state["last_refresh_step"] = torch.tensor(self.last_refresh_step)
        return state

    def load_state_dict(self, state: Dict[str, torch.Tensor]) -> None:
        self.num_refreshes = int(state["num_refreshes"])
        self.from_gradient = bool(state.get("from_gradient", False))
        if "basis" in state:
            basis = state["basis"]
            if basis.dim() != 2 or basis.shape[1] != self.rank:
                raise ValueError(f"basis of shape {tuple(basis.shape)} does not match rank {self.rank}")
            self.basis = basis
            self.last_refresh_step = int(state["last_refresh_step"])
        else:
            self.basis = None
            self.last_refresh_step = None


def projector_for(owner, policy) -> LowRankProjector:
    """The projector cached on `owner` (a linear layer) for `policy`'s settings, made on first use.
    One per settings, so micro-batches under different policies (a benchmark's cases, a changed
    configuration) do not throw away each other's bases; `owner._mecefo_projector` is the last used."""
    key = (policy.rank, policy.tau, policy.svd_method, policy.svd_exact_max_dim, policy.basis)
    cache = owner.__dict__.setdefault("_mecefo_projectors", {})
    p = cache.get(key)
    if p is None:
        p = cache[key] = LowRankProjector(policy.rank, policy.tau, svd_method=policy.svd_method,
                                          exact_max_dim=policy.svd_exact_max_dim, basis=policy.basis)
    owner._mecefo_projector = p
    return p


@torch.no_grad()
def observe_gradients(module: torch.nn.Module, policy, step: int, *, exact: bool, grad_attr: str = "grad") -> int:
    """Show the "gradient" projector of every low-rank linear in `module` (a module whose class sets
    `mecefo_lowrank = True`) its weight's aggregated gradient of committed step `step`, read from
    `weight.<grad_attr>`. A no-op for the other bases. Returns how many bases were recomputed."""
    if policy.basis != "gradient":
        return 0
    done = 0
    for m in module.modules():
        grad = getattr(m.weight, grad_attr, None) if getattr(type(m), "mecefo_lowrank", False) else None
        if grad is not None:
            done += projector_for(m, policy).observe_gradient(grad, step, exact=exact)
    return done


def check_rank(rank: int, weights, *, key: str = "mecefo.rank") -> None:
    """Raise ValueError unless 0 < rank < min(out, in) of every (name, weight) in `weights` (local
    shards). Call before training so a bad rank fails at start-up rather than at the first failure."""
    for name, weight in weights:
        out_f, in_f = weight.shape
        limit = min(out_f, in_f)
        if not 0 < rank < limit:
            raise ValueError(
                f"{key}={rank} is out of range for FFN weight {name} (local shard {out_f}x{in_f}): "
                f"it must satisfy 0 < {key} < min(out, in) = {limit}"
            )
