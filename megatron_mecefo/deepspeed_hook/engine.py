"""MeCeFOEngine: a DeepSpeed engine as the host of MeCeFO's step driver (elastic/step.py).

    from megatron_mecefo.deepspeed_hook import initialize
    engine = initialize(model=model, config=ds_config, args=args)        # like deepspeed.initialize
    while engine.global_steps < train_iters:
        for mb in engine.micro_batches():                                 # own (+ adopted) micro-batches
            loss = engine(*get_batch(engine.global_steps, mb))            # forward (covering mode if mb.covering)
            engine.backward(loss)
            engine.step()                                                 # boundary: reduce, commit, optimizer

`engine.backward(); engine.step()` keep their meaning: `step()` after the last micro-batch of the
plan is the accumulation boundary. There the step's reduction (elastic/reduction.py) reduces the
gradients with the fold's divisors among the live replicas, and all of them take the optimizer step
or none does; on a peer
failure the survivors regroup and `global_steps` stays, so the loop redoes the step.

How the frameworks see the job (why): DeepSpeed and Megatron cache their process groups, and a
group broken by a dead rank cannot be repaired inside them. So torch.distributed's default group
and Megatron's parallel_state span one replica only (its tp * pp ranks; data-parallel size 1 as
far as they know), and data parallelism across replicas belongs to the runtime's own groups, which
it rebuilds per generation. No framework code ever waits on a failed rank. Consequences: ds_config's
batch sizes are rewritten per replica (train_batch_size = micro batch * accumulation steps),
"managed_gradient_accumulation" is false, and ZeRO stage 1 is MeCeFO's, not DeepSpeed's: the
engine runs stage 0 inside its replica and the runtime shards the optimizer state over the live
replicas (elastic/sharding/zero.py: each shard also held by its covering neighbour, re-sharded on a
failure); checkpoints then hold one `mecefo_optim_*.pt` file per held range beside DeepSpeed's files,
written by every rank. Stages 2 and 3 are refused at start-up.

Tensor and pipeline parallelism: the replica is its T * P ranks (init_distributed); its forward and
backward run through Megatron-Core's schedules (`train_step`, 1F1B with P > 1), gradients are
clipped over the replica's model-parallel ranks (schedule.clip_grad_norm), and a failed collective
inside the replica raises ReplicaLost: the whole replica leaves and rejoins once restarted.

The package around it: what a ds_config means under MeCeFO (ds_config.py), DeepSpeed's pipeline
engine (pipeline.py), `initialize` and `wrap_engine` (initialize.py, through elastic/attach.py).

Scope: ZeRO-0 and 1, fp32 on gloo (tested), bf16 with stage 1 (tested on CPU; stage 1 runs without
DeepSpeed's bf16 wrapper: `ds_config.bf16_parameters`). On CUDA the
runtime's groups use NCCL with TORCH_NCCL_ASYNC_ERROR_HANDLING=2 and communicator abort, following
PyTorch's documented APIs; that path is untested here (no GPU in CI).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Dict, Iterator, Optional

import torch

from megatron_mecefo.deepspeed_hook.pipeline import is_pipeline_engine
from megatron_mecefo.elastic.plan.fold import MicroBatch
from megatron_mecefo.elastic.interface import StepPlan
from megatron_mecefo.elastic.sharding.zero import ShardedOptimizer
from megatron_mecefo.elastic.step import DrivenHost, Host, StepDriver

__all__ = ["MeCeFOEngine"]

logger = logging.getLogger(__name__)


class MeCeFOEngine(DrivenHost):
    """A DeepSpeedEngine as the host of MeCeFO's step driver (elastic/step.py): `engine(...)`,
    `backward`, `step` (and `train_step` for Megatron's schedules) translate into the driver's
    forward / finish; everything else is the DeepSpeed engine's."""

    def __init__(self, engine, *, micro_batch_size: int, model_parallel: int = 1, clip_grad: float = 0.0,
                 sharded: Optional[ShardedOptimizer] = None) -> None:
        self.engine = engine
        self.clip_grad = clip_grad
        """With tensor or pipeline parallelism, or a sharded optimizer state, the engine clips
        (schedule.clip_grad_norm), not DeepSpeed (engine_clipping)."""
        self.sharded = sharded
        """The sharded optimizer state (ds_config zero stage 1), or None."""
        self.micro_batch_size = micro_batch_size
        self.model_parallel = model_parallel
        clips = (model_parallel > 1 and clip_grad > 0) or sharded is not None
        self.host = Host(module=engine.module, parameters=engine.module.parameters, optimizer_step=self._optimizer_step,
                         zero_grad=engine.zero_grad, lr=self._lr, before_optimizer=self._clip if clips else None)
        """The engine as the step driver's host (micro-batches run one at a time here:
        recompute_ffn="auto" resolves to off)."""
        self.engine.enable_backward_allreduce = False  # the runtime reduces across replicas
        self.pipeline = is_pipeline_engine(engine)
        """DeepSpeed's pipeline engine (a PipelineModule): steps run through `train_batch`."""
        if self.pipeline:
            self.engine.pipeline_enable_backward_allreduce = False  # its ReduceGrads: the runtime's
        self._loss = 0.0  # the last micro-batch's, from backward to step
        self.optimizer_kwargs: Dict[str, Any] = {}
        """What the engine's optimizer step is called with (`step(**kwargs)`, the pipeline's lr_kwargs)."""

    def join(self, driver: StepDriver, overlap_bucket: Optional[int] = None) -> "MeCeFOEngine":
        """Drive this engine's steps with `driver` (elastic.attach); with `overlap_bucket`, the
        reduction runs in buckets of that many elements during the last micro-batch's backward."""
        self.driver, self.runtime, self.recompute_note = driver, driver.runtime, driver.recompute_note
        if overlap_bucket is not None and self.model_parallel == 1 and not self.pipeline:
            # ds_config "zero_optimization.overlap_comm": the reduction overlaps the last micro-batch's
            # backward (data parallelism only: with T or P > 1 Megatron-Core's schedule runs it)
            driver.reduction.bucket_parameters(self.engine.module.parameters(), overlap_bucket)
        elif overlap_bucket is not None and driver.runtime.rank == 0:
            logger.warning('ds_config "zero_optimization.overlap_comm": MeCeFO overlaps the reduction with data '
                           "parallelism only; with tensor or pipeline parallelism it runs after the backward")
        return self

    # -- what to run ------------------------------------------------------------------------------

    @property
    def global_steps(self) -> int:
        return self.engine.global_steps

    @global_steps.setter
    def global_steps(self, value: int) -> None:  # after loading a checkpoint
        if self.driver.plan is not None:
            raise RuntimeError("set global_steps between steps only")
        self.engine.global_steps = value

    @property
    def record_extra(self) -> Dict[str, Any]:
        """Extra fields for this step's record in steps_rank{R}.jsonl."""
        return self.driver.record_extra

    def plan(self) -> StepPlan:
        """This step's plan (starts the step on first call)."""
        return self.driver.begun(self.engine.global_steps)

    def micro_batches(self) -> Iterator[MicroBatch]:
        """The micro-batches this rank runs this step (own, then adopted)."""
        yield from self.plan().micro_batches

    # -- the DeepSpeed surface --------------------------------------------------------------------

    def __call__(self, *args, **kwargs):
        self.plan()
        with self.driver.forward(self.driver.micro_batch), self.driver.replica_collectives():
            return self.engine(*args, **kwargs)

    def backward(self, loss: torch.Tensor, **kwargs):
        self.driver.backward_begins()
        self._loss = float(loss.detach())
        with self.driver.replica_collectives():
            return self.engine.backward(loss, scale_wrt_gas=False, **kwargs)  # micro-batch gradients are SUMMED

    def train_step(self, forward_step_func, batch_of, *, seq_length: int) -> bool:
        """One global step through Megatron-Core's schedule (1F1B with pipeline parallelism): the
        plan's micro-batches (own, then adopted), each forward in its covering mode; then reduce,
        commit and optimizer step as `step()` does. Returns True when an optimizer step was taken.

        Args:
            forward_step_func: Megatron's `(data_iterator, model) -> (output, loss_func)`.
            batch_of: MicroBatch -> the item `data_iterator` yields for it (every stage gets one).
        """
        from megatron_mecefo.deepspeed_hook.schedule import forward_backward, reduce_tied_embeddings

        mbs = list(self.plan().micro_batches)
        with self.driver.replica_collectives():
            losses = forward_backward(self.engine.module, forward_step_func,
                                      (batch_of(mb) for mb in mbs), num_microbatches=len(mbs), seq_length=seq_length,
                                      micro_batch_size=self.micro_batch_size,
                                      before_forward=lambda i: self.driver.forward(mbs[i]),
                                      after_forward=lambda i, output: self.driver.backward_point(output))
            reduce_tied_embeddings(self.engine.module)  # inside the replica, before the runtime's reduction
        return self._finish(sum(losses), len(mbs))

    def train_batch(self, data_iter=None, lr_kwargs: Optional[Dict[str, Any]] = None) -> bool:
        """One global step of DeepSpeed's pipeline engine through its own schedule (pipeline.train_batch).
        Returns True when an optimizer step was taken (False: redo the step)."""
        from megatron_mecefo.deepspeed_hook.pipeline import train_batch

        return train_batch(self, data_iter, lr_kwargs)

    def step(self, **kwargs) -> bool:
        """After each micro-batch. At the plan's last one: reduce, commit, optimizer step.

        Returns True when an optimizer step was taken.
        """
        self.plan()
        done = self.driver.micro_batch_done(self._loss)
        return self._finish(*done, **kwargs) if done is not None else False

    def _finish(self, loss_sum: float, ran: int, **step_kwargs) -> bool:
        self.optimizer_kwargs = step_kwargs
        return self.driver.finish(loss_sum=loss_sum, loss_count=ran, micro_batches=ran)

    def _optimizer_step(self):
        if self.pipeline:  # DeepSpeed's OptimizerStep instruction (its step() refuses in pipeline mode)
            from deepspeed.runtime.pipe.engine import PipelineEngine

            return PipelineEngine._exec_optimizer_step(self.engine, **self.optimizer_kwargs)
        return self.engine.step(**self.optimizer_kwargs)

    def _clip(self) -> None:
        from megatron_mecefo.deepspeed_hook.schedule import clip_grad_norm

        z = self.sharded  # a reduce-scattered step: the tensors hold this rank's ranges only
        clip_grad_norm(self.engine.module, self.clip_grad,
                       grad_norm_sq=z.grad_norm_sq if z is not None and z.grad_sq is not None else None,
                       scale=(lambda c: setattr(z, "grad_scale", c)) if z is not None and z.masters else None)

    def _lr(self) -> Optional[float]:
        try:
            return self.engine.get_lr()[0]
        except Exception:
            return None

    def __getattr__(self, name):  # everything else: the DeepSpeed engine
        return getattr(self.engine, name)

    def save_shards(self, save_dir: str) -> None:
        """Every rank's part of a checkpoint with a sharded optimizer state, beside DeepSpeed's files
        in save_dir/global_step{N} (which one replica writes): its shard, which the lead replica's
        rank of its position gathers into DeepSpeed's ZeRO file (zero_checkpoint.py)."""
        if self.sharded is None:
            return
        from megatron_mecefo.deepspeed_hook.zero_checkpoint import write_zero_checkpoint

        tag_dir = os.path.join(save_dir, f"global_step{self.engine.global_steps}")
        got = self.driver.save_shards(tag_dir, self.engine.global_steps)
        if got is not None:  # the lead replica, with every shard of this save
            write_zero_checkpoint(self.sharded, tag_dir, got, mp_rank=self.engine.checkpoint_mp_rank,
                                  clip_grad=self.clip_grad)

    def close(self) -> None:
        self.driver.close()
