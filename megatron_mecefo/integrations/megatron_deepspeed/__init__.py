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
replicas); fp32 or bf16; dense layers. What is refused, and why, is in training.check_args.
"""

from __future__ import annotations

import os
from typing import Callable

from megatron_mecefo.integrations.common import add_args, install_hooks, wrap_pretrain

__all__ = ["install", "add_args"]


def _helpers_dir() -> str:
    import megatron.data as data

    return os.path.dirname(data.__file__)


def install(pretrain: Callable) -> Callable:
    """Put MeCeFO's hooks into Megatron-DeepSpeed's `megatron.initialize` and `megatron.training`
    and return `pretrain` wrapped: the `--mecefo*` flags are added to the user's
    `extra_args_provider`, and a job MeCeFO cannot continue ends with the launcher's exit codes
    (3: gave up, with a checkpoint when `--save` is set; 4: this rank left the job and is restarted;
    2: bad input, before training)."""
    import megatron.initialize as initialize
    import megatron.training as training

    from megatron_mecefo.integrations.megatron_deepspeed import training as hooks

    install_hooks(initialize, training, hooks, helpers_dir=_helpers_dir, wrap_evaluate=lambda evaluate: hooks.wrap_evaluate(evaluate, training),
                  get_args=training.get_args)
    return wrap_pretrain(pretrain, hooks.STATE)
