"""Micro-batch costs: measured on every rank, agreed with every generation.

The cover planner (cover_plan.py) needs what an exact and a covering micro-batch cost. Each rank
measures both from its own steps (`CostMeter`: a step's compute time, from its start to its
reduction, split by the counts of exact and covering micro-batches it ran, the exact cost known from
its healthy steps; each cost the median of the last `window` observations) and posts them when it
checks in for a generation (`Membership.generations.agree(info=...)`). The agreement publishes what its members
posted, and `agreed_costs` reduces that to one `Costs` (the median over the members of their covering
/ exact ratios, exact = 1): every rank of every replica, with T and P > 1 too, derives the same plan,
and no plan depends on one rank's clock. Until some member has run a covering micro-batch, one counts
as DEFAULT_COVERING of an exact one (measured 0.49 at LLaMA-1B layer size and 0.61 at setup A on
CPU: benchmarks/results/covering_cost.json). A covering micro-batch whose attention backward the
floor kept counts as a covering one here. No torch, no distribution.
"""

from __future__ import annotations

import collections
import json
import statistics
import time
from typing import Deque, Mapping, Optional, Sequence

from megatron_mecefo.elastic.plan.cover_plan import Costs

__all__ = ["CostMeter", "agreed_costs", "summarize_costs", "read_costs", "DEFAULT_COVERING"]

DEFAULT_COVERING = Costs().covering
"""A covering micro-batch's cost over an exact one's before any was measured."""


class CostMeter:
    """One rank's measured micro-batch costs (see the module docstring)."""

    def __init__(self, window: int = 5) -> None:
        self._exact: Deque[float] = collections.deque(maxlen=window)
        self._covering: Deque[float] = collections.deque(maxlen=window)
        self._t0 = time.monotonic()

    def begin(self) -> None:
        """A step (or its redo) starts: its compute time counts from here."""
        self._t0 = time.monotonic()

    def end(self, micro_batches: Sequence) -> float:
        """At the step's reduction: this rank ran `micro_batches` (fold.MicroBatch) since `begin`.
        Returns the step's compute seconds."""
        covering, seconds = sum(1 for m in micro_batches if m.covering), time.monotonic() - self._t0
        self.observe(len(micro_batches) - covering, covering, seconds)
        return seconds

    def observe(self, exact: int, covering: int, seconds: float) -> None:
        """A step of this rank ran `exact` exact and `covering` covering micro-batches in `seconds`."""
        if seconds <= 0 or exact + covering == 0:
            return
        if covering == 0:
            self._exact.append(seconds / exact)
            return
        a = self.exact_cost()
        if exact and a is None:  # cannot split the time yet
            return
        c = (seconds - exact * (a or 0.0)) / covering
        if c > 0:
            self._covering.append(c)

    def exact_cost(self) -> Optional[float]:
        """Seconds of one exact micro-batch (None until measured)."""
        return statistics.median(self._exact) if self._exact else None

    def covering_cost(self) -> Optional[float]:
        """Seconds of one covering micro-batch (None until measured)."""
        return statistics.median(self._covering) if self._covering else None

    def info(self) -> str:
        """What this rank posts with its check-in for a generation."""
        return json.dumps({"exact": self.exact_cost(), "covering": self.covering_cost()})


def agreed_costs(info: Mapping[int, str]) -> Costs:
    """The costs a generation plans with, from what its members posted (`CostMeter.info`, by rank):
    exact 1, covering the median of the members' measured ratios (a measured ratio above 1 counts as
    1), or DEFAULT_COVERING when none measured one."""
    ratios = []
    for rank in sorted(info):
        posted = json.loads(info[rank]) if info[rank] else {}
        a, c = posted.get("exact"), posted.get("covering")
        if a and c and a > 0 and c > 0:
            ratios.append(min(1.0, c / a))
    return Costs(exact=1.0, covering=statistics.median(ratios) if ratios else DEFAULT_COVERING)


def summarize_costs(info: Mapping[int, str]) -> str:
    """`agreed_costs` as the string the agreement's publisher publishes (one for any N)."""
    c = agreed_costs(info)
    return json.dumps({"exact": c.exact, "covering": c.covering})


def read_costs(summary: Optional[str]) -> Costs:
    """The costs of `summarize_costs` (None: nothing measured yet)."""
    return Costs(**json.loads(summary)) if summary else agreed_costs({})
