"""MeCeFO for a Megatron-DeepSpeed checkout (deepspeedai/Megatron-DeepSpeed @ 4efb479).

The patch (`mecefo-patch apply CHECKOUT`, patches/megatron-deepspeed) adds two lines to its
`pretrain_gpt.py`:

    import megatron_mecefo.integrations.megatron_deepspeed as mecefo
    ...
    pretrain = mecefo.install(pretrain)

`install` hooks Megatron-DeepSpeed's training loop (training.py) and returns `pretrain` with the
`--mecefo*` flags added to its parser. Without `--mecefo` (and no ds_config "mecefo" block that
enables it) every hook calls the upstream function unchanged. With it the job is fault tolerant:
start it with `mecefo-launch` (or `deepspeed`), e.g.

    mecefo-launch --nproc-per-node 4 pretrain_gpt.py <your flags> --deepspeed --no-pipeline-parallel --mecefo

Scope: tensor parallelism >= 1; pipelines in DeepSpeed's pipeline engine (without
`--no-pipeline-parallel`; no virtual stages); ds_config ZeRO stage 0 or 1 (MeCeFO's sharding over the
replicas); fp32 or bf16; dense layers. What is refused, and why, is in args.check_args;
every upstream global it replaces is in patches.py.
"""

from __future__ import annotations

from typing import Callable

from megatron_mecefo.integrations.run import add_args, host_pretrain

__all__ = ["install", "add_args"]


def install(pretrain: Callable) -> Callable:
    """`pretrain` with MeCeFO: each call puts MeCeFO's hooks into Megatron-DeepSpeed's
    `megatron.initialize` and `megatron.training` for that run (patches.py) and takes them out when
    it returns; the `--mecefo*` flags are added to the user's `extra_args_provider`, and a job
    MeCeFO cannot continue ends with the launcher's exit codes (3: gave up, with a checkpoint when
    `--save` is set; 4: this rank left the job and is restarted; 2: bad input, before training)."""

    def table(run):
        from megatron_mecefo.integrations.megatron_deepspeed.patches import table

        return table(run)

    return host_pretrain(pretrain, table)
