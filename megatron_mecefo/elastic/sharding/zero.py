"""ZeRO-1 over MeCeFO's live replicas: one torch optimizer's state sharded over a position's
data-parallel group, each shard also held (current at every step) by the replica that covers its
owner, and re-sharded from those holders when the generation changes.

    sharded = ShardedOptimizer(engine_optimizer)    # the innermost torch optimizer; its `step` is replaced
    attach(..., sharding=sharded)                   # the runtime re-shards at every new generation (elastic/attach.py)

The flat range [0, numel) is the optimizer's parameters in param-group order; shards.py lays it out.
A rank keeps, for its shard and its copy, the optimizer's per-element state (AdamW: exp_avg,
exp_avg_sq), driven by an optimizer of the host's class over views of the optimizer's own fp32
parameters in that range (the model's, or a mixed-precision wrapper's fp32 copies: every rank has
them whole, so no second master is kept) and of the state, with the host's hyperparameters (the
learning-rate schedule, weight-decay groups) copied in every step.

Per step (after the runtime reduce-scattered the gradients, shard_grads.py: a rank holds the reduced
gradient of its shard and of its copy):
- the owner updates its shard and the copy holder the copy, from the same gradient and state:
  bit-identical (a second update of 1/D of the parameters);
- the updated shards are all-gathered (each rank receives (D-1)/D of the parameters).
Knows tensors and a group, not the protocol: the runtime re-shards it (`resharding`: regroup /
install, reshard.py) and reads `gather_error` after the optimizer step; the step's reduction
(reduction.py) reduce-scatters into it; checkpoints are `files` (files.py).

The gather runs after the commit. If a peer dies in it, the step stands (every holder of every range
took it): `gather_error` is set and the runtime regroups at once; `regroup` re-sends every range's
parameters from a surviving holder, so no rank trains on a half-gathered model.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from megatron_mecefo.elastic.sharding.files import ShardFiles
from megatron_mecefo.elastic.sharding.reshard import Resharding, ShardLost
from megatron_mecefo.elastic.sharding.shards import Reshard, ShardLayout
from megatron_mecefo.elastic.sharding.state_source import StateSource

__all__ = ["ShardedOptimizer", "ShardLost", "innermost_optimizer"]


def innermost_optimizer(optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside a host's wrappers (DeepSpeed's and Megatron's keep it in `.optimizer`)."""
    seen = optimizer
    while not isinstance(seen, torch.optim.Optimizer):
        chained = getattr(seen, "chained_optimizers", None)  # Megatron-Core's ChainedOptimizer
        if chained is not None:
            if len(chained) != 1:
                raise ValueError(f"the sharded optimizer needs one optimizer; the host chains {len(chained)}")
            seen = chained[0]
        elif getattr(seen, "optimizer", None) is not None:
            seen = seen.optimizer
        else:
            break
    if not isinstance(seen, torch.optim.Optimizer):
        raise ValueError(f"the sharded optimizer needs a torch.optim.Optimizer inside the host's; found {type(optimizer).__name__}")
    return seen


def _probe(optimizer: torch.optim.Optimizer) -> Tuple[List[str], Dict[str, torch.Tensor]]:
    """The optimizer class's state after one step on a 1-element parameter: its per-element keys
    (sharded) and its scalar keys with their fresh values (AdamW: "step")."""
    p = torch.nn.Parameter(torch.zeros(1))
    hyper = {k: v for k, v in optimizer.param_groups[0].items() if k not in ("params", "initial_lr")}
    probe = type(optimizer)([{"params": [p], **hyper}])
    p.grad = torch.zeros(1)
    probe.step()
    state = probe.state[p]
    elementwise = sorted(k for k, v in state.items() if torch.is_tensor(v) and v.shape == p.shape)
    scalars = {k: torch.zeros_like(v) for k, v in state.items() if torch.is_tensor(v) and v.shape != p.shape}
    return elementwise, scalars


