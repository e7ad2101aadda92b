"""How MeCeFO runs a ds_config: each replica's DeepSpeed engine sees one replica (data-parallel
size 1 as far as it knows), and data parallelism, ZeRO stage 1 and overlapped reduction belong to
the runtime (deepspeed_hook/engine.py's docstring says why). Plain dict arithmetic; imports nothing
of DeepSpeed."""

from __future__ import annotations

import copy
from typing import Any, Dict, Optional

__all__ = ["replica_ds_config", "bf16_parameters", "overlap_bucket", "zero_stage", "engine_clipping"]


def replica_ds_config(ds_config: Dict[str, Any], world: int) -> tuple:
    """The per-replica ds_config and the number of micro-batches per replica per step."""
    cfg = copy.deepcopy(ds_config)
    cfg.pop("mecefo", None)
    mb = cfg.get("train_micro_batch_size_per_gpu")
    gas = cfg.get("gradient_accumulation_steps")
    tbs = cfg.get("train_batch_size")
    if mb is None:
        raise ValueError('ds_config needs "train_micro_batch_size_per_gpu" with MeCeFO')
    if gas is None:
        gas = tbs // (mb * world) if tbs else 1
    if tbs is not None and tbs != mb * gas * world:
        raise ValueError(
            f'ds_config "train_batch_size"={tbs} != train_micro_batch_size_per_gpu ({mb}) x '
            f"gradient_accumulation_steps ({gas}) x data-parallel size ({world})"
        )
    cfg.update(train_batch_size=mb * gas, gradient_accumulation_steps=gas, managed_gradient_accumulation=False)
    if cfg.get("zero_optimization", {}).get("stage", 0) == 1:  # the runtime shards over the replicas
        cfg["zero_optimization"] = {**cfg["zero_optimization"], "stage": 0}
    if "overlap_comm" in cfg.get("zero_optimization", {}):  # the runtime's (overlap_bucket), not DeepSpeed's
        cfg["zero_optimization"] = {k: v for k, v in cfg["zero_optimization"].items() if k != "overlap_comm"}
    return cfg, gas, mb


def bf16_parameters(ds_config: Dict[str, Any]) -> bool:
    """With the sharded optimizer state and "bf16" on, DeepSpeed is told fp32 and given the model
    in bf16 (the caller casts it, as DeepSpeed would): its optimizer then steps the bf16
    parameters, and the fp32 masters live in the held shards only (elastic/sharding/zero.py), instead of a
    mixed-precision wrapper keeping a whole fp32 copy on every rank. The gradients are bf16, as in
    DeepSpeed's own bf16 mode at stage 0; the sharded update reads them in fp32 and applies the clip
    coefficient there. Returns whether it did so (and turns "bf16" off in `ds_config`)."""
    for key in ("bf16", "bfloat16"):
        if ds_config.get(key, {}).get("enabled", False):
            ds_config[key] = {**ds_config[key], "enabled": False}
            return True
    return False


def overlap_bucket(ds_config: Dict[str, Any]) -> Optional[int]:
    """ds_config "zero_optimization.overlap_comm" (DeepSpeed's switch for overlapping the gradient
    reduction with the backward): the runtime's all-reduce then runs in buckets of
    "reduce_bucket_size" elements (DeepSpeed's default 5e8) during the last micro-batch's backward.
    None: one buffer after the backward."""
    zero = ds_config.get("zero_optimization", {})
    return int(zero.get("reduce_bucket_size", 500_000_000)) if zero.get("overlap_comm", False) else None


def zero_stage(ds_config: Dict[str, Any]) -> int:
    return int(ds_config.get("zero_optimization", {}).get("stage", 0))


def engine_clipping(ds_config: Dict[str, Any], *, model_parallel: int, sharded: bool) -> float:
    """Where MeCeFOEngine clips instead of DeepSpeed, pop ds_config's "gradient_clipping" and return
    it (0.0: DeepSpeed clips, or nobody): with tensor or pipeline parallelism (DeepSpeed's clipping
    miscounts pipeline stages > 0) and with a sharded optimizer state (the reduce-scattered
    gradients are whole only in their owners' ranges; the norm comes from the shards)."""
    if model_parallel > 1 or sharded:
        return float(ds_config.pop("gradient_clipping", 0.0) or 0.0)
    return 0.0
