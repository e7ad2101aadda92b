"""MeCeFO for a DeepSpeed engine: the only module that imports deepspeed.

    from megatron_mecefo.deepspeed_hook import initialize
    engine = initialize(model=model, config=ds_config, args=args)        # like deepspeed.initialize
    while engine.global_steps < train_iters:
        for mb in engine.micro_batches():                                 # own (+ adopted) micro-batches
            loss = engine(*get_batch(engine.global_steps, mb))            # forward (covering mode if mb.covering)
            engine.backward(loss)
            engine.step()                                                 # boundary: reduce, commit, optimizer

`engine.backward(); engine.step()` keep their meaning: `step()` after the last micro-batch of the
plan is the accumulation boundary. There the MeCeFO runtime all-reduces the gradients with the fold
weights among the live replicas, and all of them take the optimizer step or none does; on a peer
failure the survivors regroup and `global_steps` stays, so the loop redoes the step.

How the frameworks see the job (why): DeepSpeed and Megatron cache their process groups, and a
group broken by a dead rank cannot be repaired inside them. So torch.distributed's default group
and Megatron's parallel_state span one replica only (its tp * pp ranks; data-parallel size 1 as
far as they know), and data parallelism across replicas belongs to the runtime's own groups, which
it rebuilds per generation. No framework code ever waits on a failed rank. Consequences: ds_config's
batch sizes are rewritten per replica (train_batch_size = micro batch * accumulation steps),
"managed_gradient_accumulation" is false, and ZeRO stage 1 is MeCeFO's, not DeepSpeed's: the
engine runs stage 0 inside its replica and the runtime shards the optimizer state over the live
replicas (elastic/zero.py: each shard also held by its covering neighbour, re-sharded on a
failure); checkpoints then hold one `mecefo_optim_*.pt` file per held range beside DeepSpeed's files,
written by every rank. Stages 2 and 3 are refused at start-up.

Tensor and pipeline parallelism: the replica is its T * P ranks (init_distributed); its forward and
backward run through Megatron-Core's schedules (`train_step`, 1F1B with P > 1), gradients are
clipped over the replica's model-parallel ranks (schedule.clip_grad_norm), and a failed collective
inside the replica raises ReplicaLost: the whole replica leaves and rejoins once restarted.

Scope: ZeRO-0 and 1, fp32 on gloo (tested), bf16 with stage 1 (tested on CPU; stage 1 runs without
DeepSpeed's bf16 wrapper: `bf16_parameters`). On CUDA the
runtime's groups use NCCL with TORCH_NCCL_ASYNC_ERROR_HANDLING=2 and communicator abort, following
PyTorch's documented APIs; that path is untested here (no GPU in CI).
"""

from __future__ import annotations

import copy
import logging
import os
from typing import Any, Dict, Iterator, Optional

import torch

from megatron_mecefo.config import LaunchEnv, MeCeFOConfig
from megatron_mecefo.deepspeed_hook.checkpoint import load_checkpoint, restrict_checkpoint_loading, save_checkpoint
from megatron_mecefo.elastic.bootstrap import init_distributed, param_digest, replica_groups_time_out
from megatron_mecefo.elastic.fold import MicroBatch
from megatron_mecefo.elastic.attach import attach
from megatron_mecefo.elastic.groups import default_backend
from megatron_mecefo.elastic.runtime import StateHooks, StepPlan
from megatron_mecefo.elastic.step import DrivenHost, Host, StepDriver, training_state
from megatron_mecefo.elastic.zero import ShardedOptimizer, innermost_optimizer

__all__ = ["initialize", "wrap_engine", "MeCeFOEngine", "init_distributed", "param_digest", "save_checkpoint",
           "load_checkpoint"]

logger = logging.getLogger(__name__)


