"""Every upstream global MeCeFO replaces in Megatron-DeepSpeed (and the DeepSpeed it runs), in one
table: what, why, and when it is undone. The "run" rows are applied by `install`'s `pretrain` for
one call and undone when it returns (integrations/patches.py); each calls upstream unchanged
without --mecefo."""

from __future__ import annotations

import os
from typing import List

from megatron_mecefo.integrations.data import one_replica_at_a_time
from megatron_mecefo.integrations.megatron_deepspeed import training as hooks
from megatron_mecefo.integrations.patches import Patch
from megatron_mecefo.integrations.record import Record, tensorboard_writer
from megatron_mecefo.integrations.run import Run
from megatron_mecefo.integrations.saves import lead_only_save

__all__ = ["table"]

_INIT, _TRAIN = "megatron.initialize", "megatron.training"


def _helpers_dir() -> str:
    import megatron.data as data

    return os.path.dirname(data.__file__)


class _CompatibleOps(dict):
    """DeepSpeed's table of buildable ops, with its shared-memory op off under --mecefo: its CPU
    accelerator JIT-builds it (about 35 s) and MeCeFO's gloo groups never use it."""

    def __init__(self, ops: dict, run: Run) -> None:
        super().__init__(ops)
        self.run = run

    def get(self, key, default=None):
        if key == "deepspeed_shm_comm" and self.run.active:
            return False
        return super().get(key, default)


def table(run: Run) -> List[Patch]:
    """The patches of one run (`run`: what every hook of it shares)."""
    import megatron.training as training

    record = run.record = Record(run, training, make_tb_writer=lambda: tensorboard_writer(training.get_args()))
    return [
        Patch(_INIT, "_initialize_distributed", "torch.distributed over the rank's replica on the job's store first; "
              "upstream's groups then span the replica", lambda f: hooks.wrap_initialize_distributed(f, run)),
        Patch(_INIT, "_compile_dependencies", "every replica's rank 0 is a rank 0: they compile the dataset helpers "
              "in turn", lambda f: one_replica_at_a_time(f, lambda: run.active, _helpers_dir)),
        Patch(_TRAIN, "setup_model_and_optimizer", "the covering layers; the replica's ds_config; after upstream's "
              "engine and --load, the rank joins the job", lambda f: hooks.wrap_setup_model_and_optimizer(f, run)),
        Patch(_TRAIN, "build_train_valid_test_datasets", "keeps the training set: a covering rank draws a failed "
              "replica's micro-batches", lambda f: hooks.wrap_datasets(f, run)),
        Patch(_TRAIN, "train_step", "the plan's micro-batches through the engine, reduce, commit, a failed step "
              "redone", lambda f: hooks.wrap_train_step(f, run)),
        Patch(_TRAIN, "evaluate", "every replica evaluates the whole global eval batch (no cross-replica "
              "collective)", lambda f: hooks.wrap_evaluate(f, run, training)),
        Patch(_TRAIN, "save_checkpoint", "one replica writes upstream's files, every rank its optimizer shards",
              lambda f: lead_only_save(f, run)),
        Patch(_TRAIN, "training_log", "printed once, by whichever replica leads (record.py)",
              lambda f: record.wrap(f, carries=True)),
        Patch(_TRAIN, "evaluate_and_print_results", "printed once, by whichever replica leads (record.py)",
              record.wrap),
        # the pipeline engine's send/recv on the default group: a gloo receive waits out the timeout
        # the group was created with (start-up's, long); its other path broadcasts over a group per
        # pair of adjacent stages, which take the collective timeout once the rank trains
        # (`replica_groups_time_out`), so a hung stage fails its neighbour in time
        Patch("deepspeed.runtime.pipe.p2p", "can_send_recv", "the pipeline engine sends over a group per pair of "
              "stages (a receive that waits out the start-up timeout otherwise)",
              lambda f: lambda: False if run.active else f()),
        Patch("deepspeed.ops", "__compatible_ops__", "no JIT build of DeepSpeed's shared-memory op, which MeCeFO's "
              "gloo groups never use", lambda ops: _CompatibleOps(ops, run)),
        Patch(_TRAIN, "get_num_microbatches", "the global eval batch per eval iteration (inside evaluate)",
              scope="call"),
        Patch(_TRAIN, "get_tensorboard_writer", "a recorder while a log call runs (record.py)", scope="call"),
        Patch("deepspeed.runtime.engine", "DeepSpeedEngine.load_checkpoint", "a ZeRO checkpoint's optimizer is "
              "read by MeCeFO's shards (inside setup_model_and_optimizer)", scope="call"),
    ]
