"""MeCeFO inside Megatron-DeepSpeed's own `pretrain()`: the hooks `install()` puts into
`megatron.initialize` and `megatron.training` (all are module globals that upstream calls by name).

How the job looks to Megatron-DeepSpeed (as in `deepspeed_hook`, and why): torch.distributed, its
`mpu` and the DeepSpeed engine span one replica only (its tensor-parallel ranks; data-parallel size
1 as far as they know), so no upstream collective ever waits on a failed rank of another replica.
Data parallelism across replicas belongs to the runtime. The consequences, handled here:

* init (`_initialize_distributed`): torch.distributed is initialised over the replica before
  upstream's own init, which then skips `init_process_group` and builds `mpu` over the replica.
* ds_config: rewritten per replica (train_batch_size = micro batch x micro-batches) and checked
  against the original data-parallel size; DeepSpeed's data-parallel all-reduce is off.
* the model (`setup_model_and_optimizer`): MeCeFO's covering path on the model's layers
  (layers.py); after upstream has built the engine and loaded `--load`, the rank joins the job
  (a restarted rank receives the live state, iteration and sample counters included).
* a step (`train_step`): the plan's micro-batches (own, then a failed neighbour's), each drawn from
  the training set exactly as Megatron's `MegatronPretrainingSampler` would give it to that
  data-parallel rank; reduce, commit, optimizer step; a failed step is redone by the survivors.
  With DeepSpeed's pipeline engine the micro-batches run through its own schedule inside the
  replica (`MeCeFOEngine.train_batch`; the engine's grid spans the replica's T x P ranks).
  The consumed-sample and token counters advance by the whole global batch.
* evaluation: every replica evaluates the whole global eval batch per eval iteration (what all
  data-parallel ranks together evaluate upstream), with no cross-replica collective; so the
  validation loss equals an unpatched run's.
* checkpoints and logs: one replica (the lowest live) saves; the others' log lines are silenced.
  With ds_config "zero_optimization.stage": 1 the optimizer state is sharded over the replicas
  (elastic/sharding/zero.py; the engine runs stage 0) and every rank writes its shards beside upstream's files.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Dict, Optional

import torch

from megatron_mecefo.config import LaunchEnv, MeCeFOConfig
from megatron_mecefo.elastic.comm.groups import default_backend
from megatron_mecefo.integrations.common import (State, UsageError, arg_counters, data_prefixes, keep_training_set,
                                                  init_replica_then_upstream, micro_batch, refuse, shared_refusals,
                                                  usage_errors)

__all__ = ["UsageError", "State", "STATE", "check_args", "wrap_initialize_distributed", "wrap_setup_model_and_optimizer",
           "wrap_train_step", "wrap_datasets", "wrap_evaluate"]


STATE = State()


def read_ds_config(args) -> Dict[str, Any]:
    cfg = args.deepspeed_config
    if isinstance(cfg, dict):
        return cfg
    if getattr(args, "deepspeed_config_dict", None):
        return args.deepspeed_config_dict
    if not cfg:
        return {}
    with open(cfg, encoding="utf-8") as f:
        return json.load(f)


def check_args(args, ds_config: Dict[str, Any], cfg: MeCeFOConfig, job: LaunchEnv) -> None:
    """Refuse, before anything starts, what MeCeFO cannot run in Megatron-DeepSpeed (ValueError)."""
    from megatron_mecefo.elastic.faults.inject import check_job

    refuse([
        (not args.deepspeed, "--mecefo needs --deepspeed (Megatron's own optimizer and DDP are not supported)"),
        (getattr(args, "ds_sequence_parallel_size", 1) > 1,
         "--mecefo does not support DeepSpeed sequence parallelism (--ds-sequence-parallel-size)"),
        (getattr(args, "zero_stage", 0) == 3, "--mecefo does not support --zero-stage 3"),
        (getattr(args, "use_distributed_optimizer", False),
         '--mecefo does not support --use-distributed-optimizer with DeepSpeed: ds_config "zero_optimization.stage"=1 '
         "shards the optimizer state over the replicas"),
        (ds_config.get("zero_optimization", {}).get("stage", 0) == 1 and getattr(args, "log_optimizer_states_to_tensorboard", False),
         "--log-optimizer-states-to-tensorboard reads the whole optimizer state on every rank; with ds_config "
         '"zero_optimization.stage"=1 MeCeFO shards it over the replicas: drop the flag'),
        (max(getattr(args, "num_experts", None) or [1]) > 1, "--mecefo does not support MoE (--num-experts > 1)"),
        (bool(getattr(args, "mos", False) or getattr(args, "kd", False)),
         "--mecefo does not support knowledge distillation (--mos / --kd)"),
        (bool(getattr(args, "curriculum_learning_legacy", False) or
              getattr(args, "data_efficiency_curriculum_learning", False) or getattr(args, "random_ltd", False)),
         "--mecefo does not support curriculum learning or random-LTD"),
        ("compression_training" in ds_config, '--mecefo does not support ds_config "compression_training"'),
        (getattr(args, "transformer_impl", "local") != "local", "--mecefo supports --transformer-impl local only"),
        (args.virtual_pipeline_model_parallel_size is not None,
         "--mecefo does not support a virtual pipeline (--num-layers-per-virtual-pipeline-stage)"),
    ] + shared_refusals(args))
    cfg.check_ds_config(ds_config)
    check_job(cfg, job.world, model_parallel=args.tensor_model_parallel_size * args.pipeline_model_parallel_size,
              train_iters=args.train_iters, max_restarts=cfg.restarts(job))


# -- init -----------------------------------------------------------------------------------------

def wrap_initialize_distributed(original: Callable) -> Callable:
    """`megatron.initialize._initialize_distributed`: with --mecefo, torch.distributed over this
    rank's replica first (the job's store, a restarted replica's rendezvous), then upstream's."""

    def _initialize_distributed(*a, **kw):
        from megatron import get_args

        args = get_args()
        with usage_errors():
            ds_config = read_ds_config(args)
            cfg = MeCeFOConfig.from_args(args, ds_config.get("mecefo"))
            if not cfg.enable:
                return original(*a, **kw)
            job = LaunchEnv.read()
            check_args(args, ds_config, cfg, job)
        from megatron_mecefo.deepspeed_hook.initialize import skip_cpu_shm_build

        skip_cpu_shm_build()
        return init_replica_then_upstream(STATE, cfg, original, a, kw, args=args, backend=default_backend())

    return _initialize_distributed


# -- model, engine, join --------------------------------------------------------------------------

def wrap_setup_model_and_optimizer(original: Callable) -> Callable:
    def setup_model_and_optimizer(model_provider_func, model_type, *a, **kw):
        if not STATE.active:
            return original(model_provider_func, model_type, *a, **kw)
        from megatron import get_args, get_num_microbatches

        from megatron_mecefo.deepspeed_hook.ds_config import engine_clipping, overlap_bucket, replica_ds_config, zero_stage
        from megatron_mecefo.deepspeed_hook.initialize import wrap_engine
        from megatron_mecefo.deepspeed_hook.pipeline import pipeline_sends_in_groups
        from megatron_mecefo.deepspeed_hook.zero_checkpoint import skip_zero_optimizer
        from megatron_mecefo.integrations.megatron_deepspeed.layers import wrap_model

        args, cfg = get_args(), STATE.cfg
        sharded = zero_stage(args.deepspeed_config_dict) == 1  # MeCeFO's, over the replicas (the engine runs 0)
        overlap = overlap_bucket(args.deepspeed_config_dict)  # MeCeFO's too (the replica's ds_config drops it)
        with usage_errors():
            ds_config, k, mb = replica_ds_config(args.deepspeed_config_dict, STATE.dp)
        if k != get_num_microbatches() or mb != args.micro_batch_size:
            raise UsageError(f"ds_config gives {k} micro-batches of {mb} per replica, Megatron's flags "
                             f"{get_num_microbatches()} of {args.micro_batch_size} (--global-batch-size / "
                             "--micro-batch-size / data-parallel size): make them agree")
        # upstream's schedules (evaluation) set the accumulation boundary themselves, which DeepSpeed
        # allows in managed mode only; train_step sets it before each step (one step() per step)
        ds_config.pop("managed_gradient_accumulation", None)
        # sharded: the engine clips with the norm of the reduce-scattered gradients (DeepSpeed's
        # clipping over TP stays as upstream has it otherwise)
        clip = engine_clipping(ds_config, model_parallel=1, sharded=sharded)
        args.deepspeed_config_dict = ds_config

        def provider(*pa, **pk):
            with usage_errors():
                return wrap_model(model_provider_func(*pa, **pk), cfg.rank if cfg.lowrank_ffn else None)

        pipeline = not args.no_pipeline_parallel  # DeepSpeed's pipeline engine (GPTModelPipe)
        if pipeline:
            pipeline_sends_in_groups()
        with usage_errors(), skip_zero_optimizer():  # a ZeRO checkpoint's optimizer: read by the sharded state
            model, optimizer, scheduler = original(provider, model_type, *a, **kw)  # loads --load on every rank
        engine = model[0]

        counters = arg_counters(args, ("iteration", "consumed_train_samples", "consumed_valid_samples",
                                       "consumed_train_tokens"), STATE.record)

        def save():
            from megatron.checkpointing import save_checkpoint

            save_checkpoint(args.iteration, model, optimizer, scheduler)
            return os.path.join(args.save, f"global_step{args.iteration}")

        engine.global_steps = args.iteration  # upstream's counter of record; equal after a DeepSpeed load
        # legacy models load only their save format; a PipelineModule's state_dict is its save format
        module_state = ((engine.module.state_dict, engine.module.load_state_dict) if pipeline else
                        (engine.module.state_dict_for_save_checkpoint, engine.module.load_state_dict))
        with usage_errors():  # a checkpoint's optimizer state that does not fit this job
            STATE.driver = wrap_engine(engine, cfg, STATE.job, tensor_parallel=args.tensor_model_parallel_size,
                                       pipeline_parallel=args.pipeline_model_parallel_size, micro_batches=k,
                                       micro_batch_size=mb, train_iters=args.train_iters, save=save if args.save else None,
                                       sharded=sharded, save_dir=args.save, load_dir=args.load, clip_grad=clip,
                                       load_optimizer=not args.no_load_optim, overlap_bucket=overlap,
                                       extra_state=counters, module_state=module_state)
        STATE.sharded = sharded
        if sharded and not hasattr(engine.optimizer, "cur_scale"):
            # upstream's log line reads the loss scale of DeepSpeed's ZeRO optimizer (1.0 outside
            # fp16); the engine steps a plain optimizer here: the line keeps upstream's field
            engine.optimizer.cur_scale = 1.0
        if sharded and args.save:
            STATE.save_shards = lambda iteration: STATE.driver.save_shards(args.save)
        if STATE.lead() and not STATE.driver.runtime.rejoined:
            print(STATE.driver.driver.banner(args.iteration), flush=True)
        return model, optimizer, scheduler

    return setup_model_and_optimizer


def index_cache_dir(args) -> Optional[str]:
    """Where upstream writes the datasets' index files: --data-cache-path, else index-cache/ next
    to the (first) data prefix."""
    if args.data_cache_path:
        return args.data_cache_path
    prefixes = data_prefixes(args)
    return os.path.join(os.path.dirname(prefixes[0]), "index-cache") if prefixes else None


def wrap_datasets(original: Callable) -> Callable:
    """`megatron.training.build_train_valid_test_datasets`: keep the training set (common.keep_training_set)."""

    def cache_dir():
        from megatron import get_args

        return index_cache_dir(get_args())

    return keep_training_set(original, STATE, cache_dir)


# -- the step -------------------------------------------------------------------------------------

def wrap_train_step(original: Callable) -> Callable:
    def train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config):
        if not STATE.active:
            return original(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config)
        from megatron import get_args
        from megatron.core import mpu

        args, engine = get_args(), STATE.driver
        if engine.global_steps != args.iteration:
            raise RuntimeError(f"DeepSpeed's global_steps {engine.global_steps} != Megatron's iteration {args.iteration}")
        k, mbs = engine.runtime.k, args.micro_batch_size
        reads_data = mpu.get_tensor_model_parallel_rank() == 0  # the others receive it by broadcast
        if reads_data and STATE.train_ds is None:
            raise RuntimeError("MeCeFO has no training set: build_train_valid_test_datasets was not called")
        consumed = args.consumed_train_samples
        increment = k * mbs * args.data_parallel_size  # the scheduler counts the whole global batch

        def draw(mb):
            return micro_batch(STATE.train_ds, consumed, mb.replica, mb.index, micro_batch_size=mbs, dp=STATE.dp)

        def one_pass(plan):
            for mb in engine.micro_batches():
                output, loss_func = forward_step_func(iter([draw(mb)]) if reads_data else None, engine)
                engine.backward(loss_func(output)[0])
                engine.step(lr_kwargs={"increment": increment})

        def one_pipeline_pass(plan):  # DeepSpeed's schedule; only its first and last stages read data
            engine.train_batch((draw(mb) for mb in plan.micro_batches) if reads_data else None,
                               lr_kwargs={"increment": increment})

        if engine.pipeline:
            engine.driver.run(args.iteration, one_pipeline_pass)
            loss = engine.agg_train_loss.reshape(1).float()  # the job's loss, on every stage
        else:
            engine.set_gradient_accumulation_boundary(True)  # step() runs once, after the plan's micro-batches
            engine.driver.run(args.iteration, one_pass)  # a failed step is redone by the survivors
            loss = torch.tensor([engine.last_loss], dtype=torch.float32)
        # upstream's train() adds mpu's data-parallel size (1: the replica) x mbs x k; the rest of the
        # global batch was consumed too (by the other replicas, or by this one covering)
        rest = (STATE.dp - 1) * mbs * k
        args.consumed_train_samples += rest
        args.consumed_train_tokens += rest * args.seq_length
        # what upstream's train_step returns: (losses, skipped, grad norm, zeros); its pipeline
        # branch counts zeros as 0, which its line prints
        return {"lm loss": loss}, 0, None, 0 if engine.pipeline else None

    return train_step


# -- evaluation, checkpoints, logs ----------------------------------------------------------------

def wrap_evaluate(original: Callable, training_module) -> Callable:
    """`megatron.training.evaluate`: each eval iteration runs the whole global eval batch (dp x k
    micro-batches of the replica's sequential sampler: the samples all data-parallel ranks evaluate
    together upstream), so no cross-replica collective is needed and the loss is an unpatched run's."""

    def evaluate(*a, **kw):
        if not STATE.active:
            return original(*a, **kw)
        per_replica = training_module.get_num_microbatches
        training_module.get_num_microbatches = lambda: per_replica() * STATE.dp
        engine = STATE.driver.engine
        if STATE.driver.pipeline:  # DeepSpeed's eval_batch runs engine.micro_batches
            engine.micro_batches = per_replica() * STATE.dp
        try:
            return original(*a, **kw)
        finally:
            training_module.get_num_microbatches = per_replica
            if STATE.driver.pipeline:
                engine.micro_batches = per_replica()

    return evaluate