def skip_cpu_shm_build() -> None:
    """DeepSpeed's CPU accelerator JIT-builds a shared-memory communication op (about 35 s) that
    MeCeFO's gloo groups never use."""
    import deepspeed

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def replica_ds_config(ds_config: Dict[str, Any], world: int) -> tuple:
    """The per-replica ds_config and the number of micro-batches per replica per step."""
    cfg = copy.deepcopy(ds_config)
    cfg.pop("mecefo", None)
    mb = cfg.get("train_micro_batch_size_per_gpu")
    gas = cfg.get("gradient_accumulation_steps")
    tbs = cfg.get("train_batch_size")
    if mb is None:
        raise ValueError('ds_config needs "train_micro_batch_size_per_gpu" with MeCeFO')
    if gas is None:
        gas = tbs // (mb * world) if tbs else 1
    if tbs is not None and tbs != mb * gas * world:
        raise ValueError(
            f'ds_config "train_batch_size"={tbs} != train_micro_batch_size_per_gpu ({mb}) x '
            f"gradient_accumulation_steps ({gas}) x data-parallel size ({world})"
        )
    cfg.update(train_batch_size=mb * gas, gradient_accumulation_steps=gas, managed_gradient_accumulation=False)
    if cfg.get("zero_optimization", {}).get("stage", 0) == 1:  # the runtime shards over the replicas
        cfg["zero_optimization"] = {**cfg["zero_optimization"], "stage": 0}
    if "overlap_comm" in cfg.get("zero_optimization", {}):  # the runtime's (overlap_bucket), not DeepSpeed's
        cfg["zero_optimization"] = {k: v for k, v in cfg["zero_optimization"].items() if k != "overlap_comm"}
    return cfg, gas, mb


def bf16_parameters(ds_config: Dict[str, Any]) -> bool:
    """With the sharded optimizer state and "bf16" on, DeepSpeed is told fp32 and given the model
    in bf16 (the caller casts it, as DeepSpeed would): its optimizer then steps the bf16
    parameters, and the fp32 masters live in the held shards only (elastic/zero.py), instead of a
    mixed-precision wrapper keeping a whole fp32 copy on every rank. The gradients are bf16, as in
    DeepSpeed's own bf16 mode at stage 0; the sharded update reads them in fp32 and applies the clip
    coefficient there. Returns whether it did so (and turns "bf16" off in `ds_config`)."""
    for key in ("bf16", "bfloat16"):
        if ds_config.get(key, {}).get("enabled", False):
            ds_config[key] = {**ds_config[key], "enabled": False}
            return True
    return False


def overlap_bucket(ds_config: Dict[str, Any]) -> Optional[int]:
    """ds_config "zero_optimization.overlap_comm" (DeepSpeed's switch for overlapping the gradient
    reduction with the backward): the runtime's all-reduce then runs in buckets of
    "reduce_bucket_size" elements (DeepSpeed's default 5e8) during the last micro-batch's backward.
    None: one buffer after the backward."""
    zero = ds_config.get("zero_optimization", {})
    return int(zero.get("reduce_bucket_size", 500_000_000)) if zero.get("overlap_comm", False) else None


def zero_stage(ds_config: Dict[str, Any]) -> int:
    return int(ds_config.get("zero_optimization", {}).get("stage", 0))


def pipeline_sends_in_groups() -> None:
    """DeepSpeed's pipeline engine sends and receives activations with `send`/`recv` on the default
    group, whose gloo receive waits out the timeout the group was created with (start-up's, long).
    Its other path (DeepSpeed's own, for torch < 1.8) broadcasts over a two-rank group per pair of
    adjacent stages; those groups take the collective timeout once the rank trains
    (`replica_groups_time_out`), so a hung stage fails its neighbour in time. Call before the
    engine is built."""
    from deepspeed.runtime.pipe import p2p

    p2p.can_send_recv = lambda: False


