"""The checkpoint a job writes when it gives up: one whole replica writes it (every rank of it its
shard), the first to get here that holds the state of the last committed step; the store records
where it is. A replica that lost a rank holds only some shards and writes nothing."""

from __future__ import annotations

import json
import logging
from typing import Callable, Optional, Sequence

from megatron_mecefo.elastic.topology import Grid

__all__ = ["write_checkpoint"]


def write_checkpoint(store, grid: Grid, rank: int, *, step: int, has_state: bool,
                     save: Optional[Callable[[], str]], survivors: Optional[Sequence[int]],
                     log: logging.LoggerAdapter) -> Optional[str]:
    """Write the give-up checkpoint from this rank if its replica is the one; returns its path
    (None: another replica writes it, this one cannot, or it failed: the reason is logged).

    Args:
        survivors: the live ranks the failure left (None: unknown; the replica counts as whole).
    """
    try:
        replica = grid.replica_of(rank)
        whole = grid.tp * grid.pp == 1 or survivors is None or replica in grid.live_replicas(survivors)
        if not whole:
            log.error("no checkpoint from this rank: its replica lost a rank")
            return None
        if not has_state or save is None:
            return None
        if store.compare_set("job/checkpoint_writer", "", str(replica)).decode() != str(replica):
            return None  # another replica writes it
        path = save()
        store.set("job/checkpoint", json.dumps({"path": path, "step": step, "rank": rank}))
        log.error("checkpoint of step %d written to %s", step, path)
        return path
    except Exception as e:  # the give-up must not hang or mask the reason
        log.error("could not write the give-up checkpoint: %s", e)
        return None
