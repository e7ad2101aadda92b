"""Overlapped reduction for hosts whose gradients are plain `.grad`s: the step's last micro-batch's
backward launches the runtime's all-reduce of a bucket of gradients as soon as every parameter in
it has its gradient (a post-accumulate-grad hook), as Megatron-Core's DDP buckets do.

    buckets = GradBuckets(model.parameters(), runtime, bucket_numel=reduce_bucket_size)
    buckets.arm()          # before the backward of the step's last micro-batch
    loss.backward()        # complete buckets start their all-reduce here
    buckets.finish()       # the rest (gradients that never arrive: a skipped attention backward)
    driver.finish(..., reduced=True)   # statistics, divisors, commit

Buckets launch in their fixed order (a complete bucket waits for the ones before it): every member
must issue the same collectives in the same order, and a covering rank whose attention gradients
never arrive completes its buckets in another order than a rank running exact backwards.
Knows tensors, hooks and the runtime's launch/wait, not the protocol: a failed bucket is latched
by the runtime and fails the step like any reduction.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Tuple

import torch

__all__ = ["GradBuckets"]


class GradBuckets:
    """Buckets of `params` (in reverse registration order: the backward's order, roughly), about
    `bucket_numel` elements each, all-reduced during the backward once armed."""

    def __init__(self, params: Iterable[torch.nn.Parameter], runtime, bucket_numel: int) -> None:
        self.runtime = runtime
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
        self._bucket_of: Dict[int, int] = {id(p): b for b, ps in enumerate(self.buckets) for p in ps}
        self._pending: Dict[int, set] = {}
        self._launched: Dict[int, Tuple[torch.Tensor, Optional[object]]] = {}
        self.armed = False
        self._next = 0  # the next bucket to launch, in order
        self.early = 0
        """Buckets launched during the backward in the last armed pass (the rest at `finish`)."""
        for ps in self.buckets:
            for p in ps:
                p.register_post_accumulate_grad_hook(self._ready)

    def arm(self) -> None:
        """The next backward is the step's last micro-batch's: its complete buckets launch."""
        self.armed, self.early, self._launched, self._next = True, 0, {}, 0
        self._pending = {b: {id(p) for p in ps} for b, ps in enumerate(self.buckets)}

    def disarm(self) -> None:
        """Not the last micro-batch's backward (or a pass that ended without `finish`): the hooks
        launch nothing, and nothing launched is written back."""
        self.armed, self._launched = False, {}

    def _ready(self, p: torch.nn.Parameter) -> None:
        if not self.armed:
            return
        self._pending[self._bucket_of[id(p)]].discard(id(p))
        while self._next < len(self.buckets) and not self._pending[self._next]:
            self._launch(self._next)
            self.early += 1

    def _launch(self, b: int) -> None:
        self._next = b + 1
        ps = self.buckets[b]
        device = ps[0].device
        flat = torch.cat([(p.grad.detach().reshape(-1).float() if p.grad is not None
                           else torch.zeros(p.numel(), device=device)) for p in ps])
        self._launched[b] = (flat, self.runtime.launch_reduction(flat))

    def finish(self) -> bool:
        """Launch the buckets still waiting, wait for all, and write the summed gradients back.
        Returns False when a bucket's reduction failed (the step fails; gradients untouched)."""
        while self._next < len(self.buckets):
            self._launch(self._next)
        launched, self.armed = self._launched, False
        self._launched = {}
        if not self.runtime.wait_reductions([work for _, work in launched.values()]):
            return False
        with torch.no_grad():
            for b, (flat, _) in launched.items():
                at = 0
                for p in self.buckets[b]:
                    p.grad = flat[at:at + p.numel()].view_as(p).to(p.dtype)
                    at += p.numel()
        return True
