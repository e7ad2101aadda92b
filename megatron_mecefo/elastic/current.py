"""Where one rank stands in the job: the generation it trains in and the step it is at.

One object shared by the runtime's parts: the runtime (runtime.py) moves the step, the regrouping
(regrouping.py) installs generations, the committer (committing.py) decides steps. Plain data and
questions about it; no store, no collectives.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Tuple

from megatron_mecefo.elastic.plan.cover_plan import CoverPlan
from megatron_mecefo.elastic.plan.topology import CoverMap, Grid

__all__ = ["Current"]


@dataclasses.dataclass
class Current:
    rank: int
    grid: Grid
    k: int
    """Micro-batches per replica per step."""
    step: int = 0
    generation: int = -1
    members: List[int] = dataclasses.field(default_factory=list)
    group: Any = None
    """This rank's data-parallel group in the generation (None between generations)."""
    cover: Optional[CoverMap] = None
    plan: Optional[CoverPlan] = None
    has_state: bool = False
    """True once this rank holds the training state of `step`: every rank of generation 0, a joiner
    once it has received the state. A rank without it never trains or votes."""
    pending: Optional[Tuple[int, List[int]]] = None
    """(generation, candidates) a commit admitted: formed at the next step boundary."""
    issued: tuple = ()
    """The micro-batches plan() handed out for this step."""

    @property
    def replica(self) -> int:
        return self.grid.replica_of(self.rank)

    @property
    def decides(self) -> bool:
        """This rank is the lowest member: it writes the step's marks in the store."""
        return self.rank == min(self.members)

    def micro_batches_run(self) -> tuple:
        """This step's micro-batches as plan() handed them out (the fold's, if it was not asked)."""
        return self.issued or self.plan.fold.micro_batches(self.replica)

    def leads(self) -> bool:
        """This rank's replica is the lowest live one: it saves (upstream's files) and logs."""
        return self.replica == min(self.cover.live)

    def as_ran(self) -> Dict[str, Any]:
        """The step record's fields of the generation the current step ran in."""
        ran = self.micro_batches_run()
        return dict(generation=self.generation, live=list(self.members),
                    cover={str(k): v for k, v in self.cover.cover.items()}, degraded=self.cover.degraded,
                    micro_batches=[[m.replica, m.index, m.covering] for m in ran],
                    divisor_mha=self.plan.fold.divisor_mha)
