"""MeCeFO inside Megatron-DeepSpeed's own `pretrain()`: the hooks that patches.py puts into
`megatron.initialize` and `megatron.training` for one run (module globals that upstream calls by
name), each given the run's `Run`.

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

import os
from typing import Callable, Optional

import torch

from megatron_mecefo.config import MeCeFOConfig
from megatron_mecefo.elastic.comm.groups import default_backend
from megatron_mecefo.integrations.data import data_prefixes, keep_training_set, step_draw
from megatron_mecefo.integrations.megatron_deepspeed.args import check_args, read_ds_config
from megatron_mecefo.integrations.run import Run, checked_config, init_replica_then_upstream
from megatron_mecefo.integrations.saves import arg_counters
from megatron_mecefo.integrations.usage import UsageError, usage_errors

__all__ = ["wrap_initialize_distributed", "wrap_setup_model_and_optimizer", "wrap_train_step", "wrap_datasets",
           "wrap_evaluate"]


# -- init -----------------------------------------------------------------------------------------

def wrap_initialize_distributed(original: Callable, run: Run) -> Callable:
    """`megatron.initialize._initialize_distributed`: with --mecefo, torch.distributed over this
    rank's replica first (the job's store, a restarted replica's rendezvous), then upstream's."""

    def _initialize_distributed(*a, **kw):
        from megatron import get_args

        args = get_args()
        with usage_errors():
            ds_config = read_ds_config(args)
        cfg = checked_config(lambda: MeCeFOConfig.from_args(args, ds_config.get("mecefo")),
                             lambda cfg, job: check_args(args, ds_config, cfg, job))
        if cfg is None:
            return original(*a, **kw)
        return init_replica_then_upstream(run, cfg, original, a, kw, args=args, backend=default_backend())

    return _initialize_distributed


# -- model, engine, join --------------------------------------------------------------------------

def wrap_setup_model_and_optimizer(original: Callable, run: Run) -> Callable:
    def setup_model_and_optimizer(model_provider_func, model_type, *a, **kw):
        if not run.active:
            return original(model_provider_func, model_type, *a, **kw)
        from megatron import get_args, get_num_microbatches

        from megatron_mecefo.deepspeed_hook.ds_config import engine_clipping, overlap_bucket, replica_ds_config, zero_stage
        from megatron_mecefo.deepspeed_hook.initialize import wrap_engine
        from megatron_mecefo.deepspeed_hook.zero_checkpoint import skip_zero_optimizer
        from megatron_mecefo.integrations.megatron_deepspeed.layers import wrap_model

        args, cfg = get_args(), run.cfg
        sharded = zero_stage(args.deepspeed_config_dict) == 1  # MeCeFO's, over the replicas (the engine runs 0)
        overlap = overlap_bucket(args.deepspeed_config_dict)  # MeCeFO's too (the replica's ds_config drops it)
        with usage_errors():
            ds_config, k, mb = replica_ds_config(args.deepspeed_config_dict, run.dp)
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
        with usage_errors(), skip_zero_optimizer():  # a ZeRO checkpoint's optimizer: read by the sharded state
            model, optimizer, scheduler = original(provider, model_type, *a, **kw)  # loads --load on every rank
        engine = model[0]

        counters = arg_counters(args, ("iteration", "consumed_train_samples", "consumed_valid_samples",
                                       "consumed_train_tokens"), run.record)

        def save():
            from megatron.checkpointing import save_checkpoint

            save_checkpoint(args.iteration, model, optimizer, scheduler)
            return os.path.join(args.save, f"global_step{args.iteration}")

        engine.global_steps = args.iteration  # upstream's counter of record; equal after a DeepSpeed load
        # legacy models load only their save format; a PipelineModule's state_dict is its save format
        module_state = ((engine.module.state_dict, engine.module.load_state_dict) if pipeline else
                        (engine.module.state_dict_for_save_checkpoint, engine.module.load_state_dict))
        with usage_errors():  # a checkpoint's optimizer state that does not fit this job
            run.host = wrap_engine(engine, cfg, run.job, tensor_parallel=args.tensor_model_parallel_size,
                                       pipeline_parallel=args.pipeline_model_parallel_size, micro_batches=k,
                                       micro_batch_size=mb, train_iters=args.train_iters, save=save if args.save else None,
                                       sharded=sharded, save_dir=args.save, load_dir=args.load, clip_grad=clip,
                                       load_optimizer=not args.no_load_optim, overlap_bucket=overlap,
                                       extra_state=counters, module_state=module_state)
        run.sharded = sharded
        if sharded and not hasattr(engine.optimizer, "cur_scale"):
            # upstream's log line reads the loss scale of DeepSpeed's ZeRO optimizer (1.0 outside
            # fp16); the engine steps a plain optimizer here: the line keeps upstream's field
            engine.optimizer.cur_scale = 1.0
        if sharded and args.save:
            run.save_shards = lambda iteration: run.host.save_shards(args.save)
        if run.lead() and not run.driver.runtime.rejoined:
            print(run.driver.banner(args.iteration), flush=True)
        return model, optimizer, scheduler

    return setup_model_and_optimizer


def index_cache_dir(args) -> Optional[str]:
    """Where upstream writes the datasets' index files: --data-cache-path, else index-cache/ next
    to the (first) data prefix."""
    if args.data_cache_path:
        return args.data_cache_path
    prefixes = data_prefixes(args)
    return os.path.join(os.path.dirname(prefixes[0]), "index-cache") if prefixes else None


def wrap_datasets(original: Callable, run: Run) -> Callable:
    """`megatron.training.build_train_valid_test_datasets`: keep the training set (common.keep_training_set)."""

    def cache_dir():
        from megatron import get_args

        return index_cache_dir(get_args())

    return keep_training_set(original, run, cache_dir)


# -- the step -------------------------------------------------------------------------------------

def wrap_train_step(original: Callable, run: Run) -> Callable:
    def train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config):
        if not run.active:
            return original(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config)
        from megatron import get_args
        from megatron.core import mpu

        args, engine = get_args(), run.host
        if engine.global_steps != args.iteration:
            raise RuntimeError(f"DeepSpeed's global_steps {engine.global_steps} != Megatron's iteration {args.iteration}")
        reads_data = mpu.get_tensor_model_parallel_rank() == 0  # the others receive it by broadcast
        draw = step_draw(run, args, reads_data)
        increment = engine.runtime.k * args.micro_batch_size * args.data_parallel_size  # the global batch

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
        # upstream's train() counted the one replica it sees
        rest = engine.driver.samples_of_other_replicas()
        args.consumed_train_samples += rest
        args.consumed_train_tokens += rest * args.seq_length
        # what upstream's train_step returns: (losses, skipped, grad norm, zeros); its pipeline
        # branch counts zeros as 0, which its line prints
        return {"lm loss": loss}, 0, None, 0 if engine.pipeline else None

    return train_step


# -- evaluation, checkpoints, logs ----------------------------------------------------------------

def wrap_evaluate(original: Callable, run: Run, training_module) -> Callable:
    """`megatron.training.evaluate`: each eval iteration runs the whole global eval batch (dp x k
    micro-batches of the replica's sequential sampler: the samples all data-parallel ranks evaluate
    together upstream), so no cross-replica collective is needed and the loss is an unpatched run's."""

    def evaluate(*a, **kw):
        if not run.active:
            return original(*a, **kw)
        per_replica = training_module.get_num_microbatches
        training_module.get_num_microbatches = lambda: per_replica() * run.dp
        engine = run.host.engine
        if run.host.pipeline:  # DeepSpeed's eval_batch runs engine.micro_batches
            engine.micro_batches = per_replica() * run.dp
        try:
            return original(*a, **kw)
        finally:
            training_module.get_num_microbatches = per_replica
            if run.host.pipeline:
                engine.micro_batches = per_replica()

    return evaluate