def _is_pipeline_engine(engine) -> bool:
    from deepspeed.runtime.pipe.engine import PipelineEngine

    return isinstance(engine, PipelineEngine)


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
        self.pipeline = _is_pipeline_engine(engine)
        """DeepSpeed's pipeline engine (a PipelineModule): steps run through `train_batch`."""
        if self.pipeline:
            self.engine.pipeline_enable_backward_allreduce = False  # its ReduceGrads: the runtime's
        self._plan: Optional[StepPlan] = None
        self._done = 0
        self._loss_sum = 0.0
        self._step_kwargs: Dict[str, Any] = {}
        self.buckets = None
        """The reduction overlapped with the last micro-batch's backward (ds_config
        "zero_optimization.overlap_comm"; data parallelism only: with T or P > 1 Megatron-Core's
        schedule runs the backward), or None."""

    def join(self, driver: StepDriver, overlap_bucket: Optional[int] = None) -> "MeCeFOEngine":
        """Drive this engine's steps with `driver` (elastic.attach); with `overlap_bucket`, the
        reduction runs in buckets of that many elements during the last micro-batch's backward."""
        self.driver, self.runtime, self.recompute_note = driver, driver.runtime, driver.recompute_note
        if overlap_bucket is not None and self.model_parallel == 1 and not self.pipeline:
            self.buckets = driver.reduction.bucket_parameters(self.engine.module.parameters(), overlap_bucket)
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
        if self.driver.plan is None:
            self.driver.begin(self.engine.global_steps)
        if self._plan is not self.driver.plan:  # a new step, or a redo (driver.run begins it)
            self._plan, self._done, self._loss_sum = self.driver.plan, 0, 0.0
        return self._plan

    def micro_batches(self) -> Iterator[MicroBatch]:
        """The micro-batches this rank runs this step (own, then adopted)."""
        yield from self.plan().micro_batches

    # -- the DeepSpeed surface --------------------------------------------------------------------

    def __call__(self, *args, **kwargs):
        mb = self.plan().micro_batches[self._done]
        with self.driver.forward(mb), self.driver.replica_collectives():
            return self.engine(*args, **kwargs)

    def backward(self, loss: torch.Tensor, **kwargs):
        if self.buckets is not None:  # the step's last micro-batch: complete buckets reduce during its backward
            if self._done == len(self.plan().micro_batches) - 1:
                self.buckets.arm()
            else:  # an earlier one (also of a pass redone after a failure in the last backward)
                self.buckets.disarm()
        self.driver.fire("backward")
        self._loss_sum += float(loss.detach())
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

        e = self.engine
        mbs = list(self.plan().micro_batches)
        forwards = iter(mbs)
        gas = e.gradient_accumulation_steps()  # the last stage's backward divides each loss by it

        def forward_pass(eng, buffer_id):
            with self.driver.forward(next(forwards)):
                PipelineEngine._exec_forward_pass(eng, buffer_id)
            self.driver.backward_point(eng.loss if eng.is_last_stage() else eng.pipe_buffers["outputs"][buffer_id])

        def optimizer_step(eng, **_):  # the schedule's own lr_kwargs (none) are replaced by ours
            last = eng.is_last_stage()
            self._step_kwargs = {"lr_kwargs": lr_kwargs}
            self.driver.finish(loss_sum=float(eng.total_loss) if last else 0.0, loss_count=len(mbs) if last else 0,
                               micro_batches=len(mbs), averaged_over=gas)

        def job_loss():  # instead of DeepSpeed's mean over this replica's micro-batches
            loss = torch.tensor([self.driver.last_loss or 0.0], dtype=torch.float32, device=e.device)
            if e.is_pipe_parallel:
                dist.broadcast(loss, src=e.grid.stage_to_global(e.num_stages - 1), group=e.grid.get_pipe_parallel_group())
            return loss[0]

        e.micro_batches = len(mbs)
        e._INSTRUCTION_MAP = {**PipelineEngine._INSTRUCTION_MAP, schedule.ForwardPass: forward_pass,
                              schedule.ReduceGrads: lambda eng: None, schedule.OptimizerStep: optimizer_step}
        e._aggregate_total_loss = job_loss
        try:
            with self.driver.replica_collectives():
                e.train_batch(data_iter)
        finally:
            del e._INSTRUCTION_MAP, e._aggregate_total_loss  # evaluation (eval_batch) runs DeepSpeed's own
            e.micro_batches = gas
        return self.driver.last_committed

    def step(self, **kwargs) -> bool:
        """After each micro-batch. At the plan's last one: reduce, commit, optimizer step.

        Returns True when an optimizer step was taken.
        """
        n = len(self.plan().micro_batches)
        self._done += 1
        if self._done < n:
            return False
        return self._finish(self._loss_sum, self._done, **kwargs)

    def _finish(self, loss_sum: float, ran: int, **step_kwargs) -> bool:
        self._step_kwargs = step_kwargs
        return self.driver.finish(loss_sum=loss_sum, loss_count=ran, micro_batches=ran)

    def _optimizer_step(self):
        if self.pipeline:  # DeepSpeed's OptimizerStep instruction (its step() refuses in pipeline mode)
            from deepspeed.runtime.pipe.engine import PipelineEngine

            return PipelineEngine._exec_optimizer_step(self.engine, **self._step_kwargs)
        return self.engine.step(**self._step_kwargs)

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
        """Every rank's part of a checkpoint with a sharded optimizer state: its held ranges, under
        save_dir/global_step{N} beside DeepSpeed's files (which one replica writes)."""
        if self.sharded is not None:
            self.sharded.save(os.path.join(save_dir, f"global_step{self.engine.global_steps}"))

    def close(self) -> None:
        self.driver.close()


