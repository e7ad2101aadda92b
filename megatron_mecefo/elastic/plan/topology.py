"""Pure planning of who covers whom: the rank grid and the cover map for a set of live ranks.

A job of `world = tp * pp * dp` ranks holds `dp` model replicas. The failure domain is a replica
slice: losing any rank of replica d retires replica d on every pipeline stage (its surviving
tensor- and pipeline-parallel peers idle), and one healthy replica adopts its micro-batches. The
neighbour of a failed replica is the next replica on a ring over data-parallel index that is alive
and not already covering (MECEFO.md: "which neighbor", "several failures"). With tp = pp = 1 a
replica is a rank.

Everything here is a pure function of (grid, live ranks): the runtime, the simulator and the tests
call the same code. Rank layout follows Megatron's default order "tp-cp-ep-dp-pp" (cp = ep = 1):
rank = tp_rank + tp * (dp_rank + dp * pp_rank).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, FrozenSet, Iterable, List, Tuple

from megatron_mecefo.errors import NoCoverAvailable

__all__ = ["Grid", "CoverMap", "ring_after", "ring_cover"]


@dataclasses.dataclass(frozen=True)
class Grid:
    """The (tp, pp, dp) rank grid of the original job."""

    tp: int = 1
    pp: int = 1
    dp: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Grid.{name} must be a positive int, got {value!r}")

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    def coords(self, rank: int) -> Tuple[int, int, int]:
        """(tp_rank, pp_rank, dp_rank) of a global rank."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} outside a world of {self.world}")
        tp_rank = rank % self.tp
        dp_rank = (rank // self.tp) % self.dp
        pp_rank = rank // (self.tp * self.dp)
        return tp_rank, pp_rank, dp_rank

    def rank(self, tp_rank: int, pp_rank: int, dp_rank: int) -> int:
        return tp_rank + self.tp * (dp_rank + self.dp * pp_rank)

    def replica_of(self, rank: int) -> int:
        return self.coords(rank)[2]

    def ranks_of_replica(self, replica: int) -> List[int]:
        return sorted(self.rank(t, p, replica) for t in range(self.tp) for p in range(self.pp))

    def position(self, rank: int) -> Tuple[int, int]:
        """(tp_rank, pp_rank): which shard of the model a rank holds; one data-parallel group each."""
        tp_rank, pp_rank, _ = self.coords(rank)
        return tp_rank, pp_rank

    def whole(self, ranks: Iterable[int]) -> List[int]:
        """The ranks among `ranks` whose replica is complete in `ranks` (sorted)."""
        ranks = set(ranks)
        live = set(self.live_replicas(ranks))
        return sorted(r for r in ranks if 0 <= r < self.world and self.replica_of(r) in live)

    def live_replicas(self, live_ranks: Iterable[int]) -> List[int]:
        """Replicas all of whose ranks are live."""
        live = set(live_ranks)
        return [d for d in range(self.dp) if all(r in live for r in self.ranks_of_replica(d))]


@dataclasses.dataclass(frozen=True)
class CoverMap:
    """Which replicas are live and which live replica adopts each failed one."""

    grid: Grid
    live: Tuple[int, ...]
    """Live replicas (data-parallel indices of the original job), sorted."""
    cover: Dict[int, int]
    """failed replica -> covering replica."""

    @property
    def failed(self) -> Tuple[int, ...]:
        return tuple(sorted(self.cover))

    @property
    def covering(self) -> FrozenSet[int]:
        return frozenset(self.cover.values())

    @property
    def degraded(self) -> bool:
        return bool(self.cover)

    def adopted_by(self, replica: int) -> Tuple[int, ...]:
        """Failed replicas whose micro-batches `replica` runs besides its own."""
        return tuple(sorted(f for f, c in self.cover.items() if c == replica))

    def to_json(self) -> dict:
        return {"live": list(self.live), "cover": {str(k): v for k, v in sorted(self.cover.items())}}

    @classmethod
    def from_json(cls, grid: Grid, data: dict) -> "CoverMap":
        return cls(grid, tuple(data["live"]), {int(k): int(v) for k, v in data["cover"].items()})


def ring_after(live: Iterable[int], replica: int) -> List[int]:
    """The ring's order seen from `replica`: the live replicas after it, going round (itself left
    out). The one neighbour rule: who covers a failed replica (ring_cover) and who holds a copy of a
    replica's optimizer shard (shards.ShardLayout) both read it."""
    live = sorted(live)
    return [r for r in live if r > replica] + [r for r in live if r < replica]


def ring_cover(grid: Grid, live_ranks: Iterable[int]) -> CoverMap:
    """The cover map for the ranks in `live_ranks`.

    Each failed replica, in increasing order, is adopted by the next replica after it on the ring
    that is live and not covering yet. Deterministic: every rank computes the same plan.

    Raises:
        NoCoverAvailable: some failed replica has no healthy, non-covering replica left.
    """
    live = grid.live_replicas(live_ranks)
    failed = [d for d in range(grid.dp) if d not in live]
    cover: Dict[int, int] = {}
    busy = set()
    for f in failed:
        free = [r for r in ring_after(live, f) if r not in busy]
        if free:
            cover[f] = free[0]
            busy.add(free[0])
        else:
            raise NoCoverAvailable(
                f"replica {f} has no healthy neighbour left: {len(failed)} of {grid.dp} replicas failed "
                f"and every live replica ({live or 'none'}) already covers one; MeCeFO absorbs at most "
                f"one failed replica per live replica"
            )
    return CoverMap(grid, tuple(live), cover)
