"""The checkpoint a job writes when it gives up: one whole replica writes it (every rank of it its
shard), the first to get here that holds the state of the last committed step; the store records
where it is. A replica that lost a rank holds only some shards and writes nothing. A sharded
optimizer state is written by every rank that holds some of it (its own ranges), whichever
replica writes the rest."""

from __future__ import annotations

import functools
import json
import logging
import time
from typing import Callable, Optional, Sequence

from megatron_mecefo.elastic.plan.topology import Grid

__all__ = ["GiveUpCheckpoint", "write_checkpoint", "collect_given_up", "SHARDS_VISIBLE_S"]

SHARDS_VISIBLE_S = 5.0
"""How long a host's give-up `save` looks for the holders' shard files, which GiveUpCheckpoint has
waited for already: time for a shared file system to show them."""


def collect_given_up(sharding, directory: str, log) -> Optional[tuple]:
    """In a host's give-up `save`: the whole sharded optimizer state from the files every holder
    wrote under `directory` (unstamped), for the host to write in its upstream format
    (`ShardedOptimizer.collect`; None when they are not all visible within SHARDS_VISIBLE_S)."""
    return sharding.files.collect(directory, "", SHARDS_VISIBLE_S, log)


def write_checkpoint(store, grid: Grid, rank: int, *, step: int, has_state: bool,
                     save: Optional[Callable[[], str]], survivors: Optional[Sequence[int]],
                     log: logging.LoggerAdapter, writer: Optional[int] = None) -> Optional[str]:
    """Write the give-up checkpoint from this rank if its replica is the one; returns its path
    (None: another replica writes it, this one cannot, or it failed: the reason is logged).

    Args:
        survivors: the live ranks the failure left (None: unknown; the replica counts as whole).
        writer: the replica that writes it, agreed without the store (the store is lost: nothing is
            recorded there); None: the first whole replica to claim it in the store.
    """
    try:
        replica = grid.replica_of(rank)
        whole = grid.tp * grid.pp == 1 or survivors is None or replica in grid.live_replicas(survivors)
        if not whole:
            log.error("no checkpoint from this rank: its replica lost a rank")
            return None
        if not has_state or save is None:
            return None
        if writer is not None:
            if writer != replica:
                return None
        elif store.compare_set("job/checkpoint_writer", "", str(replica)).decode() != str(replica):
            return None  # another replica writes it
        path = save()
        if writer is None:
            store.set("job/checkpoint", json.dumps({"path": path, "step": step, "rank": rank}))
        log.error("checkpoint of step %d written to %s", step, path)
        return path
    except Exception as e:  # the give-up must not hang or mask the reason
        log.error("could not write the give-up checkpoint: %s", e)
        return None


class GiveUpCheckpoint:
    """This rank's part of the give-up checkpoint. `save`: () -> path, the host's checkpoint of the
    last committed step (None: none); `save_shards`: writes this rank's ranges of a sharded
    optimizer state (`sharding`) beside it. The writer of each position waits (up to `wait_s`)
    until every survivor of that position has written its ranges (or said it holds none), so the
    host's `save` can gather them into its own format: in the store, or, where the store is lost
    (a writer agreed without it), in `position_barrier`, a collective over the position's members."""

    def __init__(self, store, grid: Grid, rank: int, *, save: Optional[Callable[[], str]],
                 save_shards: Optional[Callable[[], None]], sharding, log: logging.LoggerAdapter,
                 wait_s: float = 60.0, position_barrier: Optional[Callable[[], None]] = None) -> None:
        self.store, self.grid, self.rank, self.log, self.wait_s = store, grid, rank, log, wait_s
        self._save, self._save_shards, self._sharding = save, save_shards, sharding
        self._position_barrier = position_barrier

    def write(self, step: int, *, has_state: bool, survivors: Optional[Sequence[int]],
              shard_peers: Optional[Sequence[int]] = None, writer: Optional[int] = None) -> Optional[str]:
        """Write what this rank holds of the checkpoint of `step`; returns the checkpoint's path if
        this rank's replica wrote it (see write_checkpoint). `shard_peers`: this position's
        survivors where the give-up knows them better than `survivors` (a lost shard)."""
        save = self._save
        if self._save_shards is not None:
            if has_state and self._sharding.layout is not None:
                try:  # every holder writes its own ranges of the sharded optimizer state
                    self._save_shards()
                except Exception as e:
                    self.log.error("could not write this rank's optimizer shards: %s", e)
            if writer is not None:  # the store is lost: the position's members meet in a collective
                self._shards_written_everywhere()
            else:
                self.store.set(_SHARDS_DONE.format(step=step, rank=self.rank), "1")
                if save is not None:
                    save = functools.partial(self._after_shards, step, shard_peers or survivors, save)
        return write_checkpoint(self.store, self.grid, self.rank, step=step, has_state=has_state, save=save,
                                survivors=survivors, log=self.log, writer=writer)

    def _shards_written_everywhere(self) -> None:
        try:
            if self._position_barrier is not None:
                self._position_barrier()
        except Exception as e:  # the host's save still looks for the files (SHARDS_VISIBLE_S)
            self.log.error("the members of this position did not all confirm their optimizer shards: %s", e)

    def _after_shards(self, step: int, survivors: Optional[Sequence[int]], save: Callable[[], str]) -> str:
        position = self.grid.position(self.rank)
        mates = [r for r in (range(self.grid.world) if survivors is None else survivors)
                 if self.grid.position(r) == position]
        keys = [_SHARDS_DONE.format(step=step, rank=r) for r in mates]
        deadline = time.monotonic() + self.wait_s
        while not self.store.check(keys) and time.monotonic() < deadline:
            time.sleep(0.05)
        return save()


_SHARDS_DONE = "job/giveup_shards/{step}/{rank}"
"""Set by each rank once its ranges of the sharded state are written (or it holds none)."""
