"""MeCeFO's exceptions. Messages name the generation, rank and step where known, and the knob."""

from __future__ import annotations

__all__ = ["MeCeFOError", "RankFailure", "NoCoverAvailable", "AgreementTimeout", "NotAMember", "JobFinished"]


class MeCeFOError(RuntimeError):
    """Base class of MeCeFO's errors."""


class RankFailure(MeCeFOError):
    """A peer failed (crash or hang) during a step; the step will be redone by the survivors."""


class NoCoverAvailable(MeCeFOError):
    """A failed replica has no healthy, non-covering neighbour: the job cannot continue."""


class AgreementTimeout(MeCeFOError):
    """Survivors did not agree on a new generation in time (mecefo.agree_timeout_s)."""


class NotAMember(MeCeFOError):
    """This rank was left out of the agreed generation (it was presumed failed): it must stop."""


class JobFinished(MeCeFOError):
    """A restarted rank came back after training ended: nothing to rejoin; exit cleanly."""
