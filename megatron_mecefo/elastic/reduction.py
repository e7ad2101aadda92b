"""The step's reduction across replicas: the one part that issues the gradient collectives.

Owned by the step driver (step.py); a host only hands it gradient buffers and, when it overlaps the
reduction with its backward, says when a bucket is ready. Three ways, one contract (every member
reduces SUMMED gradients; MeCeFO's divisors are applied once, here):

* flat: one fp32 all-reduce of every gradient and the step's statistics after the backward
  (gradients.py);
* sharded: a reduce-scatter when the optimizer state is sharded over the replicas (shard_grads.py,
  zero.py): each rank receives the ranges it holds;
* overlapped: buckets all-reduced during the backward of the step's last micro-batch, launched in
  one fixed order on every rank (`InOrderBuckets`: a complete bucket waits for the ones before it,
  because a covering rank, whose attention gradients never arrive, completes them in another order
  than an exact one, and every member must issue the same collectives in the same order). Plain
  `.grad`s are bucketed here (`GradBuckets`, a post-accumulate-grad hook per parameter, as
  Megatron-Core's DDP does); Megatron-LM's own DDP buckets plug their hooks into `InOrderBuckets`.
  The statistics and the divisors follow after the backward.

A host whose schedule averaged each micro-batch's gradient (Megatron's schedules divide by the
number of micro-batches) says so (`averaged_over`); the sums are restored here, before anything is
reduced. A failed collective is latched (latch.py, `report_error`): later ones of the step are
skipped, and the step fails at the commit like any failed reduction. Knows tensors, hooks and the
runtime's group, not layers or the protocol around it.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

import torch

from megatron_mecefo.elastic.comm import groups
from megatron_mecefo.elastic.comm.gradients import divisor_scale, reduce_with_divisors
from megatron_mecefo.elastic.comm.shard_grads import reduce_scatter_with_divisors

__all__ = ["Reduction", "InOrderBuckets", "GradBuckets"]


def _to_sums(tensors: Iterable[Optional[torch.Tensor]], averaged_over: int) -> None:
    """The host's schedule divided each micro-batch's gradient by `averaged_over`: sums again, as
    MeCeFO's divisors expect (the one place averages are undone)."""
    if averaged_over != 1:
        with torch.no_grad():
            for t in tensors:
                if t is not None:
                    t.mul_(averaged_over)


class InOrderBuckets:
    """Units of gradient (buckets) all-reduced during the backward, launched in their fixed order.

    Args:
        reduction: the step's Reduction (its group, error latch and abort poll).
        tensors: unit index -> the tensors to all-reduce in place for it (called once, at launch).
        count: how many units there are, in launch order.
    """

    def __init__(self, reduction: "Reduction", tensors: Callable[[int], List[torch.Tensor]], count: int) -> None:
        self._reduction = reduction
        self._tensors = tensors
        self.count = count
        self.scale = 1
        """The host's averaging, undone at launch (`_to_sums`)."""
        self.armed = False
        self.early = 0
        """Units launched during the backward in the last armed pass (the rest at its end)."""
        self.waited_s = 0.0
        """Time spent waiting for launched units (the reduction the backward did not hide)."""
        self._ready: set = set()
        self._works: Dict[int, List[Any]] = {}
        self._next = 0

    def arm(self, averaged_over: int = 1) -> None:
        """The next backward is the step's last micro-batch's: units launch as they become ready."""
        self.armed, self.scale, self.early, self.waited_s = True, averaged_over, 0, 0.0
        self._ready, self._works, self._next = set(), {}, 0

    def disarm(self) -> None:
        """Not the last micro-batch's backward (or a pass that ended early): nothing launches."""
        self.armed, self._works = False, {}

    def ready(self, unit: int) -> None:
        """Unit `unit`'s gradients are final: launch it, and every ready unit after it, in order."""
        if not self.armed:
            return
        self._ready.add(unit)
        while self._next < self.count and self._next in self._ready:
            self._launch(self._next)
            self.early += 1

    def launch_upto(self, end: int) -> None:
        """Launch, in order, every unit before `end` not launched yet (ready or not)."""
        while self._next < min(end, self.count):
            self._launch(self._next)

    def wait(self, unit: int) -> bool:
        """Launch up to `unit` and wait for it. False: a reduction failed (latched by the runtime)."""
        self.launch_upto(unit + 1)
        t0 = time.monotonic()
        ok = self._reduction._wait(self._works.get(unit, []))
        self.waited_s += time.monotonic() - t0
        return ok

    def finish(self) -> bool:
        """Launch what is left and wait for all. False: a reduction failed."""
        self.launch_upto(self.count)
        t0 = time.monotonic()
        ok = self._reduction._wait([w for unit in sorted(self._works) for w in self._works[unit]])
        self.waited_s += time.monotonic() - t0
        self.armed = False
        return ok

    def _launch(self, unit: int) -> None:
        self._next = unit + 1
        tensors = self._tensors(unit)
        _to_sums(tensors, self.scale)
        self._works[unit] = [self._reduction._launch(t) for t in tensors]


