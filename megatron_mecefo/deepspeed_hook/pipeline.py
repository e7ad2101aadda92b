"""DeepSpeed's pipeline engine (a PipelineModule, GPTModelPipe) as a host of MeCeFO's step: its
own 1F1B schedule runs the plan's micro-batches, its ReduceGrads does nothing (the engine spans one
replica) and its OptimizerStep is the step driver's finish."""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

__all__ = ["is_pipeline_engine", "train_batch"]


def is_pipeline_engine(engine) -> bool:
    from deepspeed.runtime.pipe.engine import PipelineEngine

    return isinstance(engine, PipelineEngine)


def train_batch(host, data_iter=None, lr_kwargs: Optional[Dict[str, Any]] = None) -> bool:
    """One global step of DeepSpeed's pipeline engine, through its own schedule (TrainSchedule:
    1F1B over the stages of this replica) running the plan's micro-batches (own, then adopted;
    `data_iter` yields them in that order where the engine reads data). Each forward runs in its
    micro-batch's covering mode; the schedule's ReduceGrads does nothing (the engine spans one
    replica) and its OptimizerStep is the driver's finish: reduce across the replicas, commit,
    and only then the engine's own optimizer step (clipping included). Every stage then holds
    the job's loss (`engine.agg_train_loss`, broadcast from the last stage as DeepSpeed does).
    `lr_kwargs`: for the scheduler's step, as `step(lr_kwargs=...)` takes them. DeepSpeed's schedule
    passes none, and its scheduler fallback counts the engine's train_batch_size (one replica's
    here; Megatron's scheduler wants the global batch: {"increment": ...}).
    Returns True when an optimizer step was taken (False: redo the step)."""
    import torch.distributed as dist
    from deepspeed.runtime.pipe import schedule
    from deepspeed.runtime.pipe.engine import PipelineEngine

    e = host.engine
    mbs = list(host.plan().micro_batches)
    forwards = iter(mbs)
    gas = e.gradient_accumulation_steps()  # the last stage's backward divides each loss by it

    def forward_pass(eng, buffer_id):
        with host.driver.forward(next(forwards)):
            PipelineEngine._exec_forward_pass(eng, buffer_id)
        host.driver.backward_point(eng.loss if eng.is_last_stage() else eng.pipe_buffers["outputs"][buffer_id])

    def optimizer_step(eng, **_):  # the schedule's own lr_kwargs (none) are replaced by ours
        last = eng.is_last_stage()
        host.optimizer_kwargs = {"lr_kwargs": lr_kwargs}
        host.driver.finish(loss_sum=float(eng.total_loss) if last else 0.0, loss_count=len(mbs) if last else 0,
                           micro_batches=len(mbs), averaged_over=gas)

    def job_loss():  # instead of DeepSpeed's mean over this replica's micro-batches
        loss = torch.tensor([host.driver.last_loss or 0.0], dtype=torch.float32, device=e.device)
        if e.is_pipe_parallel:
            dist.broadcast(loss, src=e.grid.stage_to_global(e.num_stages - 1), group=e.grid.get_pipe_parallel_group())
        return loss[0]

    e.micro_batches = len(mbs)
    e._INSTRUCTION_MAP = {**PipelineEngine._INSTRUCTION_MAP, schedule.ForwardPass: forward_pass,
                          schedule.ReduceGrads: lambda eng: None, schedule.OptimizerStep: optimizer_step}
    e._aggregate_total_loss = job_loss
    try:
        with host.driver.replica_collectives():
            e.train_batch(data_iter)
    finally:
        del e._INSTRUCTION_MAP, e._aggregate_total_loss  # evaluation (eval_batch) runs DeepSpeed's own
        e.micro_batches = gas
    return host.driver.last_committed

