"""The covering budget: how many of a covering rank's own micro-batches run exact, from its own clock.

A covering rank runs its k own micro-batches and the k it adopted. In covering mode (skip the
attention backward, low-rank FFN gradient) each costs `c` seconds, an exact one `a > c`. A normal
rank's step costs k x a. With `covering_budget` B, the covering rank runs e of its own micro-batches
exact, the largest e with

    e x a + (2k - e) x c  <=  B x k x a,    i.e.  e <= k x (B x a - 2c) / (a - c),

so its step stays within B times a normal step while as much of its data as the budget allows is
exact. Both costs are measured on this rank, never configured: `a` from its steps with only exact
micro-batches, `c` from its covering steps (the exact ones' share taken out), each as the median of
the last `window` observations. Until `c` is measured (the first covering step) e is 0: the paper's
rule. With k = 1 the knob is all or nothing: the one own micro-batch runs exact only when
a + c <= B x a, i.e. c <= (B - 1) x a, which the measured costs (c about half of a) rule out for any
budget below about 1.5.

`CoveringBudget` is plain arithmetic; `StepBudget` is its part in a step (the runtime asks it for
the plan's modes and the statistic the reduction sums). No torch, no distribution.
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
import time
from typing import Deque, Dict, Optional, Sequence

__all__ = ["CoveringBudget", "StepBudget"]


class CoveringBudget:
    """Chooses the number of exact own micro-batches of a covering rank (see the module docstring).

    Args:
        budget: B, the covering step's allowed time over a normal step's (> 1).
        window: how many recent observations each cost estimate takes the median of.
    """

    def __init__(self, budget: float, window: int = 5) -> None:
        if not budget > 1.0:
            raise ValueError(f"covering_budget must be > 1, got {budget!r}")
        self.budget = budget
        self._exact: Deque[float] = collections.deque(maxlen=window)
        self._covering: Deque[float] = collections.deque(maxlen=window)

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
        """a: seconds of one exact micro-batch (None until measured)."""
        return statistics.median(self._exact) if self._exact else None

    def covering_cost(self) -> Optional[float]:
        """c: seconds of one covering micro-batch (None until measured)."""
        return statistics.median(self._covering) if self._covering else None

    def exact_own(self, k: int) -> int:
        """e: how many of the k own micro-batches run exact in the next covering step."""
        a, c = self.exact_cost(), self.covering_cost()
        if a is None or c is None:
            return 0
        if c >= a:  # covering is not cheaper here: every own micro-batch may as well be exact
            return k if 2 * k * c <= self.budget * k * a else 0
        e = int(k * (self.budget * a - 2 * c) / (a - c) + 1e-9)
        return max(0, min(k, e))

    def predicted_ratio(self, k: int, e: int) -> Optional[float]:
        """The covering step's time over a normal step's with e exact own micro-batches."""
        a, c = self.exact_cost(), self.covering_cost()
        if a is None or c is None:
            return None
        return (e * a + (2 * k - e) * c) / (k * a)


class StepBudget:
    """The covering budget in a rank's steps: a covering plan's first e own micro-batches run exact
    (e from this rank's clock, `CoveringBudget`), so each covering rank chooses its own modes and the
    attention divisor becomes a statistic the reduction sums over the members (each member's count
    of micro-batches with an exact attention backward).

    Args:
        budget: B (MeCeFOConfig.covering_budget).
        k: micro-batches per replica per step.
        skip_attention: covering micro-batches skip the attention backward in this job.
    """

    def __init__(self, budget: float, k: int, skip_attention: bool) -> None:
        self.costs = CoveringBudget(budget)
        self.k = k
        self.skip_attention = skip_attention
        self.divisor_mha: Optional[int] = None
        """The last reduced step's attention divisor (the members' summed count)."""
        self._t0 = time.monotonic()

    @classmethod
    def for_config(cls, config, k: int) -> Optional["StepBudget"]:
        """The budget a MeCeFOConfig asks for (None: "covering_budget" unset, the fold's modes)."""
        if config.covering_budget is None:
            return None
        return cls(config.covering_budget, k, skip_attention=config.skip_attention and config.approximations_on)

    def begin(self) -> None:
        """A step (or its redo) starts: its compute time counts from here."""
        self._t0 = time.monotonic()

    def modes(self, micro_batches: Sequence, replica: int) -> tuple:
        """The plan's micro-batches with the first e own ones exact, when this rank covers."""
        if all(m.replica == replica for m in micro_batches):
            return tuple(micro_batches)
        exact = self.costs.exact_own(self.k)
        return tuple(dataclasses.replace(m, covering=False, exact_attention=False)
                     if m.replica == replica and m.index < exact else m for m in micro_batches)

    def exact_attention(self, micro_batches: Sequence) -> int:
        """How many of `micro_batches` ran with an exact attention backward."""
        return sum(1 for m in micro_batches if not (m.covering and self.skip_attention) or m.exact_attention)

    def statistic(self, micro_batches: Sequence) -> float:
        """At the reduction: learns this step's compute time (its start to here), and returns the
        count the members sum into the attention divisor."""
        exact = sum(1 for m in micro_batches if not m.covering)
        self.costs.observe(exact, len(micro_batches) - exact, time.monotonic() - self._t0)
        return float(self.exact_attention(micro_batches))

    def record(self, micro_batches: Sequence) -> Dict[str, Optional[int]]:
        """The step record's fields: what this rank chose, and the attention divisor that followed."""
        return {"exact_attention": self.exact_attention(micro_batches), "divisor_mha": self.divisor_mha}
