"""The step in progress as the runtime lends it to the step's reduction (reduction.py): the
generation's group, the fold's divisors, the injection point and the abort poll; the first failure
seen in the step (the latch: the step's later collectives are skipped, and the commit reads it);
and the micro-batches this rank ran, summed with the step's statistics so the commit can check the
whole global batch ran."""

from __future__ import annotations

import time
from typing import Any, Callable, List, Optional

from megatron_mecefo.elastic.plan.costs import CostMeter
from megatron_mecefo.elastic.plan.fold import Fold

__all__ = ["StepLatch"]


class StepLatch:
    """One rank's step in progress (reset by the runtime at every `begin_step`).

    Args:
        group, fold: () -> the current generation's data-parallel group, its fold.
        fire: the runtime's injection point of the current step.
        aborted: () -> a member declared the current step failed (no store call).
        issued: () -> the micro-batches this rank runs in the step (plan()'s, or the fold's).
        costs: this rank's micro-batch cost meter; the step's compute time ends at its statistics.
        computed: called when this rank's compute of the step ends (an injected slow-down stretches it).
        speeds: the replicas' speeds (rebalancing.Rebalancing), summed with the statistics; None: off.
        log: the runtime's logger.
    """

    def __init__(self, *, group: Callable[[], Any], fold: Callable[[], Fold], fire: Callable[[str], None],
                 aborted: Callable[[], bool], issued: Callable[[], tuple], costs: CostMeter,
                 computed: Callable[[], None] = lambda: None, speeds=None, log) -> None:
        self._group, self._fold, self.fire, self.step_aborted = group, fold, fire, aborted
        self._issued, self._costs, self._computed, self._speeds, self._log = issued, costs, computed, speeds, log
        self.reset()

    def reset(self) -> None:
        self.error: Optional[BaseException] = None
        """The step's first failure (without its traceback), or None."""
        self.error_time: Optional[float] = None
        """time.monotonic() of the first failure."""
        self.error_wall: Optional[float] = None
        """time.time() of the first failure, for the event log."""
        self.ran: Optional[int] = None
        """The micro-batches the members of this rank's position ran (None: not counted)."""
        self.speeds: Optional[dict] = None
        """Seconds per micro-batch by live replica, from the step's statistics (None: not summed)."""
        self._counted = False

    @property
    def group(self):
        return self._group()

    @property
    def fold(self) -> Fold:
        """The current generation's fold (its divisors)."""
        return self._fold()

    @property
    def failed(self) -> bool:
        """A failure was latched in this step: its remaining collectives are skipped."""
        return self.error is not None

    def report_error(self, error: BaseException) -> None:
        """Latch a failure seen during the step; later collectives of the step are skipped."""
        if self.error is None:
            # without its traceback: the frames hold the broken group, whose communicator must be
            # freed at the regroup (groups.alive)
            self.error, self.error_time, self.error_wall = error.with_traceback(None), time.monotonic(), time.time()
            self._log.warning("peer failure detected: %s", str(error).splitlines()[0][:200])

    def step_statistics(self, micro_batches: Optional[int]) -> List[float]:
        """What the commit needs summed with the step's statistics: the micro-batches this rank ran
        (and, rebalancing, its replica's speed). The step's compute time ends here."""
        self._computed()
        issued = self._issued()
        seconds = self._costs.end(issued)
        self._counted = micro_batches is not None
        out = [float(micro_batches)] if micro_batches is not None else []
        return out + (self._speeds.statistics(seconds, issued) if self._speeds is not None else [])

    def take_statistics(self, summed: List[float]) -> List[float]:
        """The summed `step_statistics` taken off the end of `summed`; returns the rest."""
        summed = list(summed)
        if self._speeds is not None:
            self.speeds = self._speeds.take(summed)
        if self._counted:
            self.ran = int(round(summed.pop()))
        return summed
