"""Every upstream global MeCeFO replaces in Megatron-LM, in one table: what, why, and when it is
undone. The "run" rows are applied by `install`'s `pretrain` for one call and undone when it
returns (integrations/patches.py); each hook calls upstream unchanged without --mecefo."""

from __future__ import annotations

import os
from typing import List

from megatron_mecefo.integrations.megatron_lm import checkpoint
from megatron_mecefo.integrations.megatron_lm import training as hooks
from megatron_mecefo.integrations.patches import Patch, loop_rows
from megatron_mecefo.integrations.record import Record, tensorboard_writer
from megatron_mecefo.integrations.run import Run

__all__ = ["table"]

_TRAIN = "megatron.training.training"


def _helpers_dir() -> str:
    import megatron.core.datasets as datasets

    return os.path.dirname(datasets.__file__)


def table(run: Run) -> List[Patch]:
    """The patches of one run (`run`: what every hook of it shares)."""
    import megatron.training.training as training

    record = run.record = Record(run, training, make_tb_writer=lambda: tensorboard_writer(training.get_args()))
    return loop_rows(run, hooks, initialize="megatron.training.initialize", training=_TRAIN, helpers_dir=_helpers_dir,
                     record=record) + [
        Patch(_TRAIN, "load_checkpoint", "a sharded optimizer state is read by MeCeFO's shards, not upstream's "
              "optimizer", lambda f: checkpoint.wrap_load_checkpoint(f, run)),
        Patch(_TRAIN, "evaluate", "every replica evaluates the whole global eval batch (no cross-replica "
              "collective)", lambda f: hooks.wrap_evaluate(f, run)),
        Patch(_TRAIN, "get_megatron_optimizer", "with --use-distributed-optimizer and --bf16: no fp32 copies "
              "(optimizer.no_fp32_copies, in setup_model_and_optimizer)", scope="call"),
        Patch("megatron.core.distributed", "DDP bucket groups' start_grad_sync / finish_grad_sync",
              "--overlap-grad-reduce: upstream's buckets run the cross-replica reduction (host.py)", scope="object"),
        Patch("megatron.core.optimizer", "the optimizer's grad norm, prepare_grads, step_with_ready_grads",
              "--use-distributed-optimizer with --bf16: the sharded state's clip over main_grad "
              "(optimizer.bf16_parameters)", scope="object"),
    ]