class GradBuckets(InOrderBuckets):
    """Plain `.grad`s in buckets of about `bucket_numel` elements (reverse registration order: the
    backward's, roughly); each bucket is ready when every parameter in it has its gradient (a
    post-accumulate-grad hook). Its flat fp32 copy is all-reduced; `finish` writes the sums back."""

    def __init__(self, reduction: "Reduction", params: Iterable[torch.nn.Parameter], bucket_numel: int) -> None:
        self.buckets: List[List[torch.nn.Parameter]] = []
        current, n = [], 0
        for p in reversed([p for p in params if p.requires_grad]):
            current.append(p)
            n += p.numel()
            if n >= bucket_numel:
                self.buckets.append(current)
                current, n = [], 0
        if current:
            self.buckets.append(current)
        super().__init__(reduction, self._flat, len(self.buckets))
        self._bucket_of: Dict[int, int] = {id(p): b for b, ps in enumerate(self.buckets) for p in ps}
        self._pending: Dict[int, set] = {}
        self._flats: Dict[int, torch.Tensor] = {}
        for ps in self.buckets:
            for p in ps:
                p.register_post_accumulate_grad_hook(self._grad_ready)

    def arm(self, averaged_over: int = 1) -> None:
        super().arm(averaged_over)
        self._flats = {}
        self._pending = {b: {id(p) for p in ps} for b, ps in enumerate(self.buckets)}

    def _grad_ready(self, p: torch.nn.Parameter) -> None:
        if not self.armed:
            return
        b = self._bucket_of[id(p)]
        self._pending[b].discard(id(p))
        if not self._pending[b]:
            self.ready(b)

    def _flat(self, b: int) -> List[torch.Tensor]:
        ps = self.buckets[b]
        device = ps[0].device
        self._flats[b] = torch.cat([(p.grad.detach().reshape(-1).float() if p.grad is not None
                                     else torch.zeros(p.numel(), device=device)) for p in ps])
        return [self._flats[b]]

    def finish(self) -> bool:
        ok = super().finish()
        flats, self._flats = self._flats, {}
        if ok:
            with torch.no_grad():
                for b, flat in flats.items():
                    at = 0
                    for p in self.buckets[b]:
                        p.grad = flat[at:at + p.numel()].view_as(p).to(p.dtype)
                        at += p.numel()
        return ok


