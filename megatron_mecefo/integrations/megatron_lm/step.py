"""One Megatron-LM training step under MeCeFO: upstream's own `train_step` with three things swapped.

* the data: an iterator over this rank's plan (own micro-batches, then adopted ones), wrapped in
  Megatron's `RerunDataIterator` so its rerun state machine can still replay a step;
* `forward_backward_func`: runs the plan's micro-batches (2k when covering), each forward in its
  covering mode, and keeps the loss reports;
* `optimizer.step()`: first the runtime's reduction of the DDP gradient buffers across replicas
  (with MeCeFO's divisors) and the job's commit decision; the optimizer steps only when the step
  is committed. Otherwise upstream sees a skipped update (no scheduler step), and `run` redoes the
  step with the survivors' new plan.

Megatron's schedule divides each micro-batch's loss by the number of micro-batches it runs; the
buffers are multiplied back to sums before the runtime divides by the global counts.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch

from megatron_mecefo.approx import covering
from megatron_mecefo.config import LaunchEnv, MeCeFOConfig
from megatron_mecefo.elastic.bootstrap import param_digest
from megatron_mecefo.elastic.runtime import ElasticRuntime, StepPlan
from megatron_mecefo.rng import rng_state, set_rng_state

__all__ = ["Step"]


class Step:
    """The runtime and what it drives on this rank: Megatron's DDP model chunks, optimizer, scheduler."""

    def __init__(self, runtime: ElasticRuntime, cfg: MeCeFOConfig, model, optimizer, micro_batch_size: int) -> None:
        self.runtime = runtime
        self.cfg = cfg
        self.model = model
        self.optimizer = optimizer
        self.micro_batch_size = micro_batch_size
        self.recompute_note = cfg.recompute_note(live_microbatches=1)  # the schedule runs them one at a time
        runtime.events.write("config", recompute=self.recompute_note)
        self.last_loss: Optional[float] = None
        self.last_committed = False
        self._plan: Optional[StepPlan] = None
        self._reports: list = []
        self._gated = False

    @classmethod
    def attach(cls, cfg: MeCeFOConfig, job: LaunchEnv, model, optimizer, scheduler, *, tensor_parallel: int,
               micro_batches: int, micro_batch_size: int, backend: str, train_iters: Optional[int], start: int,
               save: Optional[Callable[[], str]] = None, counters=None) -> "Step":
        """Join the job: the runtime with its state hooks (what a rejoining rank receives: model,
        optimizer, scheduler, RNG, the training loop's counters) and the give-up checkpoint.

        Args:
            counters: (get, set) of the training loop's counters (plain data).
            start: the iteration this rank starts at (after `--load`); a restarted rank takes the
                live one.
        """
        runtime = ElasticRuntime.for_job(cfg, job, tensor_parallel=tensor_parallel, pipeline_parallel=1,
                                         micro_batches=micro_batches, backend=backend)

        def get_state():
            return {"model": [chunk.state_dict() for chunk in model], "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict() if scheduler is not None else None, "rng": rng_state(),
                    "counters": counters[0]() if counters else None}

        def set_state(state):
            for chunk, chunk_state in zip(model, state["model"]):
                chunk.load_state_dict(chunk_state)
            optimizer.load_state_dict(state["optimizer"])
            if scheduler is not None and state["scheduler"] is not None:
                scheduler.load_state_dict(state["scheduler"])
            set_rng_state(state["rng"])
            if counters:
                counters[1](state["counters"])

        runtime.set_state_hooks(get_state, set_state)
        if save is not None:
            runtime.set_checkpoint_hook(save)
        if cfg.trace is not None and train_iters is not None:
            runtime.set_trace(train_iters)
        step = runtime.start(start)
        if counters:
            now = counters[0]()["iteration"]
            if step != now:
                raise RuntimeError(f"runtime step {step} != Megatron's iteration {now}")
        return cls(runtime, cfg, model, optimizer, micro_batch_size)

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

        while True:
            self.runtime.begin_step(iteration)
            self._plan = plan = self.runtime.plan()
            self._reports, self._gated = [], False
            record = {}
            if self.cfg.log_param_hash:  # replicas must be bit-identical at the start of every step
                record["param_sha256"] = param_digest(torch.nn.ModuleList(model))
            self._record = record
            data = batches(plan)
            with self.runtime.replica_collectives(iteration):
                out = train_step(self._forward_step(forward_step_func, plan, iteration),
                                 RerunDataIterator(data) if data is not None else None, model,
                                 _Gate(optimizer, self), scheduler, config,
                                 self._forward_backward(forward_backward_func, plan), iteration=iteration)
            if not self._gated:  # upstream returned before its optimizer step (its rerun machine exits)
                self.last_committed = False
                return out
            if self.last_committed:
                break
        loss = out[0]
        if "lm loss" in loss and self.last_loss is not None:
            loss = dict(loss, **{"lm loss": torch.tensor(self.last_loss, device=loss["lm loss"].device)})
        return (loss,) + tuple(out[1:])

    def _policy(self, mb, step: int):
        return self.cfg.cover_policy(step) if mb.covering else None

    def _forward_step(self, forward_step_func, plan: StepPlan, step: int):
        mbs = plan.micro_batches
        inject = self.runtime.injector
        done = [0]

        @functools.wraps(forward_step_func)
        def forward_step(data_iterator, model, *args, **kwargs):
            mb = mbs[done[0] % len(mbs)]  # a replay by the rerun state machine starts the plan again
            done[0] += 1
            inject.maybe_fire(step, "forward")
            with covering(model, self._policy(mb, step)):
                output, loss_func = forward_step_func(data_iterator, model, *args, **kwargs)
            if isinstance(output, torch.Tensor) and output.requires_grad:  # fires inside this micro-batch's backward
                output.register_hook(lambda grad: inject.maybe_fire(step, "backward"))
            return output, loss_func

        return forward_step

    def _forward_backward(self, forward_backward_func, plan: StepPlan):
        def forward_backward(*, num_microbatches, **kwargs):
            reports = forward_backward_func(num_microbatches=len(plan.micro_batches), **kwargs)
            self._reports = list(reports or [])
            return reports

        return forward_backward

    def reduce_and_commit(self) -> bool:
        """At upstream's optimizer step: reduce the gradient buffers across replicas and agree."""
        plan, n = self._plan, len(self._plan.micro_batches)
        self._gated = True
        params = [p for chunk in self.model for p in chunk.parameters() if p.requires_grad]
        for p in params:
            p.main_grad.mul_(n)  # the schedule averaged over the plan's n micro-batches: sums again
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
        total_loss, total_tokens, samples = self.runtime.reduce_gradients(
            params, stats=[loss_sum, tokens, n * self.micro_batch_size], micro_batches=n, attr="main_grad")
        loss = total_loss / total_tokens if total_tokens else None
        self.last_committed = self.runtime.commit(loss=loss, samples=int(samples), lr=self._lr(), **self._record)
        if self.last_committed:
            self.last_loss = loss
            self.runtime.injector.maybe_fire(plan.step, "optimizer")
        return self.last_committed

    def _lr(self):
        try:
            return self.optimizer.param_groups[0]["lr"]
        except Exception:
            return None


class _Gate:
    """Megatron's optimizer as upstream's `train_step` sees it: `step()` runs only on a committed step."""

    def __init__(self, optimizer, owner: Step) -> None:
        self._optimizer, self._owner = optimizer, owner

    def step(self):
        if not self._owner.reduce_and_commit():
            self._optimizer.zero_grad()
            return False, None, None  # upstream: a skipped update, no scheduler step; the step is redone
        return self._optimizer.step()

    def __getattr__(self, name):
        return getattr(self._optimizer, name)
