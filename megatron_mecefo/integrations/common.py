"""What the Megatron-DeepSpeed and Megatron-LM adapters share: bad-input errors, the sampler's
order (a covering rank draws a failed neighbour's micro-batches), the exit codes of a job that
MeCeFO cannot continue, and silencing the log lines of every replica but one. Imports nothing of
either codebase."""

from __future__ import annotations

import contextlib
import io
import os
import sys
from typing import Callable

import torch

__all__ = ["UsageError", "usage_errors", "micro_batch", "run_job", "quiet_unless", "one_replica_at_a_time"]


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


def micro_batch(dataset, consumed: int, replica: int, index: int, *, micro_batch_size: int, dp: int):
    """The micro-batch `index` of data-parallel rank `replica` in the step that starts at `consumed`
    samples, as Megatron's `MegatronPretrainingSampler` + the default collate give it to that rank
    (both codebases slice a global batch of micro_batch_size x dp samples the same way)."""
    start = consumed + index * micro_batch_size * dp + replica * micro_batch_size
    return torch.utils.data.default_collate([dataset[i] for i in range(start, start + micro_batch_size)])


def run_job(pretrain: Callable, *, mecefo_launcher: Callable[[], bool], close: Callable[[bool], None]):
    """Run upstream's `pretrain()` and map how a MeCeFO job ends to the launcher's exit codes:
    3 gave up (with a checkpoint where one could be written), 4 this rank left the job and is
    restarted (0 under launchers that kill every rank when one fails), 2 bad input."""
    from megatron_mecefo.errors import (GAVE_UP_EXIT_CODE, RETIRED_EXIT_CODE, USAGE_EXIT_CODE, GaveUp, JobConflict,
                                        JobFinished, NotAMember)

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
        sys.stderr.flush()
        os._exit(RETIRED_EXIT_CODE if mecefo_launcher() else 0)
    except (UsageError, JobConflict) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(USAGE_EXIT_CODE)
    except SystemExit as e:  # upstream's own exits (--exit-interval, a kill-switch file, SIGTERM handler)
        close(e.code in (None, 0))
        raise
    close(True)
    return out


def quiet_unless(original: Callable, speaks: Callable[[], bool]) -> Callable:
    """`original` with its stdout swallowed while `speaks()` is False (upstream's log functions
    print on the last rank of each replica; one replica's lines are the job's)."""

    def quiet(*a, **kw):
        if speaks():
            return original(*a, **kw)
        with contextlib.redirect_stdout(io.StringIO()):
            return original(*a, **kw)

    return quiet


def one_replica_at_a_time(original: Callable, active: Callable[[], bool], lock_dir: Callable[[], str]) -> Callable:
    """`original` (upstream's `_compile_dependencies`: it compiles the dataset helpers on rank 0)
    under a file lock in `lock_dir()` on each replica's rank 0: every replica's rank 0 is a rank 0
    here, and two compilers writing the same library at once can leave a broken one. The other
    ranks wait in upstream's own barrier."""
    import torch.distributed as dist

    from megatron_mecefo.locks import file_lock

    def locked(*a, **kw):
        if not active() or dist.get_rank() != 0:
            return original(*a, **kw)
        with file_lock(os.path.join(lock_dir(), ".mecefo-build.lock")):
            return original(*a, **kw)

    return locked