def initialize(*, model: torch.nn.Module, config: Dict[str, Any], args=None, mecefo: Optional[MeCeFOConfig] = None,
               model_parameters=None, mpu=None, train_iters: Optional[int] = None, save_dir: Optional[str] = None,
               load_dir: Optional[str] = None, **kwargs) -> MeCeFOEngine:
    """`deepspeed.initialize` with MeCeFO. Call after `init_distributed()` and building the model.

    Args:
        model: the model (e.g. a Megatron-Core GPTModel with the MeCeFO layer spec).
        config: the ds_config dict, with its optional top-level "mecefo" block.
        args: parsed CLI args carrying `--mecefo*` flags (override the block).
        mecefo: a ready MeCeFOConfig (instead of config["mecefo"] + args).
        train_iters: total steps; needed for trace-driven failure injection ("trace").
        save_dir: where the job's checkpoint goes when it gives up (a failure MeCeFO cannot
            absorb): `engine.save_checkpoint(save_dir, tag="global_step{N}")` of the last committed
            step on one rank that holds the state, loadable with `engine.load_checkpoint(save_dir)`.
            None: no checkpoint (the give-up message says so).
        load_dir: resume from the DeepSpeed checkpoint there (`load_checkpoint`): loaded once, before
            the runtime starts, by every first-incarnation rank; a restarted rank takes the live
            state from a peer instead and never loads over it.

    Raises:
        ValueError: an invalid "mecefo" value or a DeepSpeed setting MeCeFO refuses, before training.
        FileNotFoundError / UnsafeCheckpoint: `load_dir` holds no loadable checkpoint.
    """
    import deepspeed

    cfg = mecefo or (MeCeFOConfig.from_args(args, config.get("mecefo")) if args is not None
                     else MeCeFOConfig.from_ds_config(config.get("mecefo")))
    cfg.check_ds_config(config)
    if cfg.enable and cfg.lowrank_ffn:
        from megatron_mecefo.layers.linear import check_lowrank_rank

        check_lowrank_rank(model, cfg.rank)
    if cfg.trace is not None and train_iters is None:
        raise ValueError('mecefo "trace" needs initialize(..., train_iters=N) to lay out the failures')
    backend = default_backend()
    from megatron.core import parallel_state

    tp = pp = 1
    if parallel_state.model_parallel_is_initialized():
        tp = parallel_state.get_tensor_model_parallel_world_size()
        pp = parallel_state.get_pipeline_model_parallel_world_size()
    job = init_distributed(backend, tp, pp, timeout_s=cfg.collective_timeout_s, join_timeout_s=cfg.join_timeout_s,
                           heartbeat_timeout_s=cfg.heartbeat_timeout_s, log_dir=cfg.log_dir,
                           restart_failed_after=cfg.restart_failed_after, max_restarts=cfg.max_restarts, store=cfg.store)
    os.environ.setdefault("LOCAL_RANK", "0")  # deepspeed.initialize asserts on it
    ds_config, k, mb = replica_ds_config(config, job.world // (tp * pp))
    sharded = cfg.enable and zero_stage(config) == 1
    if sharded and bf16_parameters(ds_config):
        model.bfloat16()  # what DeepSpeed's engine does with "bf16" on
    clip = engine_clipping(ds_config, model_parallel=tp * pp, sharded=sharded)
    if mpu is None:
        if parallel_state.model_parallel_is_initialized():
            from megatron_mecefo.deepspeed_hook.mpu import MegatronMPU

            mpu = MegatronMPU()
    skip_cpu_shm_build()
    engine, _, _, _ = deepspeed.initialize(
        model=model, config=ds_config, mpu=mpu,
        model_parameters=model_parameters if model_parameters is not None else [p for p in model.parameters() if p.requires_grad],
        **kwargs,
    )
    restrict_checkpoint_loading(engine)
    load = (lambda: load_checkpoint(engine, load_dir)) if load_dir is not None else None
    save = (lambda: save_checkpoint(engine, save_dir)) if save_dir is not None else None
    return wrap_engine(engine, cfg, job, tensor_parallel=tp, pipeline_parallel=pp, micro_batches=k,
                       micro_batch_size=mb, clip_grad=clip, backend=backend, train_iters=train_iters,
                       save=save, load=load, save_dir=save_dir, load_dir=load_dir, sharded=sharded,
                       overlap_bucket=overlap_bucket(config))


def engine_clipping(ds_config: Dict[str, Any], *, model_parallel: int, sharded: bool) -> float:
    """Where MeCeFOEngine clips instead of DeepSpeed, pop ds_config's "gradient_clipping" and return
    it (0.0: DeepSpeed clips, or nobody): with tensor or pipeline parallelism (DeepSpeed's clipping
    miscounts pipeline stages > 0) and with a sharded optimizer state (the reduce-scattered
    gradients are whole only in their owners' ranges; the norm comes from the shards)."""
    if model_parallel > 1 or sharded:
        return float(ds_config.pop("gradient_clipping", 0.0) or 0.0)
    return 0.0


def wrap_engine(engine, cfg: MeCeFOConfig, job: LaunchEnv, *, tensor_parallel: int, pipeline_parallel: int,
                micro_batches: int, micro_batch_size: int, clip_grad: float = 0.0, backend: Optional[str] = None,
                train_iters: Optional[int] = None, save=None, load=None, extra_state=None,
                module_state=None, sharded: bool = False, save_dir: Optional[str] = None,
                load_dir: Optional[str] = None, overlap_bucket: Optional[int] = None) -> MeCeFOEngine:
    """Join the job with a DeepSpeed engine built over this rank's replica (elastic.attach): its
    state hooks (module, optimizer, scheduler, counters, RNG; what a rejoining rank receives), the
    give-up checkpoint and, with `sharded`, its optimizer state sharded over the replicas. Shared
    by `initialize` and Megatron-DeepSpeed's adapter.

    Args:
        save: () -> checkpoint path, written when the job gives up (None: no checkpoint).
        load: () -> None, loads a checkpoint into the engine; called before the job is joined by
            first incarnations only (a restarted rank takes the live state from a peer instead).
        extra_state: (get, set) of more state a rejoining rank must receive (a training loop's
            counters); plain data only.
        module_state: (get, set) of the module's state (default: `state_dict` / `load_state_dict`;
            legacy Megatron models load only their `state_dict_for_save_checkpoint` format).
        sharded: shard the engine's optimizer state over the live replicas (ZeRO-1, elastic/zero.py);
            `save_dir` / `load_dir`: where its shard files go / come from (beside DeepSpeed's).
    """
    get_module, set_module = module_state or (engine.module.state_dict, engine.module.load_state_dict)

    def counters():
        return {"global_steps": engine.global_steps, "global_samples": engine.global_samples,
                "extra": extra_state[0]() if extra_state else None}

    def set_counters(values):
        engine.global_steps, engine.global_samples = values["global_steps"], values["global_samples"]
        if extra_state:
            extra_state[1](values["extra"])

    if sharded and innermost_optimizer(engine.optimizer) is not engine.optimizer:
        raise ValueError(f"the sharded optimizer state steps a plain torch optimizer; DeepSpeed built "
                         f"{type(engine.optimizer).__name__} (a mixed-precision wrapper: see initialize's bf16)")
    shards = ShardedOptimizer.for_job(engine.optimizer, cfg, job, tensor_parallel=tensor_parallel,
                                      pipeline_parallel=pipeline_parallel) if sharded else None
    save_shards = None
    if shards is not None and save_dir is not None:
        save_shards = lambda: shards.save(os.path.join(save_dir, f"global_step{engine.global_steps}"))  # noqa: E731
    wrapper = MeCeFOEngine(engine, micro_batch_size=micro_batch_size, model_parallel=tensor_parallel * pipeline_parallel,
                           clip_grad=clip_grad, sharded=shards)
    load_shards = None
    if job.incarnation == 0:
        if load is not None:
            load()
        latest = os.path.join(load_dir, "latest") if load_dir else None
        if shards is not None and latest and os.path.exists(latest):
            # a sharded checkpoint's shard files; else the (replicated) state DeepSpeed loaded
            with open(latest) as f:
                tag = os.path.join(load_dir, f.read().strip())
            load_shards = tag if shards.has_files(tag) else None
    state = StateHooks(*training_state((get_module, set_module), engine.optimizer, engine.lr_scheduler,
                                       (counters, set_counters)), save_checkpoint=save, save_shards=save_shards)
    driver = attach(cfg, job, wrapper.host, micro_batches=micro_batches, micro_batch_size=micro_batch_size, state=state,
                    current_step=lambda: engine.global_steps, tensor_parallel=tensor_parallel,
                    pipeline_parallel=pipeline_parallel, sharding=shards, load_shards=load_shards,
                    train_iters=train_iters, backend=backend)
    replica_groups_time_out(cfg.collective_timeout_s)  # DeepSpeed's and Megatron-DeepSpeed's groups too
    return wrapper.join(driver, overlap_bucket)
