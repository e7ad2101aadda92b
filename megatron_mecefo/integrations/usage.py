"""Bad input for MeCeFO inside an upstream codebase: found before training starts, it ends the
rank with exit 2 and the message (errors.run_to_exit)."""

from __future__ import annotations

import contextlib

__all__ = ["UsageError", "usage_errors", "refuse", "shared_refusals"]


class UsageError(ValueError):
    """Bad input for MeCeFO found before training (exit with USAGE_EXIT_CODE)."""


@contextlib.contextmanager
def usage_errors():
    """ValueErrors raised inside (config validation, refusals) become UsageErrors."""
    try:
        yield
    except UsageError:
        raise
    except ValueError as e:
        raise UsageError(str(e)) from None


def refuse(checks) -> None:
    """Raise ValueError with the first message whose condition holds: `checks` are (bad, message)."""
    for bad, message in checks:
        if bad:
            raise ValueError(message)


def shared_refusals(args) -> list:
    """What MeCeFO refuses in both Megatron codebases, by their common flags."""
    return [
        (args.dataloader_type != "single",
         f"--mecefo needs --dataloader-type single (got {args.dataloader_type}): a failed rank's micro-batches are "
         "drawn from the sampler's order"),
        (args.rampup_batch_size is not None, "--mecefo does not support --rampup-batch-size"),
        (bool(getattr(args, "exit_duration_in_mins", None)),
         "--mecefo does not support --exit-duration-in-mins (replicas could stop at different iterations)"),
    ]
