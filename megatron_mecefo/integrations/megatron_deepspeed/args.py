"""What `--mecefo` means for Megatron-DeepSpeed's arguments and ds_config: what it refuses before
anything starts (and why)."""

from __future__ import annotations

import json
from typing import Any, Dict

from megatron_mecefo.config import LaunchEnv, MeCeFOConfig
from megatron_mecefo.integrations.usage import refuse, shared_refusals

__all__ = ["read_ds_config", "check_args"]


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
