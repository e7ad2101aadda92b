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

Scope: tensor parallelism >= 1 with `--no-pipeline-parallel`, ZeRO stage 0, fp32 or bf16, dense
layers. What is refused, and why, is in training.check_args.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Callable

from megatron_mecefo.config import MeCeFOConfig

__all__ = ["install", "add_args"]


def add_args(parser):
    """Megatron's `extra_args_provider`: the `--mecefo*` flags (the same as examples/pretrain_gpt)."""
    MeCeFOConfig.add_cli_args(parser)
    return parser


def install(pretrain: Callable) -> Callable:
    """Put MeCeFO's hooks into Megatron-DeepSpeed's `megatron.initialize` and `megatron.training`
    and return `pretrain` wrapped: the `--mecefo*` flags are added to the user's
    `extra_args_provider`, and a job MeCeFO cannot continue ends with the launcher's exit codes
    (3: gave up, with a checkpoint when `--save` is set; 4: this rank left the job and is restarted;
    2: bad input, before training)."""
    import megatron.initialize as initialize
    import megatron.training as training

    from megatron_mecefo.integrations.megatron_deepspeed import training as hooks

    if not getattr(training, "_mecefo_installed", False):
        initialize._initialize_distributed = hooks.wrap_initialize_distributed(initialize._initialize_distributed)
        training.setup_model_and_optimizer = hooks.wrap_setup_model_and_optimizer(training.setup_model_and_optimizer)
        training.build_train_valid_test_datasets = hooks.wrap_datasets(training.build_train_valid_test_datasets)
        training.train_step = hooks.wrap_train_step(training.train_step)
        training.evaluate = hooks.wrap_evaluate(training.evaluate, training)
        training.save_checkpoint = hooks.wrap_save_checkpoint(training.save_checkpoint)
        training.training_log = hooks.lead_only_output(training.training_log)
        training.evaluate_and_print_results = hooks.lead_only_output(training.evaluate_and_print_results)
        training._mecefo_installed = True

    @functools.wraps(pretrain)
    def run(*args, extra_args_provider=None, **kwargs):
        def extra(parser):
            parser = extra_args_provider(parser) if extra_args_provider is not None else parser
            return add_args(parser)

        return _run_job(lambda: pretrain(*args, extra_args_provider=extra, **kwargs))

    return run


def _run_job(pretrain: Callable):
    from megatron_mecefo.errors import (GAVE_UP_EXIT_CODE, RETIRED_EXIT_CODE, USAGE_EXIT_CODE, GaveUp, JobConflict,
                                        JobFinished, NotAMember)
    from megatron_mecefo.integrations.megatron_deepspeed import training as hooks

    state = hooks.STATE
    try:
        out = pretrain()
    except JobFinished as e:  # a restarted rank came back after training ended
        print(f"MeCeFO: {e}", file=sys.stderr, flush=True)
        return None
    except GaveUp as e:
        where = f"checkpoint of the last committed step written to {e.checkpoint}" if e.checkpoint else \
            "no checkpoint written here"
        print(f"MeCeFO: cannot continue: {e} ({where})", file=sys.stderr, flush=True)
        sys.exit(GAVE_UP_EXIT_CODE)
    except NotAMember as e:  # left out (presumed failed, or its replica lost a rank): the launcher restarts it
        print(f"MeCeFO: {e}", file=sys.stderr, flush=True)
        os._exit(RETIRED_EXIT_CODE if state.job is not None and state.job.mecefo_launcher else 0)
    except (hooks.UsageError, JobConflict) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(USAGE_EXIT_CODE)
    except SystemExit as e:  # upstream's own exits (--exit-interval, a kill-switch file, SIGTERM handler)
        hooks.close(finished=e.code in (None, 0))
        raise
    hooks.close(finished=True)
    return out
