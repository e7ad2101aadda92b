"""Checkpoints of a DeepSpeed engine: DeepSpeed's layout, the RNG state, and plain-data loading.

Layout (DeepSpeed's `engine.save_checkpoint`, as Megatron-DeepSpeed writes it under DeepSpeed):
`DIR/global_step{N}/mp_rank_00_model_states.pt` (module, optimizer, lr_scheduler, counters, and our
client state: `iteration` and `rng_state`), `DIR/latest` (the tag), plus Megatron's
`DIR/latest_checkpointed_iteration.txt`. The RNG state (torch, CUDA, python, numpy and Megatron's
model-parallel tracker) makes a run with dropout resume on the same loss curve.

Loading unpickles with `weights_only=True`: tensors and plain containers only, so a checkpoint file
cannot run code when loaded (a file holding anything else is refused with UnsafeCheckpoint).
"""

from __future__ import annotations

import logging
import os
import pickle

import torch

from megatron_mecefo.rng import rng_state, set_rng_state

__all__ = ["save_checkpoint", "load_checkpoint", "restrict_checkpoint_loading", "rng_state", "set_rng_state",
           "UnsafeCheckpoint"]

logger = logging.getLogger(__name__)


class UnsafeCheckpoint(ValueError):
    """A checkpoint file holds more than tensors and plain containers: not loaded."""


def deepspeed_data_classes() -> list:
    """The plain-data classes DeepSpeed's own ZeRO optimizer files hold (its loss scaler's settings,
    the stage enum, parameter fragment addresses): allowed in a restricted load."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def plain_load(path: str, map_location=None, mmap=None):
    """torch.load restricted to tensors, plain containers and DeepSpeed's data classes
    (UnsafeCheckpoint otherwise)."""
    try:
        with torch.serialization.safe_globals(deepspeed_data_classes()):
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpoint(
            f"{path} holds more than tensors and plain containers, so it is not loaded (loading it could run "
            f"code): {str(e).splitlines()[0]}") from None


def restrict_checkpoint_loading(engine) -> None:
    """Make the engine's checkpoint loads plain-data only (DeepSpeed's torch engine unpickles
    anything). Other checkpoint engines (Nebula, decoupled) are left as they are."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    ce = getattr(engine, "checkpoint_engine", None)
    if isinstance(ce, TorchCheckpointEngine):
        ce.load = plain_load
    else:
        logger.warning("checkpoint engine %s: loads are not restricted to plain data", type(ce).__name__)


def save_checkpoint(engine, save_dir: str) -> str:
    """DeepSpeed's checkpoint of `engine` under save_dir/global_step{N} (+ `latest`, and Megatron's
    latest_checkpointed_iteration.txt), with this rank's RNG state. Under MeCeFO call it on ONE rank
    (every replica believes it is rank 0 of its own world, so two callers would write the same
    files); without MeCeFO on every rank (DeepSpeed's barriers). Returns the checkpoint directory."""
    tag = f"global_step{engine.global_steps}"
    engine.save_checkpoint(save_dir, tag=tag, client_state={"iteration": engine.global_steps, "rng_state": rng_state()})
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        with open(os.path.join(save_dir, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(engine.global_steps))
    return os.path.join(save_dir, tag)


def load_checkpoint(engine, load_dir: str) -> int:
    """Load the newest checkpoint under load_dir into `engine` (module, optimizer, scheduler,
    counters, RNG state). Returns its iteration.

    Raises:
        FileNotFoundError: no DeepSpeed checkpoint there.
        UnsafeCheckpoint: a file holds more than tensors and plain containers.
    """
    restrict_checkpoint_loading(engine)
    if not os.path.exists(os.path.join(load_dir, "latest")):
        raise FileNotFoundError(f"--load {load_dir}: no DeepSpeed checkpoint (no 'latest' file)")
    path, client = engine.load_checkpoint(load_dir)
    if path is None:
        raise FileNotFoundError(f"--load {load_dir}: the checkpoint could not be loaded")
    if "rng_state" in client:
        set_rng_state(client["rng_state"])
    else:
        logger.warning("%s has no RNG state (an older checkpoint): dropout masks will differ from the original run", path)
    return int(client.get("iteration", engine.global_steps))
