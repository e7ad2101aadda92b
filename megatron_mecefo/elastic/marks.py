"""What a host keeps in the job's store and asks of the job when training ends (integrations/
record.py): a mark per (tp, pp) position (the last step record it wrote, so a restarted lead
rewrites nothing), and which replica speaks for the lead once the lead may have died."""

from __future__ import annotations

from typing import Optional

from megatron_mecefo.elastic.current import Current

__all__ = ["HostMarks"]


class HostMarks:
    def __init__(self, store, now: Current, membership) -> None:
        self._store, self._now, self._membership = store, now, membership

    def read(self, name: str) -> Optional[str]:
        """The host's mark `name` for this rank's position (None: never set)."""
        key = self._key(name)
        return self._store.get(key).decode() if self._store.check([key]) else None

    def write(self, name: str, value: str) -> None:
        self._store.set(self._key(name), value)

    def leads_among_whole(self) -> bool:
        """This rank's replica is the lowest live one whose ranks all still beat now (the lead may
        have died since the generation formed): who speaks for the lead at the end of training."""
        grid = self._now.grid
        live = [r for r in sorted(self._now.cover.live)
                if set(grid.ranks_of_replica(r)) <= set(self._membership.alive(grid.ranks_of_replica(r)))]
        return bool(live) and live[0] == self._now.replica

    def _key(self, name: str) -> str:
        tp, pp = self._now.grid.position(self._now.rank)
        return f"{name}/t{tp}p{pp}"
