"""MeCeFO's exceptions. Messages name the generation, rank and step where known, and the knob."""

from __future__ import annotations

__all__ = [
    "MeCeFOError", "RankFailure", "GaveUp", "NoCoverAvailable", "StateLost", "AgreementTimeout", "JobAborted",
    "NotAMember", "JoinTimeout", "JobFinished", "GAVE_UP_EXIT_CODE",
]

GAVE_UP_EXIT_CODE = 3
"""Exit status of every rank of a job that gave up; mecefo-launch then ends the job (no restarts)."""


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


class JobAborted(GaveUp):
    """Another rank gave up (one of the reasons above); this rank ends with the job."""


class NotAMember(MeCeFOError):
    """This rank was left out of the agreed generation (it was presumed failed): it must stop."""


class JoinTimeout(MeCeFOError):
    """A restarted rank was not admitted within mecefo.join_timeout_s (the job goes on without it)."""


class JobFinished(MeCeFOError):
    """A restarted rank came back after training ended: nothing to rejoin; exit cleanly."""
