"""MeCeFO's exceptions. Messages name the generation, rank and step where known, and the knob."""

from __future__ import annotations

from typing import NoReturn, Optional

__all__ = [
    "MeCeFOError", "RankFailure", "GaveUp", "NoCoverAvailable", "StateLost", "AgreementTimeout", "JobAborted",
    "NotAMember", "ReplicaLost", "StoreLost", "JoinTimeout", "JobFinished", "IncompleteStep", "JobConflict", "GAVE_UP_EXIT_CODE",
    "USAGE_EXIT_CODE", "RETIRED_EXIT_CODE", "exit_now", "run_to_exit",
]

GAVE_UP_EXIT_CODE = 3
"""Exit status of every rank of a job that gave up; mecefo-launch then ends the job (no restarts)."""


USAGE_EXIT_CODE = 2
"""Exit status for bad input found before training (a flag, a trace, a store that is not this job's);
mecefo-launch restarts nobody after it."""

RETIRED_EXIT_CODE = 4
"""Exit status of a rank that left the job on purpose (NotAMember: its replica lost a rank, or it was
presumed failed): mecefo-launch restarts it like a crashed rank, and it does not make the job fail."""


class MeCeFOError(RuntimeError):
    """Base class of MeCeFO's errors."""


class RankFailure(MeCeFOError):
    """A peer failed (crash or hang) during a step; the step will be redone by the survivors."""


class GaveUp(MeCeFOError):
    """The job cannot go on. The runtime has written a checkpoint of the last committed step when a
    member still held the state (`checkpoint` is its path, or None) and told every rank through the
    store; the script should exit with GAVE_UP_EXIT_CODE."""

    checkpoint = None


class NoCoverAvailable(GaveUp):
    """A failed replica has no healthy, non-covering neighbour: the job cannot continue."""


class StateLost(GaveUp):
    """No rank that holds the training state is left (only restarted ranks without state remain)."""


class AgreementTimeout(GaveUp):
    """Survivors did not agree on a new generation in time (mecefo.agree_timeout_s)."""


class StoreLost(GaveUp):
    """The job's store stopped answering for longer than heartbeat_timeout_s: no failure could be
    absorbed any more. No member commits the step it learnt it in (they all learn it in that step's
    confirmation); the lowest member's replica writes the checkpoint of the last committed step
    (agreed without the store: `writer`; None: claimed in the store, if it still answers)."""

    def __init__(self, message: str, writer: Optional[int]) -> None:
        super().__init__(message)
        self.writer = writer


class JobAborted(GaveUp):
    """Another rank gave up (one of the reasons above); this rank ends with the job."""


class IncompleteStep(GaveUp):
    """A step was about to commit without the whole global batch (or after this rank's own reduction
    failed): never committed; the job ends with the checkpoint of the last whole step."""


class JobConflict(MeCeFOError, ValueError):
    """The store at MASTER_ADDR:MASTER_PORT is not this job's (another job's, or a finished one):
    stop before training (exit with USAGE_EXIT_CODE)."""


class NotAMember(MeCeFOError):
    """This rank was left out of the agreed generation (it was presumed failed): it must stop."""


class ReplicaLost(NotAMember):
    """A collective inside this rank's replica (tensor- or pipeline-parallel) failed: a rank of the
    replica crashed or hangs, so the whole replica leaves the job. The rank exits with
    RETIRED_EXIT_CODE (run_to_exit); its supervisor (mecefo-launch or the keeper) restarts it and
    the replica rejoins once all its ranks are back."""


class JoinTimeout(MeCeFOError):
    """A restarted rank was not admitted within mecefo.join_timeout_s (the job goes on without it)."""


class JobFinished(MeCeFOError):
    """A restarted rank came back after training ended: nothing to rejoin; exit cleanly."""


def exit_now(code: int, message: Optional[str] = None) -> NoReturn:
    """End this process at once, from any thread, with `code` (one of the codes above): `message`
    to stderr first; no interpreter teardown (destructors of broken process groups can abort, and
    a thread cannot unwind the main one's waits). Child processes of `multiprocessing` (upstream's
    checkpoint writers) are ended first: the teardown that would have ended them does not run, and
    an orphan would keep the launcher's output pipe open."""
    import os
    import sys

    if message:
        print(message, file=sys.stderr, flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    if "multiprocessing" in sys.modules:
        import multiprocessing

        children = multiprocessing.active_children()
        for child in children:
            child.terminate()
        for child in children:
            child.join(timeout=5)
    os._exit(code)


def run_to_exit(main, *, usage: tuple = (ValueError,), close=None):
    """Run `main()` and end the process as the launchers expect of a MeCeFO rank: the one mapping
    from how a job ends to exit codes, used by the examples and both upstream adapters.

    * JobFinished (a restarted rank came back after training ended): a note, returns None.
    * GaveUp: why, and where the checkpoint of the last committed step is; exit GAVE_UP_EXIT_CODE.
    * NotAMember (left out: presumed failed, or its replica lost a rank): exit RETIRED_EXIT_CODE so
      its supervisor (mecefo-launch or the keeper) restarts it.
    * `usage` errors (bad input before training) and JobConflict: "error: ..."; exit USAGE_EXIT_CODE.

    These three end without interpreter teardown (`exit_now`): a give-up follows a failure, and a
    usage error can come while a peer waits in a collective; the destructors of such process groups
    can std::terminate, and the launcher would read SIGABRT instead of the code.

    Args:
        close: (finished: bool) -> None, run when `main` returns (True) or exits on its own
            (SystemExit: True when its code is 0).
    """
    import sys

    try:
        out = main()
    except JobFinished as e:
        print(f"MeCeFO: {e}", file=sys.stderr, flush=True)
        return None
    except GaveUp as e:
        where = f"checkpoint of the last committed step written to {e.checkpoint}" if e.checkpoint else \
            "no checkpoint written here"
        exit_now(GAVE_UP_EXIT_CODE, f"MeCeFO: cannot continue: {e} ({where})")
    except NotAMember as e:
        exit_now(RETIRED_EXIT_CODE, f"MeCeFO: {e}")
    except (JobConflict,) + tuple(usage) as e:
        exit_now(USAGE_EXIT_CODE, f"error: {e}")
    except SystemExit as e:  # the script's own exits (upstream's --exit-interval, its signal handler)
        if close is not None:
            close(e.code in (None, 0))
        raise
    if close is not None:
        close(True)
    return out
