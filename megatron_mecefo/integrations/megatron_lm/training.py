"""MeCeFO inside Megatron-LM's own `pretrain()` (core_v0.16.1): the hooks `install()` puts into
`megatron.training.initialize` and `megatron.training.training` (module globals that upstream
calls by name).

How the job looks to Megatron-LM (as in the other integrations, and why): torch.distributed,
`parallel_state` and Megatron's DDP span one replica only (its tensor-parallel ranks;
data-parallel size 1 as far as they know), so no upstream collective ever waits on a failed rank
of another replica, and no group Megatron caches (DDP's buckets, the optimizer's, `pg_collection`)
needs rebuilding after a failure. Data parallelism across replicas belongs to the runtime, which
reduces the DDP gradient buffers (`main_grad`) itself. The consequences, handled here:

* init (`_initialize_distributed`): torch.distributed over the replica first, on the job's store;
  upstream's own init then skips `init_process_group` and builds `parallel_state` over the replica.
  `args.data_parallel_size` stays the job's, so Megatron's micro-batch count per replica (k) and
  its global batch are the job's.
* the model: MeCeFO's layer spec; after upstream has built model, optimizer and scheduler and
  loaded `--load`, the rank joins the job (a restarted rank receives the live state, counters
  included).
* a step (`train_step`, step.py): upstream's own `train_step` runs the plan's micro-batches (own,
  then a failed neighbour's, each drawn as Megatron's `MegatronPretrainingSampler` gives it to
  that data-parallel rank); its `optimizer.step()` first reduces and commits; a failed step is
  redone by the survivors. The consumed-sample counter advances by the whole global batch.
* evaluation: every replica evaluates the whole global eval batch per eval iteration, so the
  validation loss equals an unpatched run's.
* `--use-distributed-optimizer`: upstream's distributed optimizer would shard over the replica's
  data-parallel group (size 1 here). Upstream builds its plain optimizer instead, and the runtime
  shards that optimizer's state over the live replicas (elastic/sharding/zero.py, each shard also on its
  covering neighbour). Checkpoints: upstream's files (model, scheduler, RNG, counters, the fp32
  parameters; no moments) from one replica, plus every rank's shard files in the same `iter_N`
  directory; `--load` reads them at any replica count.
* checkpoints and logs: one replica (the lowest live) saves; the others' log lines are silenced.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
from typing import Callable, Optional

import torch

from megatron_mecefo.config import LaunchEnv, MeCeFOConfig
from megatron_mecefo.integrations.common import (State, UsageError, arg_counters, data_prefixes, keep_training_set,
                                                  init_replica_then_upstream, micro_batch, refuse, shared_refusals,
                                                  usage_errors)
from megatron_mecefo.integrations.megatron_lm import checkpoint

__all__ = ["UsageError", "State", "STATE", "SPEC", "check_args", "wrap_initialize_distributed",
           "wrap_setup_model_and_optimizer", "wrap_load_checkpoint", "wrap_train_step", "wrap_datasets",
           "wrap_evaluate"]

SPEC = ["megatron_mecefo.layers.specs", "mecefo_gpt_layer_spec"]
"""`--spec` of MeCeFO's GPT layer (Megatron-Core's local layer with the covering backward)."""


STATE = State()


def check_args(args, cfg: MeCeFOConfig, job: LaunchEnv) -> None:
    """Refuse, before anything starts, what MeCeFO cannot run in Megatron-LM (ValueError)."""
    from megatron_mecefo.elastic.faults.inject import check_job

    spec = list(args.spec) if args.spec else None
    refuse(shared_refusals(args) + [
        (args.context_parallel_size != 1, "--mecefo does not support context parallelism (--context-parallel-size)"),
        (args.expert_model_parallel_size != 1 or bool(args.num_experts),
         "--mecefo does not support MoE (--num-experts / --expert-model-parallel-size)"),
        (bool(getattr(args, "use_torch_fsdp2", False) or getattr(args, "use_megatron_fsdp", False)),
         "--mecefo does not support FSDP (--use-torch-fsdp2 / --use-megatron-fsdp)"),
        (args.overlap_param_gather,
         "--mecefo does not support --overlap-param-gather (with --use-distributed-optimizer MeCeFO gathers the "
         "parameters after its sharded update)"),
        (args.fp16, "--mecefo does not support --fp16 yet (a dynamic loss scale skips steps): use --bf16 or fp32"),
        (args.calculate_per_token_loss, "--mecefo does not support --calculate-per-token-loss"),
        (args.use_distributed_optimizer and args.log_num_zeros_in_grad,
         "--log-num-zeros-in-grad counts zeros in the whole gradient; with --use-distributed-optimizer MeCeFO "
         "reduce-scatters it over the replicas: drop the flag"),
        (bool(getattr(args, "decrease_batch_size_if_needed", False)), "--mecefo does not support --decrease-batch-size-if-needed"),
        (args.data_parallel_random_init,
         "--mecefo does not support --data-parallel-random-init (replicas must start identical)"),
        (args.transformer_impl != "local",
         f"--mecefo needs --transformer-impl local (got {args.transformer_impl}): MeCeFO's covering backward is "
         "built on Megatron-Core's local layers"),
        (spec is not None and spec != SPEC,
         f"--mecefo uses its own layer spec ({' '.join(SPEC)}); drop --spec {' '.join(spec or [])}"),
        (bool(getattr(args, "inprocess_restart", False)),
         "--mecefo replaces --inprocess-restart (two fault-tolerance mechanisms would fight): drop one"),
        (args.cuda_graph_impl != "none", "--mecefo does not support CUDA graphs (--cuda-graph-impl)"),
        (bool(getattr(args, "multi_latent_attention", False)), "--mecefo does not support multi-latent attention"),
        (bool(getattr(args, "mtp_num_layers", None)), "--mecefo does not support multi-token prediction"),
        (bool(getattr(args, "perform_rl_step", False)), "--mecefo does not support RL training"),
    ])
    check_job(cfg, job.world, model_parallel=args.tensor_model_parallel_size * args.pipeline_model_parallel_size,
              train_iters=args.train_iters, max_restarts=cfg.restarts(job))


# -- init -----------------------------------------------------------------------------------------

def wrap_initialize_distributed(original: Callable) -> Callable:
    """`megatron.training.initialize._initialize_distributed`: with --mecefo, torch.distributed over
    this rank's replica first (the job's store, a restarted replica's rendezvous), then upstream's."""

    def _initialize_distributed(*a, **kw):
        from megatron.training import get_args

        args = get_args()
        with usage_errors():
            cfg = MeCeFOConfig.from_args(args)
            if not cfg.enable:
                return original(*a, **kw)
            job = LaunchEnv.read()
            check_args(args, cfg, job)
        if torch.cuda.is_available() and torch.cuda.device_count() > 0:
            torch.cuda.set_device(args.local_rank)  # upstream sets it only when it initialises itself
        # the replica's tensor-parallel groups carry training collectives: a hung mate is noticed
        # after collective_timeout_s, not Megatron's default 10 minutes
        args.distributed_timeout_minutes = cfg.collective_timeout_s / 60
        args.spec = list(SPEC)
        return init_replica_then_upstream(STATE, cfg, original, a, kw, args=args, backend=args.distributed_backend,
                                          distributed_timeout_minutes=args.distributed_timeout_minutes)

    return _initialize_distributed


# -- model, optimizer, join -----------------------------------------------------------------------

def wrap_setup_model_and_optimizer(original: Callable) -> Callable:
    def setup_model_and_optimizer(model_provider_func, model_type, *a, **kw):
        if not STATE.active:
            return original(model_provider_func, model_type, *a, **kw)
        from megatron.core.num_microbatches_calculator import get_num_microbatches
        from megatron.training import get_args
        from megatron.training.checkpointing import get_checkpoint_name, save_checkpoint

        from megatron_mecefo.approx import Coverable
        from megatron_mecefo.elastic.attach import attach
        from megatron_mecefo.elastic.give_up import SHARDS_VISIBLE_S
        from megatron_mecefo.elastic.runtime import StateHooks
        from megatron_mecefo.elastic.step import training_state
        from megatron_mecefo.integrations.megatron_lm.optimizer import sharded_state
        from megatron_mecefo.integrations.megatron_lm.step import Step
        from megatron_mecefo.layers.linear import check_lowrank_rank

        args, cfg = get_args(), STATE.cfg
        # the runtime shards over the replicas; upstream's optimizer stays plain (its data-parallel group is 1)
        STATE.sharded, args.use_distributed_optimizer = bool(args.use_distributed_optimizer), False
        checkpoint.check_loaded_optimizer(args, STATE.sharded)
        with _no_fp32_copies(STATE.sharded and args.bf16):
            model, optimizer, scheduler = original(model_provider_func, model_type, *a, **kw)  # loads --load
        if not any(isinstance(m, Coverable) for chunk in model for m in chunk.modules()):
            raise UsageError(f"the model has no MeCeFO layers: build it with --spec {' '.join(SPEC)}")
        if cfg.lowrank_ffn:
            with usage_errors():
                check_lowrank_rank(model[0], cfg.rank, key="--mecefo-rank")

        counters = arg_counters(args, ("iteration", "consumed_train_samples", "consumed_valid_samples",
                                       "skipped_train_samples", "num_floating_point_operations_so_far"), STATE.record)

        def save():  # the give-up checkpoint: the holders wrote their shards (stamp ""), gathered here
            around = None
            if shards is not None:
                around = checkpoint.gathered(args, model, optimizer, shards, shard_dir(), stamp="",
                                             timeout_s=SHARDS_VISIBLE_S, log=logging.getLogger(__name__))
            with around or contextlib.nullcontext():
                save_checkpoint(args.iteration, model, optimizer, scheduler, args.num_floating_point_operations_so_far)
            return os.path.join(args.save, f"iter_{args.iteration:07d}")

        def shard_dir(iteration=None):
            return get_checkpoint_name(args.save, args.iteration if iteration is None else iteration,
                                       return_base_dir=True)

        with usage_errors():  # an optimizer the sharded state cannot step; shard files that do not cover it
            shards = sharded_state(optimizer, cfg, STATE.job, args.tensor_model_parallel_size,
                                   args.pipeline_model_parallel_size) if STATE.sharded else None
            state = StateHooks(*training_state(Step.model_state(model), optimizer, scheduler, counters),
                               save_checkpoint=save if args.save else None,
                               save_shards=(lambda: shards.save(shard_dir())) if shards is not None and args.save else None)
            driver = attach(cfg, STATE.job, Step.host(model, optimizer), micro_batches=get_num_microbatches(),
                            micro_batch_size=args.micro_batch_size, state=state,
                            current_step=lambda: counters[0]()["iteration"],
                            tensor_parallel=args.tensor_model_parallel_size,
                            pipeline_parallel=args.pipeline_model_parallel_size, sharding=shards,
                            load_shards=(checkpoint.loaded_optimizer_state(args, model, shards)
                                         if shards is not None and args.iteration > 0 else None),
                            train_iters=args.train_iters, backend=args.distributed_backend)
        STATE.driver = Step(driver, model, overlap=args.overlap_grad_reduce)
        if shards is not None and args.save:
            STATE.save_shards = checkpoint.shard_saver(args, model, optimizer, shards, shard_dir, STATE,
                                                       driver.runtime.log)
        if STATE.lead() and not driver.runtime.rejoined:
            print(driver.banner(args.iteration), flush=True)
        return model, optimizer, scheduler

    return setup_model_and_optimizer


@contextlib.contextmanager
def _no_fp32_copies(active: bool):
    """`--bf16` with the sharded state: upstream builds its FP32Optimizer over the bf16 parameters
    (as its layer-wise optimizer does, optimizer/muon.py) instead of a mixed-precision wrapper with
    fp32 copies of every parameter on every rank; the sharded state keeps the fp32 masters of its
    held ranges only (elastic/sharding/zero.py; optimizer.py's `bf16_parameters`)."""
    import megatron.training.training as training

    build = training.get_megatron_optimizer
    if not active:
        yield
        return

    def get_megatron_optimizer(config, *a, **kw):
        config = copy.copy(config)
        config.bf16 = False
        return build(config, *a, **kw)

    training.get_megatron_optimizer = get_megatron_optimizer
    try:
        yield
    finally:
        training.get_megatron_optimizer = build


def wrap_load_checkpoint(original: Callable) -> Callable:
    """`megatron.training.training.load_checkpoint` (checkpoint.py)."""
    return checkpoint.wrap_load_checkpoint(original, STATE)


def wrap_datasets(original: Callable) -> Callable:
    """`megatron.training.training.build_train_valid_test_datasets`: keep the training set
    (common.keep_training_set; the lock is in --data-cache-path, else next to the data)."""

    def cache_dir() -> Optional[str]:
        from megatron.training import get_args

        args = get_args()
        if args.mock_data:
            return None
        if args.data_cache_path:
            os.makedirs(args.data_cache_path, exist_ok=True)
            return args.data_cache_path
        prefixes = data_prefixes(args)
        return os.path.dirname(os.path.abspath(prefixes[0])) if prefixes else None

    return keep_training_set(original, STATE, cache_dir)


# -- the step -------------------------------------------------------------------------------------

def wrap_train_step(original: Callable) -> Callable:
    def train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config,
                   forward_backward_func, iteration=None):
        if not STATE.active:
            return original(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config,
                            forward_backward_func, iteration=iteration)
        from megatron.core import mpu
        from megatron.training import get_args

        args, step = get_args(), STATE.driver
        k, mbs = step.runtime.k, args.micro_batch_size
        # upstream's get_batch: the first and last stages read (tensor-parallel rank 0; its mates
        # receive by broadcast), the middle stages take their input from the previous stage
        reads_data = mpu.get_tensor_model_parallel_rank() == 0 and (
            mpu.is_pipeline_first_stage(ignore_virtual=True) or mpu.is_pipeline_last_stage(ignore_virtual=True))
        if reads_data and STATE.train_ds is None:
            raise RuntimeError("MeCeFO has no training set: build_train_valid_test_datasets was not called")
        consumed = args.consumed_train_samples

        def batches(plan):
            if not reads_data:
                return None
            return (micro_batch(STATE.train_ds, consumed, mb.replica, mb.index, micro_batch_size=mbs, dp=STATE.dp)
                    for mb in plan.micro_batches)

        at = iteration if iteration is not None else args.iteration  # train() counts in a local
        out = step.run(original, forward_step_func, model, optimizer, opt_param_scheduler, config,
                       forward_backward_func, batches, iteration=at)
        if step.last_committed:
            # upstream's train() adds parallel_state's data-parallel size (1: the replica) x mbs x k;
            # the rest of the global batch was consumed too (by the other replicas, or by this one
            # covering). args.iteration is what a rejoining rank and a give-up checkpoint read.
            args.consumed_train_samples += (STATE.dp - 1) * mbs * k
            args.iteration = at + 1
        return out

    return train_step


# -- evaluation, checkpoints, logs ----------------------------------------------------------------

def wrap_evaluate(original: Callable) -> Callable:
    """`megatron.training.training.evaluate`: each eval iteration runs the whole global eval batch
    (global batch / micro batch micro-batches of the replica's sequential sampler: the samples all
    data-parallel ranks evaluate together upstream), so no cross-replica collective is needed and
    the loss is an unpatched run's."""

    def evaluate(*a, **kw):
        if not STATE.active:
            return original(*a, **kw)
        from megatron.training import get_args

        args = get_args()
        dp, args.data_parallel_size = args.data_parallel_size, 1
        try:
            return original(*a, **kw)
        finally:
            args.data_parallel_size = dp

    return evaluate
