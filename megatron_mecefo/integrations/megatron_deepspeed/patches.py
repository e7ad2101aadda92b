"""Every upstream global MeCeFO replaces in Megatron-DeepSpeed (and the DeepSpeed it runs), in one
table: what, why, and when it is undone. The "run" rows are applied by `install`'s `pretrain` for
one call and undone when it returns (integrations/patches.py); each calls upstream unchanged
without --mecefo."""

from __future__ import annotations

import os
from typing import List

from megatron_mecefo.integrations.megatron_deepspeed import training as hooks
from megatron_mecefo.integrations.patches import Patch, loop_rows
from megatron_mecefo.integrations.record import Record, tensorboard_writer
from megatron_mecefo.integrations.run import Run

__all__ = ["table"]

_TRAIN = "megatron.training"


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
    return loop_rows(run, hooks, initialize="megatron.initialize", training=_TRAIN, helpers_dir=_helpers_dir,
                     record=record) + [
        Patch(_TRAIN, "evaluate", "every replica evaluates the whole global eval batch (no cross-replica "
              "collective)", lambda f: hooks.wrap_evaluate(f, run, training)),
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
        Patch("deepspeed.runtime.engine", "DeepSpeedEngine.load_checkpoint", "a ZeRO checkpoint's optimizer is "
              "read by MeCeFO's shards (inside setup_model_and_optimizer)", scope="call"),
    ]
