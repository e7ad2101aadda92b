"""Megatron-LM as the host of MeCeFO's step driver: upstream's own `train_step`, with three things
swapped.

* the data: an iterator over this rank's plan (own micro-batches, then adopted ones), wrapped in
  Megatron's `RerunDataIterator` so its rerun state machine can still replay a step;
* `forward_backward_func`: runs the plan's micro-batches (2k when covering), each forward in its
  covering mode, and keeps the loss reports;
* `optimizer.step()`: first the runtime's reduction of the DDP gradient buffers across replicas
  (with MeCeFO's divisors) and the job's commit decision; the optimizer steps only when the step
  is committed. Otherwise upstream sees a skipped update (no scheduler step), and `run` redoes the
  step with the survivors' new plan.

Megatron's schedule divides each micro-batch's loss by the number of micro-batches it runs; the
step's reduction (elastic/reduction.py) restores the sums before it divides by the global counts. The
sequence itself (plan, covering, injection, reduction, commit, redo) is elastic/step.py's.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch

from megatron_mecefo.elastic.interface import StepPlan
from megatron_mecefo.elastic.sharding.zero import ShardedOptimizer
from megatron_mecefo.elastic.step import DrivenHost, Host, StepDriver

__all__ = ["MegatronLMHost"]


class MegatronLMHost(DrivenHost):
    """Megatron-LM's DDP model chunks, optimizer and scheduler as the host of MeCeFO's step driver."""

    def __init__(self, driver: StepDriver, model, overlap: bool = False) -> None:
        self.driver = driver
        self.runtime = driver.runtime
        self.recompute_note = driver.recompute_note
        self.sharded: Optional[ShardedOptimizer] = driver.reduction.sharding
        """The sharded optimizer state (`--use-distributed-optimizer`), or None."""
        self.overlap: Optional[_Overlap] = _Overlap(model, driver.reduction) if overlap else None
        """The cross-replica reduction in upstream's DDP buckets (`--overlap-grad-reduce`), or None."""
        self._reports: list = []

    @staticmethod
    def host(model, optimizer) -> Host:
        """Megatron-LM's model chunks and optimizer as the step driver's host: the gradients are in
        the DDP buffers (`main_grad`); the schedule runs the micro-batches one at a time."""
        def lr():
            try:
                return optimizer.param_groups[0]["lr"]
            except Exception:
                return None

        return Host(module=torch.nn.ModuleList(model), parameters=lambda: (p for chunk in model for p in chunk.parameters()),
                    grad_attr="main_grad", optimizer_step=optimizer.step, zero_grad=optimizer.zero_grad, lr=lr)

    @staticmethod
    def model_state(model):
        """(get, set) of the model chunks' state, for a rejoining rank."""
        def get_model():
            return [chunk.state_dict() for chunk in model]

        def set_model(states):
            for chunk, chunk_state in zip(model, states):
                chunk.load_state_dict(chunk_state)

        return get_model, set_model

    # -- the step ---------------------------------------------------------------------------------

    def run(self, train_step: Callable, forward_step_func, model, optimizer, scheduler, config, forward_backward_func,
            batches: Callable[[StepPlan], Any], *, iteration: int):
        """Upstream's `train_step` until the step is committed (a failed step is redone by the
        survivors). Returns upstream's result with the job's loss in place of this rank's.

        Args:
            batches: plan -> an iterator over the plan's micro-batches in order (None on ranks
                that do not read data).
        """
        from megatron.core.rerun_state_machine import RerunDataIterator

        def one_pass(plan: StepPlan):
            self._reports = []
            if self.overlap is not None:  # upstream's schedule averages over the plan's micro-batches
                self.overlap.buckets.arm(averaged_over=len(plan.micro_batches))
            if len(model) > 1:  # virtual stages: an iterator per model chunk, as upstream's train() has
                data = [batches(plan) for _ in model]
                data = [RerunDataIterator(d) if d is not None else None for d in data]
            else:
                data = batches(plan)
                data = RerunDataIterator(data) if data is not None else None
            return train_step(self._forward_step(forward_step_func, plan, model), data,
                              model, _Gate(optimizer, self), scheduler, config,
                              self._forward_backward(forward_backward_func, plan), iteration=iteration)

        out = self.driver.run(iteration, one_pass)
        if not self.driver.last_committed:  # upstream returned before its optimizer step (its rerun machine exits)
            return out
        loss = out[0]
        if "lm loss" in loss and self.last_loss is not None:
            loss = dict(loss, **{"lm loss": torch.tensor(self.last_loss, device=loss["lm loss"].device)})
        return (loss,) + tuple(out[1:])

    def _forward_step(self, forward_step_func, plan: StepPlan, chunks):
        mbs = plan.micro_batches
        chunk_of = {id(chunk): i for i, chunk in enumerate(chunks)}
        done = [0] * len(chunks)  # each model chunk (virtual stage) runs the plan's micro-batches in order

        @functools.wraps(forward_step_func)
        def forward_step(data_iterator, model, *args, **kwargs):
            c = chunk_of.get(id(model), 0)
            mb = mbs[done[c] % len(mbs)]  # a replay by the rerun state machine starts the plan again
            done[c] += 1
            with self.driver.forward(mb, model):
                output, loss_func = forward_step_func(data_iterator, model, *args, **kwargs)
            self.driver.backward_point(output)
            return output, loss_func

        return forward_step

    def _forward_backward(self, forward_backward_func, plan: StepPlan):
        def forward_backward(*, num_microbatches, **kwargs):
            reports = forward_backward_func(num_microbatches=len(plan.micro_batches), **kwargs)
            self._reports = list(reports or [])
            return reports

        return forward_backward

    def finish(self) -> bool:
        """At upstream's optimizer step: the job's loss from the schedule's reports, then the driver
        reduces the gradient buffers, agrees and (committed) steps the optimizer."""
        n = len(self.driver.plan.micro_batches)
        loss_sum, tokens = 0.0, 0.0
        for report in self._reports:
            value = report.get("lm loss") if isinstance(report, dict) else None
            if value is None:
                continue
            value = value.detach().float().view(-1)
            if value.numel() == 2:  # (loss summed over tokens, tokens)
                loss_sum, tokens = loss_sum + float(value[0]), tokens + float(value[1])
            else:  # a micro-batch's mean loss
                loss_sum, tokens = loss_sum + float(value[0]), tokens + 1
        # the schedule averaged over the plan's n micro-batches
        return self.driver.finish(loss_sum=loss_sum, loss_count=tokens, micro_batches=n, averaged_over=n)