class Reduction:
    """The cross-replica reduction of one rank's steps (see the module docstring).

    Args:
        latch: the runtime's step in progress (latch.StepLatch): its generation's group, its error
            latch (`report_error`, `failed`), the abort poll (`step_aborted`), the injection point
            "allreduce", the fold's divisors, and the statistics the commit checks
            (`step_statistics` / `take_statistics`).
        sharding: the sharded optimizer state (zero.ShardedOptimizer) whose ranges are
            reduce-scattered; None: replicated, all-reduced.
    """

    def __init__(self, latch, sharding=None) -> None:
        self.latch = latch
        self.sharding = sharding
        self.overlap: Optional[InOrderBuckets] = None
        """The buckets reduced during the backward (at most one set per host), or None."""
        self.record: Dict[str, Any] = {}
        """This step's fields for the step record (exposed_reduce_s, overlapped_buckets)."""

    # -- overlapped: what a host plugs in -----------------------------------------------------------

    def bucket_parameters(self, params: Iterable[torch.nn.Parameter], bucket_numel: int) -> GradBuckets:
        """Overlap the reduction of these parameters' `.grad`s with the backward (arm the buckets
        before the step's last micro-batch's backward)."""
        self.overlap = GradBuckets(self, params, bucket_numel)
        return self.overlap

    def bucket_units(self, tensors: Callable[[int], List[torch.Tensor]], count: int) -> InOrderBuckets:
        """Overlap the reduction of a host's own buckets (`tensors(i)`: unit i's gradient buffers,
        reduced in place); the host calls `ready(i)` / `wait(i)` from its bucket hooks."""
        self.overlap = InOrderBuckets(self, tensors, count)
        return self.overlap

    # -- the step's reduction -----------------------------------------------------------------------

    def reduce(self, params: Iterable[torch.nn.Parameter], stats: Sequence[float] = (), *,
               micro_batches: Optional[int] = None, attr: str = "grad", averaged_over: int = 1) -> List[float]:
        """Reduce this step's gradients over the members and apply MeCeFO's divisors. Call once per
        step on every member, after the backward of the plan's micro-batches.

        Args:
            params: the trainable parameters (their `attr` holds the gradients).
            stats: summed along (loss sum, counts) and returned; zeros if the step failed.
            micro_batches: how many micro-batches this rank ran (the commit refuses a step whose
                members did not run the whole global batch).
            attr: "grad" (replaced by the reduced tensor) or "main_grad" (Megatron's DDP buffers,
                written in place so they stay what its optimizer reads).
            averaged_over: the host's schedule divided each micro-batch's gradient by this many.
        """
        t0 = time.monotonic()
        overlapped = self.overlap is not None and self.overlap.armed
        waited = 0.0  # with overlap: what the host's bucket hooks waited during the backward
        if overlapped:
            waited = self.overlap.waited_s
            self.overlap.finish()
            self.record["overlapped_buckets"] = self.overlap.early
        try:
            return self._reduce([p for p in params if p.requires_grad], stats, micro_batches, attr,
                                averaged_over, overlapped)
        finally:  # the reduction the backward did not hide
            self.record["exposed_reduce_s"] = round(waited + time.monotonic() - t0, 6)

    def _reduce(self, params: List[torch.nn.Parameter], stats: Sequence[float], micro_batches: Optional[int],
                attr: str, averaged_over: int, overlapped: bool) -> List[float]:
        rt = self.latch
        if rt.failed:
            return [0.0] * len(stats)
        if not overlapped:
            rt.fire("allreduce")
            _to_sums((getattr(p, attr, None) for p in params), averaged_over)
        extra = list(stats) + rt.step_statistics(micro_batches)
        fold = rt.fold
        mha = fold.divisor_mha

        def scale(p, summed):
            return divisor_scale(p, fold.divisor, mha)

        sharded = self.sharding is not None and not overlapped and self.sharding.reduces(params)
        if self.sharding is not None and not sharded:
            self.sharding.grad_sq = None  # an all-reduced step: the tensors are whole
        try:
            if overlapped:  # the gradients are in: the statistics, then the divisors
                out = reduce_with_divisors(rt.group, [], extra, divisor=fold.divisor, divisor_mha=mha, attr=attr,
                                           should_abort=rt.step_aborted)
                with torch.no_grad():
                    for p in params:
                        g = getattr(p, attr, None)
                        if g is not None:
                            g.mul_(scale(p, out))
            elif sharded:  # each rank's ranges only
                out = reduce_scatter_with_divisors(self.sharding, rt.group, extra, attr=attr,
                                                   should_abort=rt.step_aborted, scale=scale)
            else:
                out = reduce_with_divisors(rt.group, params, extra, divisor=fold.divisor, divisor_mha=mha,
                                           attr=attr, should_abort=rt.step_aborted)
        except Exception as e:  # gloo: connection closed / timed out; or a peer gave up first
            rt.report_error(e)
            return [0.0] * len(stats)
        return rt.take_statistics(out)

    # -- the collectives ----------------------------------------------------------------------------

    def _launch(self, tensor: torch.Tensor):
        """Launch the SUM all-reduce of a bucket; its work, or None once the step has failed."""
        rt = self.latch
        if rt.failed:
            return None
        rt.fire("allreduce")
        try:
            return groups.allreduce_sum_async_(rt.group, tensor)
        except Exception as e:  # gloo: the connection to a peer is gone
            rt.report_error(e)
            return None

    def _wait(self, works: Sequence[Any]) -> bool:
        """Wait for launched buckets (abandoned as soon as a peer declared the step failed)."""
        rt = self.latch
        for work in works:
            if rt.failed:
                return False
            if work is None:
                continue
            try:
                groups.wait_(work, rt.step_aborted)
            except Exception as e:
                rt.report_error(e)
                return False
        return not rt.failed
