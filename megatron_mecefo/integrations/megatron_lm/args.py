"""What `--mecefo` means for Megatron-LM's arguments: MeCeFO's layer spec, and what it refuses
before anything starts (and why)."""

from __future__ import annotations

from megatron_mecefo.config import LaunchEnv, MeCeFOConfig
from megatron_mecefo.integrations.usage import refuse, shared_refusals

__all__ = ["SPEC", "check_args"]

SPEC = ["megatron_mecefo.layers.specs", "mecefo_gpt_layer_spec"]
"""`--spec` of MeCeFO's GPT layer (Megatron-Core's local layer with the covering backward)."""


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
