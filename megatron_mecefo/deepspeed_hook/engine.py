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
it rebuilds per generation. No framework code ever waits on a failed rank. Consequences: ZeRO
stages >= 1 (which shard optimizer state over data-parallel ranks, so a dead rank would take its
shard) are refused at start-up; ds_config's batch sizes are rewritten per replica
(train_batch_size = micro batch * accumulation steps), "managed_gradient_accumulation" is false.

Scope: tp = pp = 1 (the runtime's current scope), ZeRO-0, fp32 on gloo (tested). On CUDA the
runtime's groups use NCCL with TORCH_NCCL_ASYNC_ERROR_HANDLING=2 and communicator abort, following
PyTorch's documented APIs; that path is untested here (no GPU in CI).
"""

from __future__ import annotations

import copy
import logging
import os
from datetime import timedelta
from typing import Any, Dict, Iterator, Optional

import torch
import torch.distributed as dist

from megatron_mecefo.approx import covering
from megatron_mecefo.config import LaunchEnv, MeCeFOConfig, prepare_nccl_error_handling
from megatron_mecefo.elastic.fold import MicroBatch
from megatron_mecefo.elastic.runtime import ElasticRuntime, StepPlan
from megatron_mecefo.elastic.store_daemon import spawn_store_daemon

__all__ = ["initialize", "MeCeFOEngine", "init_distributed", "check_ds_config", "param_digest", "save_checkpoint"]

logger = logging.getLogger(__name__)


def init_distributed(backend: str = "gloo") -> LaunchEnv:
    """Initialise torch.distributed over this rank's replica only (tp = pp = 1: a world of one).

    Under mecefo-launch the job's store is the launcher's. Under another launcher (deepspeed,
    torchrun) rank 0 starts a store daemon on MASTER_PORT that outlives every rank.
    Returns the launch environment the runtime needs.
    """
    env = LaunchEnv.read()
    if backend == "nccl":
        prepare_nccl_error_handling()
    if not dist.is_initialized():
        if not env.mecefo_launcher and env.rank == 0 and env.incarnation == 0:
            spawn_store_daemon("0.0.0.0", env.master_port)
        store = dist.TCPStore(env.master_addr, env.master_port, is_master=False, timeout=timedelta(seconds=300),
                              wait_for_workers=False)
        replica_store = dist.PrefixStore(f"mecefo/replica{env.rank}/inc{env.incarnation}", store)
        dist.init_process_group(backend, store=replica_store, rank=0, world_size=1)
    return env


def check_ds_config(ds_config: Dict[str, Any], cfg: MeCeFOConfig) -> None:
    """Reject DeepSpeed settings MeCeFO cannot run with, before training starts."""
    if not cfg.enable:
        return
    stage = ds_config.get("zero_optimization", {}).get("stage", 0)
    if stage:
        raise ValueError(
            f'ds_config "zero_optimization.stage"={stage} is not supported with MeCeFO (--mecefo): ZeRO shards '
            "optimizer state over data-parallel ranks, so a failed rank would take its shard with it. Use stage 0."
        )
    if ds_config.get("fp16", {}).get("enabled"):
        raise ValueError('ds_config "fp16" is not supported with MeCeFO yet; use "bf16" or fp32')


def _replica_ds_config(ds_config: Dict[str, Any], world: int) -> tuple:
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
    return cfg, gas, mb


def param_digest(module: torch.nn.Module) -> str:
    """SHA-256 of the module's parameters, in order (bit-level: equal digests = identical replicas)."""
    import hashlib

    h = hashlib.sha256()
    for p in module.parameters():
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def save_checkpoint(engine, save_dir: str) -> str:
    """DeepSpeed's checkpoint of `engine` under save_dir/global_step{N} (+ `latest`, and Megatron's
    latest_checkpointed_iteration.txt); call on ONE rank (every replica believes it is rank 0 of
    its own world, so two callers would write the same files). Returns the checkpoint directory."""
    tag = f"global_step{engine.global_steps}"
    engine.save_checkpoint(save_dir, tag=tag, client_state={"iteration": engine.global_steps})
    with open(os.path.join(save_dir, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(engine.global_steps))
    return os.path.join(save_dir, tag)


class MeCeFOEngine:
    """Wraps a DeepSpeedEngine; drives the ElasticRuntime at the accumulation boundary."""

    def __init__(self, engine, runtime: ElasticRuntime, cfg: MeCeFOConfig, micro_batch_size: int) -> None:
        self.engine = engine
        self.runtime = runtime
        self.cfg = cfg
        self.micro_batch_size = micro_batch_size
        self.engine.enable_backward_allreduce = False  # the runtime reduces across replicas
        self._plan: Optional[StepPlan] = None
        self._done = 0
        self._loss_sum = 0.0
        self.last_loss: Optional[float] = None
        self.last_committed = False
        self.record_extra: Dict[str, Any] = {}
        """Extra fields for this step's record in steps_rank{R}.jsonl (set before the step's first micro-batch)."""

    # -- what to run ------------------------------------------------------------------------------

    @property
    def global_steps(self) -> int:
        return self.engine.global_steps

    @global_steps.setter
    def global_steps(self, value: int) -> None:  # after loading a checkpoint
        if self._plan is not None:
            raise RuntimeError("set global_steps between steps only")
        self.engine.global_steps = value

    def plan(self) -> StepPlan:
        """This step's plan (starts the step on first call)."""
        if self._plan is None:
            self.runtime.begin_step(self.engine.global_steps)
            self._plan = self.runtime.plan()
            self._done, self._loss_sum = 0, 0.0
            if self.cfg.log_param_hash:  # replicas must be bit-identical at the start of every step
                self.record_extra["param_sha256"] = param_digest(self.engine.module)
        return self._plan

    def micro_batches(self) -> Iterator[MicroBatch]:
        """The micro-batches this rank runs this step (own, then adopted)."""
        plan = self.plan()
        for mb in plan.micro_batches:
            yield mb

    @property
    def current(self) -> MicroBatch:
        return self.plan().micro_batches[self._done]

    # -- the DeepSpeed surface --------------------------------------------------------------------

    def __call__(self, *args, **kwargs):
        mb = self.current
        self.runtime.injector.maybe_fire(self.engine.global_steps, "forward")
        policy = self.cfg.cover_policy(self.engine.global_steps) if (mb.covering and self.cfg.enable) else None
        with covering(self.engine.module, policy):
            return self.engine(*args, **kwargs)

    def backward(self, loss: torch.Tensor, **kwargs):
        self.runtime.injector.maybe_fire(self.engine.global_steps, "backward")
        self._loss_sum += float(loss.detach())
        return self.engine.backward(loss, scale_wrt_gas=False, **kwargs)  # micro-batch gradients are SUMMED

    def step(self, **kwargs) -> bool:
        """After each micro-batch. At the plan's last one: reduce, commit, optimizer step.

        Returns True when an optimizer step was taken.
        """
        plan = self.plan()
        self._done += 1
        if self._done < len(plan.micro_batches):
            return False
        samples = len(plan.micro_batches) * self.micro_batch_size
        total_loss, total_samples = self.runtime.reduce_gradients(self.engine.module.parameters(),
                                                                  stats=[self._loss_sum, samples])
        self._plan = None
        committed = self.runtime.commit(loss=total_loss / plan.divisor if plan.divisor else None,
                                        samples=int(total_samples), lr=self._lr(), **self.record_extra)
        self.last_committed = committed
        if committed:
            self.last_loss = total_loss / plan.divisor
            self.runtime.injector.maybe_fire(self.engine.global_steps, "optimizer")
            self.engine.step(**kwargs)
        else:
            self.engine.zero_grad()
        return committed

    def _lr(self):
        try:
            return self.engine.get_lr()[0]
        except Exception:
            return None

    def __getattr__(self, name):  # everything else: the DeepSpeed engine
        return getattr(self.engine, name)

    def close(self) -> None:
        self.runtime.close()


def initialize(*, model: torch.nn.Module, config: Dict[str, Any], args=None, mecefo: Optional[MeCeFOConfig] = None,
               model_parameters=None, mpu=None, train_iters: Optional[int] = None, save_dir: Optional[str] = None,
               **kwargs) -> MeCeFOEngine:
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

    Raises:
        ValueError: an invalid "mecefo" value or a DeepSpeed setting MeCeFO refuses, before training.
    """
    import deepspeed

    cfg = mecefo or (MeCeFOConfig.from_args(args, config.get("mecefo")) if args is not None
                     else MeCeFOConfig.from_ds_config(config.get("mecefo")))
    check_ds_config(config, cfg)
    if cfg.enable and cfg.lowrank_ffn:
        from megatron_mecefo.layers.linear import check_lowrank_rank

        check_lowrank_rank(model, cfg.rank)
    if cfg.trace is not None and train_iters is None:
        raise ValueError('mecefo "trace" needs initialize(..., train_iters=N) to lay out the failures')
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    job = init_distributed(backend)
    os.environ.setdefault("LOCAL_RANK", "0")  # deepspeed.initialize asserts on it
    ds_config, k, mb = _replica_ds_config(config, job.world)
    if mpu is None:
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            from megatron_mecefo.deepspeed_hook.mpu import MegatronMPU

            mpu = MegatronMPU()
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # avoid a 35 s JIT build on CPU
    engine, _, _, _ = deepspeed.initialize(
        model=model, config=ds_config, mpu=mpu,
        model_parameters=model_parameters if model_parameters is not None else [p for p in model.parameters() if p.requires_grad],
        **kwargs,
    )
    runtime = ElasticRuntime(cfg, rank=job.rank, world=job.world, store_host=job.master_addr,
                             store_port=job.master_port, micro_batches=k, incarnation=job.incarnation,
                             soft_failures=not job.mecefo_launcher, backend=backend)

    def get_state():
        return {"module": engine.module.state_dict(), "optimizer": engine.optimizer.state_dict(),
                "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
                "global_steps": engine.global_steps, "global_samples": engine.global_samples}

    def set_state(state):
        engine.module.load_state_dict(state["module"])
        engine.optimizer.load_state_dict(state["optimizer"])
        if state["lr_scheduler"] is not None and engine.lr_scheduler is not None:
            engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
        engine.global_steps, engine.global_samples = state["global_steps"], state["global_samples"]

    runtime.set_state_hooks(get_state, set_state)
    if save_dir is not None:
        runtime.set_checkpoint_hook(lambda: save_checkpoint(engine, save_dir))
    if train_iters is not None:
        runtime.set_trace(train_iters)
    step = runtime.start()
    if step != engine.global_steps and job.incarnation == 0:
        raise RuntimeError(f"runtime step {step} != engine step {engine.global_steps}")
    return MeCeFOEngine(engine, runtime, cfg, mb)