class _Overlap:
    """`--overlap-grad-reduce`: upstream's DDP bucket groups decide when a bucket's gradients are
    final (their hooks in the backward of the step's last micro-batch, counted as upstream counts
    them); their grad sync becomes the step's in-order bucket reduction across replicas
    (reduction.InOrderBuckets) instead of upstream's over the replica's data-parallel group (size 1).
    A group whose hooks do not all fire (a covering micro-batch skips the attention backward; the
    first step, before upstream knows its counts) is launched when upstream waits for it at the end
    of the backward. The order: the last model chunk's groups first, each chunk's in upstream's
    order (the backward's)."""

    def __init__(self, model, reduction) -> None:
        self.order = [group for chunk in reversed(list(model))
                      for group in list(chunk.bucket_groups) + list(getattr(chunk, "expert_parallel_bucket_groups", []))]
        self.index = {id(g): i for i, g in enumerate(self.order)}
        self.buckets = reduction.bucket_units(lambda i: [b.grad_data for b in self.order[i].buckets], len(self.order))
        for group in self.order:
            group.start_grad_sync = functools.partial(self.start, group)
            group.finish_grad_sync = functools.partial(self.finish, group)

    def start(self, group, force_all_reduce: bool = False) -> None:
        """Upstream's hooks found the group complete during the backward."""
        self.buckets.ready(self.index[id(group)])

    def finish(self, group, force_all_reduce: bool = False) -> None:
        group.param_gather_dispatched = False  # as upstream's finish_grad_sync
        self.buckets.wait(self.index[id(group)])


class _Gate:
    """Megatron's optimizer as upstream's `train_step` sees it: `step()` runs only on a committed step."""

    def __init__(self, optimizer, owner: MegatronLMHost) -> None:
        self._optimizer, self._owner = optimizer, owner

    def step(self):
        if not self._owner.finish():
            return False, None, None  # upstream: a skipped update, no scheduler step; the step is redone
        return self._owner.driver.optimizer_result

    def __getattr__(self, name):
        return getattr(self._optimizer, name)
