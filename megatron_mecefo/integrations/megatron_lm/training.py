"""MeCeFO inside Megatron-LM's own `pretrain()` (core_v0.16.1): the hooks that patches.py puts
into `megatron.training.initialize` and `megatron.training.training` for one run (module globals
that upstream calls by name), each given the run's `Run`.

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
* a step (`train_step`, host.py): upstream's own `train_step` runs the plan's micro-batches (own,
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
import logging
import os
from typing import Callable, Optional

import torch

from megatron_mecefo.config import MeCeFOConfig
from megatron_mecefo.integrations.data import data_prefixes, keep_training_set, step_draw
from megatron_mecefo.integrations.megatron_lm import checkpoint
from megatron_mecefo.integrations.megatron_lm.args import SPEC, check_args
from megatron_mecefo.integrations.run import Run, checked_config, init_replica_then_upstream
from megatron_mecefo.integrations.saves import arg_counters
from megatron_mecefo.integrations.usage import UsageError, usage_errors

__all__ = ["wrap_initialize_distributed", "wrap_setup_model_and_optimizer", "wrap_datasets",
           "wrap_train_step", "wrap_evaluate"]

# -- init -----------------------------------------------------------------------------------------

def wrap_initialize_distributed(original: Callable, run: Run) -> Callable:
    """`megatron.training.initialize._initialize_distributed`: with --mecefo, torch.distributed over
    this rank's replica first (the job's store, a restarted replica's rendezvous), then upstream's."""

    def _initialize_distributed(*a, **kw):
        from megatron.training import get_args

        args = get_args()
        cfg = checked_config(lambda: MeCeFOConfig.from_args(args), lambda cfg, job: check_args(args, cfg, job))
        if cfg is None:
            return original(*a, **kw)
        if torch.cuda.is_available() and torch.cuda.device_count() > 0:
            torch.cuda.set_device(args.local_rank)  # upstream sets it only when it initialises itself
        # the replica's tensor-parallel groups carry training collectives: a hung mate is noticed
        # after collective_timeout_s, not Megatron's default 10 minutes
        args.distributed_timeout_minutes = cfg.collective_timeout_s / 60
        args.spec = list(SPEC)
        return init_replica_then_upstream(run, cfg, original, a, kw, args=args, backend=args.distributed_backend,
                                          distributed_timeout_minutes=args.distributed_timeout_minutes)

    return _initialize_distributed


# -- model, optimizer, join -----------------------------------------------------------------------

def wrap_setup_model_and_optimizer(original: Callable, run: Run) -> Callable:
    def setup_model_and_optimizer(model_provider_func, model_type, *a, **kw):
        if not run.active:
            return original(model_provider_func, model_type, *a, **kw)
        from megatron.core.num_microbatches_calculator import get_num_microbatches
        from megatron.training import get_args
        from megatron.training.checkpointing import get_checkpoint_name, save_checkpoint

        from megatron_mecefo.approx import Coverable
        from megatron_mecefo.elastic.attach import attach
        from megatron_mecefo.elastic.give_up import collect_given_up
        from megatron_mecefo.elastic.interface import StateHooks
        from megatron_mecefo.elastic.step import training_state
        from megatron_mecefo.integrations.megatron_lm.host import MegatronLMHost
        from megatron_mecefo.integrations.megatron_lm.optimizer import no_fp32_copies, sharded_state
        from megatron_mecefo.layers.linear import check_lowrank_rank

        args, cfg = get_args(), run.cfg
        # the runtime shards over the replicas; upstream's optimizer stays plain (its data-parallel group is 1)
        run.sharded, args.use_distributed_optimizer = bool(args.use_distributed_optimizer), False
        checkpoint.check_loaded_optimizer(args, run.sharded)
        with no_fp32_copies(run.sharded and args.bf16):
            model, optimizer, scheduler = original(model_provider_func, model_type, *a, **kw)  # loads --load
        if not any(isinstance(m, Coverable) for chunk in model for m in chunk.modules()):
            raise UsageError(f"the model has no MeCeFO layers: build it with --spec {' '.join(SPEC)}")
        if cfg.lowrank_ffn:
            with usage_errors():
                check_lowrank_rank(model[0], cfg.rank, key="--mecefo-rank")

        counters = arg_counters(args, ("iteration", "consumed_train_samples", "consumed_valid_samples",
                                       "skipped_train_samples", "num_floating_point_operations_so_far"), run.record)

        def save():  # the give-up checkpoint: the holders wrote their shards (unstamped), gathered here
            around = None
            if shards is not None and args.ckpt_format == "torch_dist":
                got = collect_given_up(shards, shard_dir(), logging.getLogger(__name__))
                around = checkpoint.as_upstream_optimizer(args, model, optimizer, shards, got)
            with around or contextlib.nullcontext():
                save_checkpoint(args.iteration, model, optimizer, scheduler, args.num_floating_point_operations_so_far)
            return os.path.join(args.save, f"iter_{args.iteration:07d}")

        def shard_dir(iteration=None):
            return get_checkpoint_name(args.save, args.iteration if iteration is None else iteration,
                                       return_base_dir=True)

        with usage_errors():  # an optimizer the sharded state cannot step; shard files that do not cover it
            shards = sharded_state(optimizer, cfg, run.job, args.tensor_model_parallel_size,
                                   args.pipeline_model_parallel_size) if run.sharded else None
            state = StateHooks(*training_state(MegatronLMHost.model_state(model), optimizer, scheduler, counters),
                               save_checkpoint=save if args.save else None,
                               save_shards=(lambda: shards.files.save(shard_dir())) if shards is not None and args.save else None)
            driver = attach(cfg, run.job, MegatronLMHost.host(model, optimizer), micro_batches=get_num_microbatches(),
                            micro_batch_size=args.micro_batch_size, state=state,
                            current_step=lambda: counters[0]()["iteration"],
                            tensor_parallel=args.tensor_model_parallel_size,
                            pipeline_parallel=args.pipeline_model_parallel_size, sharding=shards,
                            load_shards=(checkpoint.loaded_optimizer_state(args, model, shards)
                                         if shards is not None and args.iteration > 0 else None),
                            train_iters=args.train_iters, backend=args.distributed_backend)
        run.host = MegatronLMHost(driver, model, overlap=args.overlap_grad_reduce)
        if shards is not None and args.save:
            run.save_shards = checkpoint.shard_saver(args, model, optimizer, shards, shard_dir, run)
        if run.lead() and not driver.runtime.rejoined:
            print(driver.banner(args.iteration), flush=True)
        return model, optimizer, scheduler

    return setup_model_and_optimizer


def wrap_datasets(original: Callable, run: Run) -> Callable:
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

    return keep_training_set(original, run, cache_dir)


# -- the step -------------------------------------------------------------------------------------

def wrap_train_step(original: Callable, run: Run) -> Callable:
    def train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config,
                   forward_backward_func, iteration=None):
        if not run.active:
            return original(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config,
                            forward_backward_func, iteration=iteration)
        from megatron.core import mpu
        from megatron.training import get_args

        args, host = get_args(), run.host
        # upstream's get_batch: the first and last stages read (tensor-parallel rank 0; its mates
        # receive by broadcast), the middle stages take their input from the previous stage
        reads_data = mpu.get_tensor_model_parallel_rank() == 0 and (
            mpu.is_pipeline_first_stage(ignore_virtual=True) or mpu.is_pipeline_last_stage(ignore_virtual=True))
        draw = step_draw(run, args, reads_data)

        def batches(plan):
            return (draw(mb) for mb in plan.micro_batches) if reads_data else None

        at = iteration if iteration is not None else args.iteration  # train() counts in a local
        out = host.run(original, forward_step_func, model, optimizer, opt_param_scheduler, config,
                       forward_backward_func, batches, iteration=at)
        if host.last_committed:
            # upstream's train() counted the one replica it sees; args.iteration is what a
            # rejoining rank and a give-up checkpoint read
            args.consumed_train_samples += host.driver.samples_of_other_replicas()
            args.iteration = at + 1
        return out

    return train_step


# -- evaluation, checkpoints, logs ----------------------------------------------------------------

def wrap_evaluate(original: Callable, run: Run) -> Callable:
    """`megatron.training.training.evaluate`: each eval iteration runs the whole global eval batch
    (global batch / micro batch micro-batches of the replica's sequential sampler: the samples all
    data-parallel ranks evaluate together upstream), so no cross-replica collective is needed and
    the loss is an unpatched run's."""

    def evaluate(*a, **kw):
        if not run.active:
            return original(*a, **kw)
        from megatron.training import get_args

        args = get_args()
        dp, args.data_parallel_size = args.data_parallel_size, 1
        try:
            return original(*a, **kw)
        finally:
            args.data_parallel_size = dp

    return evaluate
