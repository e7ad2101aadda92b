"""What a host and the runtime hand each other: the runtime's StepPlan (this rank's micro-batches
of the step) and the host's StateHooks (its training state, for a rejoining rank and the give-up
checkpoint). Plain data, so a host module imports them without the runtime's machinery."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

from megatron_mecefo.elastic.plan.topology import CoverMap

__all__ = ["StateHooks", "StepPlan"]


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """What this rank does in the current step."""

    step: int
    generation: int
    members: tuple
    cover: CoverMap
    micro_batches: tuple
    """This rank's MicroBatch list: own first, then adopted ones."""
    divisor: int
    divisor_mha: int

    @property
    def covering(self) -> bool:
        return any(m.replica != self.micro_batches[0].replica for m in self.micro_batches)

    @property
    def degraded(self) -> bool:
        return self.cover.degraded


@dataclasses.dataclass(frozen=True)
class StateHooks:
    """What the runtime reads and writes of the host's training state."""

    get: Optional[Callable[[], Any]] = None
    """() -> the training state a rejoining rank receives (model, optimizer, scheduler, counters;
    `step.training_state`); None: nothing but the step."""
    set: Optional[Callable[[Any], None]] = None
    """Loads what `get` returned, on the rejoining rank."""
    save_checkpoint: Optional[Callable[[], str]] = None
    """() -> path: writes a checkpoint of the last committed step when the job gives up (called on
    one rank that holds the state); None: no checkpoint."""
    save_shards: Optional[Callable[[], Any]] = None
    """Writes this rank's shards of a sharded optimizer state into the give-up checkpoint (every
    rank holding state calls it; `save_checkpoint` writes the rest)."""
