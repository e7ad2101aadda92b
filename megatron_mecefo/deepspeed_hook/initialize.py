"""`deepspeed.initialize` with MeCeFO, and the join of an engine built by someone else (Megatron-
DeepSpeed's `setup_model_and_optimizer`): both end in the composition root (elastic/attach.py)."""

from __future__ import annotations

import contextlib
import os
from typing import Any, Dict, Optional

import torch

from megatron_mecefo.config import LaunchEnv, MeCeFOConfig
from megatron_mecefo.deepspeed_hook.checkpoint import load_checkpoint, restrict_checkpoint_loading, save_checkpoint
from megatron_mecefo.deepspeed_hook.ds_config import (bf16_parameters, engine_clipping, overlap_bucket,
                                                      replica_ds_config, zero_stage)
from megatron_mecefo.deepspeed_hook.engine import MeCeFOEngine
from megatron_mecefo.deepspeed_hook.zero_checkpoint import (skip_zero_optimizer, tag_dir, write_zero_checkpoint, zero_files,
                                                            zero_state)
from megatron_mecefo.elastic.attach import attach
from megatron_mecefo.elastic.comm.groups import default_backend
from megatron_mecefo.elastic.give_up import collect_given_up
from megatron_mecefo.elastic.launch.bootstrap import init_distributed, replica_groups_time_out
from megatron_mecefo.elastic.interface import StateHooks
from megatron_mecefo.elastic.sharding.zero import ShardedOptimizer, innermost_optimizer
from megatron_mecefo.elastic.step import training_state

__all__ = ["initialize", "wrap_engine", "cpu_shm_build_skipped"]


@contextlib.contextmanager
def cpu_shm_build_skipped():
    """DeepSpeed's CPU accelerator JIT-builds a shared-memory communication op (about 35 s) that
    MeCeFO's gloo groups never use: off while the block runs (`deepspeed.init_distributed`, which
    `deepspeed.initialize` calls, builds it), DeepSpeed's table as it was after."""
    import deepspeed

    ops = deepspeed.ops.__compatible_ops__
    had, before = "deepspeed_shm_comm" in ops, ops.get("deepspeed_shm_comm")
    ops["deepspeed_shm_comm"] = False
    try:
        yield
    finally:
        if had:
            ops["deepspeed_shm_comm"] = before
        else:
            ops.pop("deepspeed_shm_comm", None)


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
    with cpu_shm_build_skipped():
        engine, _, _, _ = deepspeed.initialize(
            model=model, config=ds_config, mpu=mpu,
            model_parameters=model_parameters if model_parameters is not None else [p for p in model.parameters() if p.requires_grad],
            **kwargs,
        )
    restrict_checkpoint_loading(engine)

    def load():
        with skip_zero_optimizer():  # a ZeRO checkpoint's optimizer files: read by the sharded state
            load_checkpoint(engine, load_dir)

    save = (lambda: save_checkpoint(engine, save_dir)) if save_dir is not None else None
    return wrap_engine(engine, cfg, job, tensor_parallel=tp, pipeline_parallel=pp, micro_batches=k,
                       micro_batch_size=mb, clip_grad=clip, backend=backend, train_iters=train_iters,
                       save=save, load=load if load_dir is not None else None, save_dir=save_dir,
                       load_dir=load_dir, sharded=sharded, overlap_bucket=overlap_bucket(config))


def wrap_engine(engine, cfg: MeCeFOConfig, job: LaunchEnv, *, tensor_parallel: int, pipeline_parallel: int,
                micro_batches: int, micro_batch_size: int, clip_grad: float = 0.0, backend: Optional[str] = None,
                train_iters: Optional[int] = None, save=None, load=None, extra_state=None,
                module_state=None, sharded: bool = False, save_dir: Optional[str] = None,
                load_dir: Optional[str] = None, load_optimizer: bool = True,
                overlap_bucket: Optional[int] = None) -> MeCeFOEngine:
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
        sharded: shard the engine's optimizer state over the live replicas (ZeRO-1, elastic/sharding/zero.py);
            `save_dir` / `load_dir`: where its shard files go / come from (beside DeepSpeed's);
            `load_optimizer` False: start a fresh optimizer state (Megatron's --no-load-optim).
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
        save_shards = lambda: shards.files.save(os.path.join(save_dir, f"global_step{engine.global_steps}"))  # noqa: E731
    if shards is not None and save is not None:  # the give-up checkpoint gathers the holders' shards
        save = _gathering(save, shards, engine, clip_grad)
    wrapper = MeCeFOEngine(engine, micro_batch_size=micro_batch_size, model_parallel=tensor_parallel * pipeline_parallel,
                           clip_grad=clip_grad, sharded=shards)
    load_shards = None
    if job.incarnation == 0:
        if load is not None:
            load()
        load_shards = _loaded_optimizer_state(engine, shards, load_dir) if load_optimizer else None
    state = StateHooks(*training_state((get_module, set_module), engine.optimizer, engine.lr_scheduler,
                                       (counters, set_counters)), save_checkpoint=save, save_shards=save_shards)
    driver = attach(cfg, job, wrapper.host, micro_batches=micro_batches, micro_batch_size=micro_batch_size, state=state,
                    current_step=lambda: engine.global_steps, tensor_parallel=tensor_parallel,
                    pipeline_parallel=pipeline_parallel, sharding=shards, load_shards=load_shards,
                    train_iters=train_iters, backend=backend)
    replica_groups_time_out(cfg.collective_timeout_s)  # DeepSpeed's and Megatron-DeepSpeed's groups too
    return wrapper.join(driver, overlap_bucket)


def _loaded_optimizer_state(engine, shards: Optional[ShardedOptimizer], load_dir: Optional[str]):
    """What the optimizer state starts from after DeepSpeed loaded `load_dir`: a ZeRO checkpoint's
    partitions (zero_checkpoint.py; MeCeFO writes them too), else MeCeFO's shard files (a job that
    gave up writes those), for the sharded state; None: the state
    DeepSpeed loaded (replicated), or none. Raises ValueError for a ZeRO checkpoint without the
    sharded state (its optimizer files would be left unread) or one of another model."""
    tag = tag_dir(load_dir)
    if tag is None:
        return None
    if shards is None:
        if zero_files(tag, engine.checkpoint_mp_rank):
            raise ValueError(f"{tag} holds a ZeRO optimizer state (DeepSpeed's zero_pp_rank_* files): resume it with "
                             'ds_config "zero_optimization": {"stage": 1} (MeCeFO shards it over the replicas)')
        return None
    found = zero_state(tag, [b - a for a, b in shards.group_bounds], shards.keys, engine.checkpoint_mp_rank)
    return found if found is not None or not shards.files.has_files(tag) else tag  # shard files: a give-up's


def _gathering(save, shards: ShardedOptimizer, engine, clip_grad: float):
    """The give-up checkpoint's `save`, then DeepSpeed's ZeRO file from the shards every holder wrote."""
    import logging

    def save_and_gather():
        path = save()
        got = collect_given_up(shards, path, logging.getLogger(__name__))
        if got is not None:  # else the shard files stay: MeCeFO resumes from them
            write_zero_checkpoint(shards, path, got, mp_rank=engine.checkpoint_mp_rank, clip_grad=clip_grad)
        return path

    return save_and_gather
