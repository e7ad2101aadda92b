"""MeCeFO for a Megatron-LM checkout (NVIDIA/Megatron-LM @ core_v0.16.1).

The patch (`mecefo-patch apply CHECKOUT`, patches/megatron-lm) adds two lines to its
`pretrain_gpt.py`:

    import megatron_mecefo.integrations.megatron_lm as mecefo
    ...
    pretrain = mecefo.install(pretrain)

`install` hooks Megatron-LM's training loop (`megatron.training.training` and `.initialize`) and
returns `pretrain` with the `--mecefo*` flags added to its parser. Without `--mecefo` every hook
calls the upstream function unchanged. With it the job is fault tolerant: start it with
`mecefo-launch` (or `torchrun`), e.g.

    mecefo-launch --nproc-per-node 8 pretrain_gpt.py <your flags> --transformer-impl local --mecefo

Layers: MeCeFO's Megatron-Core spec (`megatron_mecefo.layers.specs mecefo_gpt_layer_spec`) is used
unless `--spec` names it already. Scope: tensor and pipeline parallelism (1F1B, virtual stages),
Megatron's DDP with or without `--overlap-grad-reduce` (the cross-replica reduction then runs in
upstream's buckets), `--use-distributed-optimizer` (MeCeFO shards the optimizer state over the
replicas), fp32 or bf16, dense layers. What is refused, and why, is in args.check_args;
every upstream global it replaces is in patches.py.
"""

from __future__ import annotations

from typing import Callable

from megatron_mecefo.integrations.run import add_args, host_pretrain

__all__ = ["install", "add_args"]


def install(pretrain: Callable) -> Callable:
    """`pretrain` with MeCeFO: each call puts MeCeFO's hooks into Megatron-LM's
    `megatron.training` modules for that run (patches.py) and takes them out when it returns; the
    `--mecefo*` flags are added to the user's `extra_args_provider`, and a job MeCeFO cannot
    continue ends with the launcher's exit codes (3: gave up, with a checkpoint when `--save` is
    set; 4: this rank left the job and is restarted; 2: bad input, before training)."""

    def table(run):
        from megatron_mecefo.integrations.megatron_lm.patches import table

        return table(run)

    return host_pretrain(pretrain, table)
