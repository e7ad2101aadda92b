"""Every upstream global MeCeFO replaces in Megatron-LM, in one table: what, why, and when it is
undone. The "run" rows are applied by `install`'s `pretrain` for one call and undone when it
returns (integrations/patches.py); each hook calls upstream unchanged without --mecefo."""

from __future__ import annotations

import os
from typing import List

from megatron_mecefo.integrations.data import one_replica_at_a_time
from megatron_mecefo.integrations.megatron_lm import checkpoint
from megatron_mecefo.integrations.megatron_lm import training as hooks
from megatron_mecefo.integrations.patches import Patch
from megatron_mecefo.integrations.record import Record, tensorboard_writer
from megatron_mecefo.integrations.run import Run
from megatron_mecefo.integrations.saves import lead_only_save

__all__ = ["table"]

_INIT, _TRAIN = "megatron.training.initialize", "megatron.training.training"


def _helpers_dir() -> str:
    import megatron.core.datasets as datasets

    return os.path.dirname(datasets.__file__)


def table(run: Run) -> List[Patch]:
    """The patches of one run (`run`: what every hook of it shares)."""
    import megatron.training.training as training

    record = run.record = Record(run, training, make_tb_writer=lambda: tensorboard_writer(training.get_args()))
    return [
        Patch(_INIT, "_initialize_distributed", "torch.distributed over the rank's replica on the job's store first; "
              "upstream's groups then span the replica", lambda f: hooks.wrap_initialize_distributed(f, run)),
        Patch(_INIT, "_compile_dependencies", "every replica's rank 0 is a rank 0: they compile the dataset helpers "
              "in turn", lambda f: one_replica_at_a_time(f, lambda: run.active, _helpers_dir)),
        Patch(_TRAIN, "setup_model_and_optimizer", "after upstream's build and --load, the rank joins the job "
              "(a restarted rank receives the live state)", lambda f: hooks.wrap_setup_model_and_optimizer(f, run)),
        Patch(_TRAIN, "load_checkpoint", "a sharded optimizer state is read by MeCeFO's shards, not upstream's "
              "optimizer", lambda f: checkpoint.wrap_load_checkpoint(f, run)),
        Patch(_TRAIN, "build_train_valid_test_datasets", "keeps the training set: a covering rank draws a failed "
              "replica's micro-batches", lambda f: hooks.wrap_datasets(f, run)),
        Patch(_TRAIN, "train_step", "the plan's micro-batches, the reduction and commit at the optimizer step, "
              "a failed step redone", lambda f: hooks.wrap_train_step(f, run)),
        Patch(_TRAIN, "evaluate", "every replica evaluates the whole global eval batch (no cross-replica "
              "collective)", lambda f: hooks.wrap_evaluate(f, run)),
        Patch(_TRAIN, "save_checkpoint", "one replica writes upstream's files, every rank its optimizer shards",
              lambda f: lead_only_save(f, run)),
        Patch(_TRAIN, "training_log", "printed once, by whichever replica leads (record.py)",
              lambda f: record.wrap(f, carries=True)),
        Patch(_TRAIN, "evaluate_and_print_results", "printed once, by whichever replica leads (record.py)",
              record.wrap),
        Patch(_TRAIN, "get_megatron_optimizer", "with --use-distributed-optimizer and --bf16: no fp32 copies "
              "(optimizer.no_fp32_copies, in setup_model_and_optimizer)", scope="call"),
        Patch(_TRAIN, "get_tensorboard_writer", "a recorder while a log call runs (record.py)", scope="call"),
        Patch("megatron.core.distributed", "DDP bucket groups' start_grad_sync / finish_grad_sync",
              "--overlap-grad-reduce: upstream's buckets run the cross-replica reduction (host.py)", scope="object"),
        Patch("megatron.core.optimizer", "the optimizer's grad norm, prepare_grads, step_with_ready_grads",
              "--use-distributed-optimizer with --bf16: the sharded state's clip over main_grad "
              "(optimizer.bf16_parameters)", scope="object"),
    ]