@dataclasses.dataclass
class _Held:
    """One held range: its per-element state, and the optimizer over views of it and of the
    optimizer's parameters in the range.

    The optimizer's scalars (AdamW: "step") are per segment: a range rebuilt after a loss
    (`on_shard_loss: "reinit"`) restarts at step 0 while the rest of the range goes on."""

    start: int
    end: int
    state: Dict[str, torch.Tensor]
    scalars: Dict[str, torch.Tensor]
    """Per element while the range is being filled (a re-shard); `_bind` makes segments of them."""
    parts: List[Tuple[torch.nn.Parameter, int, int, int]] = dataclasses.field(default_factory=list)
    """(the inner optimizer's parameter: a view of one host parameter's slice, host param group,
    flat start, flat end)."""
    hosts: List[int] = dataclasses.field(default_factory=list)
    """The host param group of each of the inner optimizer's param groups."""
    inner: Optional[torch.optim.Optimizer] = None

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state.values())


class ShardedOptimizer:
    """ZeRO-1 for `optimizer` (see the module docstring). Replaces `optimizer.step`."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, neighbour_copy: bool = True, tag: str = "t0p0",
                 on_loss: str = "give_up", on_parameters: Optional[Callable[[], None]] = None,
                 grad_attr: str = "grad") -> None:
        if on_loss not in ("give_up", "reinit"):
            raise ValueError(f"on_loss must be give_up or reinit, got {on_loss!r}")
        self.optimizer = optimizer
        self.on_loss = on_loss
        """A range with no live holder: "give_up" (ShardLost) or "reinit" (its moments and step restart)."""
        self.tag = tag
        """The (tp, pp) position whose state this is (in the shard files' names)."""
        self.neighbour_copy = neighbour_copy
        self.on_parameters = on_parameters
        self.grad_attr = grad_attr
        """Where the optimizer parameters' gradients are (Megatron keeps a bf16 parameter's fp32
        gradient in `main_grad`, which `.grad` of another dtype cannot hold)."""
        """Runs after a re-shard re-sent the parameters (a host keeping lower-precision copies of the
        optimizer's fp32 parameters refreshes them: Megatron's main-to-model copy)."""
        self.params: List[torch.Tensor] = []
        self.group_bounds: List[Tuple[int, int]] = []
        self.offsets: List[int] = []
        n = 0
        for group in optimizer.param_groups:
            lo = n
            for p in group["params"]:
                self.params.append(p)
                self.offsets.append(n)
                n += p.numel()
            self.group_bounds.append((lo, n))
        self.numel = n
        self.sources: List[torch.Tensor] = list(self.params)
        """The host parameters whose gradients the runtime reduces, one per optimizer parameter (the
        same tensors, or the model parameters of a mixed-precision wrapper's fp32 copies)."""
        self.grad_scale = 1.0
        """A factor the next step applies to the gradients as it reads them (in fp32): a host's clip
        coefficient where its gradients are of lower precision (scaling them in place would round)."""
        self.grad_sq: Optional[Dict[int, float]] = None
        """id(source or optimizer parameter) -> the squared norm of its reduced gradient in the last
        reduce-scatter (shard_grads.py); None after an all-reduce."""
        self.masters = any(p.dtype != torch.float32 for p in self.params)
        """The optimizer's parameters are of lower precision (a bf16 model with no fp32 copies): the
        held ranges keep fp32 masters, per-element state like the moments ("master")."""
        self.opt_keys, self.fresh_scalars = _probe(optimizer)
        self.keys = self.opt_keys + (["master"] if self.masters else [])
        """The per-element state of a held range: the optimizer's, and the master."""
        self.layout: Optional[ShardLayout] = None
        """The layout this rank's state is in (None: the whole state, before the first generation)."""
        self.replica: Optional[int] = None
        self.held: Dict[str, _Held] = {}
        self.group = None
        self._group_replicas: List[int] = []
        self._source: Optional[StateSource] = None  # a checkpoint's state to start from (--load)
        self.gather_error: Optional[BaseException] = None
        self.last_reshard: Optional[Reshard] = None
        self.resharding = Resharding(self)
        """A new generation: `regroup` builds the held ranges aside, `install` makes them current."""
        self.files = ShardFiles(self)
        """Checkpoints: one file per held range, written by its holder (`save`, `collect`)."""
        optimizer.step = self.step  # the host's wrappers (clipping, scheduler, counters) stay as they are

    @classmethod
    def for_job(cls, optimizer, cfg, job, *, tensor_parallel: int, pipeline_parallel: int,
                on_parameters: Optional[Callable[[], None]] = None,
                sources: Optional[Dict[int, torch.Tensor]] = None, grad_attr: str = "grad") -> "ShardedOptimizer":
        """The sharded state of the torch optimizer inside a host's `optimizer` (DeepSpeed's engine,
        Megatron's wrappers) for this rank's (tp, pp) position of `job` (a LaunchEnv), as the
        MeCeFOConfig `cfg` asks (shard_redundancy, on_shard_loss). `sources`: id(optimizer
        parameter) -> the host parameter holding its gradient, where they differ."""
        from megatron_mecefo.elastic.plan.topology import Grid

        tp, pp = Grid(tp=tensor_parallel, pp=pipeline_parallel,
                      dp=job.world // (tensor_parallel * pipeline_parallel)).position(job.rank)
        out = cls(innermost_optimizer(optimizer), tag=f"t{tp}p{pp}", neighbour_copy=cfg.shard_redundancy == "neighbour",
                  on_loss=cfg.on_shard_loss, on_parameters=on_parameters, grad_attr=grad_attr)
        if sources:
            out.sources = [sources.get(id(p), p) for p in out.params]
        return out

    # -- the gradients of a sharded step (shard_grads.py reduce-scatters them) ----------------------

    @property
    def group_replicas(self) -> List[int]:
        """The replica of each member of the installed generation's group, in the group's order."""
        return list(self._group_replicas)

    def reduces(self, params: Sequence[torch.Tensor]) -> bool:
        """Whether the gradients of `params` (what the runtime reduces) are exactly the sources':
        then they are reduce-scattered, else all-reduced."""
        return (self.layout is not None and len(params) == len(self.sources)
                and {id(p) for p in params} == {id(s) for s in self.sources}
                and all(s.numel() == p.numel() for s, p in zip(self.sources, self.params)))

    def read_sources(self, start: int, end: int, attr: str, out: torch.Tensor) -> None:
        for p, sl, at in self._spans(start, end, self.sources):
            g = getattr(p, attr, None)
            if g is not None:
                out[at:at + sl.stop - sl.start] = g.reshape(-1)[sl]

    def scale_by_source(self, start: int, end: int, values: torch.Tensor, scale: Callable) -> torch.Tensor:
        out = values.clone()
        for p, sl, at in self._spans(start, end, self.sources):
            out[at:at + sl.stop - sl.start] *= scale(p)
        return out

    def sq_by_source(self, start: int, values: torch.Tensor, out: torch.Tensor) -> None:
        index = {id(p): i for i, p in enumerate(self.sources)}
        for p, sl, at in self._spans(start, start + values.numel(), self.sources):
            out[index[id(p)]] += values[at:at + sl.stop - sl.start].double().square().sum()

    def write_sources(self, attr: str, ranges) -> None:
        """Zero the sources' gradients, then write the (start, values) ranges into them."""
        with torch.no_grad():
            for p in self.sources:
                if getattr(p, attr, None) is None:
                    setattr(p, attr, torch.zeros_like(p))
                getattr(p, attr).zero_()
            for start, values in ranges:
                for p, sl, at in self._spans(start, start + values.numel(), self.sources):
                    g = getattr(p, attr)
                    g.view(-1)[sl] = values[at:at + sl.stop - sl.start].to(g.dtype)

    def grad_norm_sq(self, param: torch.Tensor) -> Optional[float]:
        """The squared norm of `param`'s reduced gradient in this step (a source or an optimizer
        parameter); None when the last reduction was not a reduce-scatter."""
        if self.grad_sq is None:
            return None
        return self.grad_sq[id(param)]

    # -- the step -----------------------------------------------------------------------------------

    def step(self, closure=None):
        """Update the held ranges from the parameters' (reduced) gradients, then all-gather the shards."""
        if closure is not None:
            raise ValueError("the sharded optimizer takes no closure")
        if self.layout is None:
            raise RuntimeError("the sharded optimizer steps only inside a generation (after the runtime's start)")
        self.gather_error = None
        try:
            for held in self.held.values():
                if held.parts:
                    self._update(held)
        finally:
            self.grad_scale = 1.0
        try:
            self._gather()
        except Exception as e:  # a peer died after the commit: the runtime regroups and re-sends (regroup)
            self.gather_error = e
        return None

    def _update(self, held: _Held) -> None:
        for group, g in zip(held.inner.param_groups, held.hosts):
            for k, v in self.optimizer.param_groups[g].items():
                if k != "params":
                    group[k] = v
        for m, g, lo, hi in held.parts:
            m.grad = self._read(lo, hi, grad=True)  # a copy: the host's gradient tensor stays its own
            if self.grad_scale != 1.0:
                m.grad.mul_(self.grad_scale)
        held.inner.step()
        for m, g, lo, hi in held.parts:
            m.grad = None
            st = held.inner.state[m]
            for k in self.opt_keys:  # the optimizer must update the views in place (torch's do)
                if st[k].data_ptr() != held.state[k][lo - held.start:].data_ptr():
                    raise RuntimeError(f"{type(self.optimizer).__name__} replaced its state {k!r} instead of updating "
                                       "it in place: it cannot be sharded")
        if self.masters:  # the parameters follow their fp32 masters
            self._write(held.start, held.state["master"])

    def _gather(self) -> None:
        live = self.layout.live
        sizes = [self.layout.shard(r) for r in live]
        width = max(b - a for a, b in sizes)
        mine = self.held["shard"]
        inp = torch.zeros(width, dtype=torch.float32)
        inp[:mine.end - mine.start] = mine.state["master"] if self.masters else self._read(mine.start, mine.end)
        outs = [torch.empty(width, dtype=torch.float32) for _ in self._group_replicas]
        self.group.allgather([outs], [inp]).wait()
        for replica, out in zip(self._group_replicas, outs):
            if replica != self.replica:
                a, b = self.layout.shard(replica)
                self._write(a, out[:b - a])

    # -- flat access to the parameters ------------------------------------------------------------

    def _spans(self, start: int, end: int, tensors: Optional[Sequence[torch.Tensor]] = None):
        """(param, its flat slice, offset in [start, end)) of the parameters (or of `tensors`, one
        per parameter) overlapping the range."""
        for p, off in zip(self.params if tensors is None else tensors, self.offsets):
            a, b = max(start, off), min(end, off + p.numel())
            if a < b:
                yield p, slice(a - off, b - off), a - start

    def whole_parameters(self) -> torch.Tensor:
        """The optimizer's parameters, flat in fp32 (whole on every rank after a step's gather)."""
        return self._read(0, self.numel)

    def _read(self, start: int, end: int, grad: bool = False) -> torch.Tensor:
        out = torch.zeros(end - start, dtype=torch.float32)
        for p, sl, at in self._spans(start, end):
            src = getattr(p, self.grad_attr, None) if grad else p.detach()
            if src is not None:
                out[at:at + sl.stop - sl.start] = src.reshape(-1)[sl]
        return out

    def _write(self, start: int, values: torch.Tensor) -> None:
        with torch.no_grad():
            for p, sl, at in self._spans(start, start + values.numel()):
                p.view(-1)[sl] = values[at:at + sl.stop - sl.start].to(p.dtype)

    # -- held ranges --------------------------------------------------------------------------------

    def _new_held(self, start: int, end: int) -> _Held:
        n = end - start
        state = {k: torch.zeros(n) for k in self.opt_keys}
        if self.masters:  # from the parameters; a re-shard move brings the exact master
            state["master"] = self._read(start, end)
        return _Held(start, end, state, {k: torch.full((n,), float(v)) for k, v in self.fresh_scalars.items()})

    def _bind(self, held: _Held) -> None:
        """The host class's optimizer over views of the held range: one param group per (host param
        group, segment of equal scalars), with the host group's hyperparameters, over views of the
        optimizer's own parameters (updated in place)."""
        groups = []
        for a, b in _segments(held.scalars, held.start, held.end - held.start):
            for g, (lo, hi) in enumerate(self.group_bounds):
                lo, hi = max(a, lo), min(b, hi)
                if lo >= hi:
                    continue
                views = []
                if self.masters:
                    views.append(torch.nn.Parameter(held.state["master"][lo - held.start:hi - held.start]))
                    held.parts.append((views[-1], g, lo, hi))
                for p, sl, at in ([] if self.masters else self._spans(lo, hi)):
                    m = torch.nn.Parameter(p.detach().view(-1)[sl])
                    views.append(m)
                    held.parts.append((m, g, lo + at, lo + at + sl.stop - sl.start))
                hyper = {k: v for k, v in self.optimizer.param_groups[g].items() if k != "params"}
                groups.append({"params": views, **hyper})
                held.hosts.append(g)
        held.inner = type(self.optimizer)(groups) if groups else None
        for m, g, lo, hi in held.parts:
            st = {k: held.state[k][lo - held.start:hi - held.start] for k in self.opt_keys}
            st.update({k: torch.full_like(v, float(held.scalars[k][lo - held.start]))
                       for k, v in self.fresh_scalars.items()})
            held.inner.state[m] = st
        held.scalars = {}  # from now on the optimizer's state holds them

    def _scalar_elems(self, held: _Held, start: int, end: int) -> List[torch.Tensor]:
        """The scalars of [start, end) per element, as the optimizer keeps them now."""
        out = [torch.zeros(end - start) for _ in self.fresh_scalars]
        for m, g, lo, hi in held.parts:
            a, b = max(start, lo), min(end, hi)
            if a < b:
                for i, k in enumerate(self.fresh_scalars):
                    out[i][a - start:b - start] = float(held.inner.state[m][k])
        return out

    def nbytes(self) -> int:
        """Bytes of optimizer state this rank holds (the per-element state of its ranges) now."""
        return sum(h.nbytes() for h in self.held.values())

    def replicated_nbytes(self) -> int:
        """What a replicated optimizer of the same class holds: its per-element state, and an fp32
        master where the parameters are of lower precision (fp32 parameters are their own)."""
        return self.numel * 4 * len(self.keys)

    # -- where the state starts: the host optimizer's whole state, or a checkpoint's ---------------

    def load(self, source) -> None:
        """Start the first generation from a checkpoint's state: a StateSource (state_source.py), or
        a directory of this position's shard files (any number of replicas wrote them). Raises
        ValueError when it is of another model or optimizer, or does not cover the state."""
        if not isinstance(source, StateSource):
            source = self.files.shard_files(source)
        source.check(self.numel, self.keys)
        self._source = source


def _segments(scalars: Dict[str, torch.Tensor], start: int, n: int) -> List[Tuple[int, int]]:
    """Maximal runs of the n elements from `start` with equal scalars (per element), as [a, b)."""
    if n == 0:
        return []
    if not scalars:
        return [(start, start + n)]
    stacked = torch.stack(list(scalars.values()))
    cuts = (stacked[:, 1:] != stacked[:, :-1]).any(0).nonzero().flatten().tolist()
    bounds = [0] + [c + 1 for c in cuts] + [n]
    return [(start + a, start + b) for a, b in zip(bounds, bounds[1:])]
