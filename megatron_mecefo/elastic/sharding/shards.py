"""Pure layout of a sharded optimizer state (ZeRO-1) over the live replicas of a generation, each
shard also held by the replica that would cover its owner, and the moves that re-shard it when the
generation changes.

Per (tp, pp) position the optimizer state (fp32 master parameters where the host keeps them, the
moments) is one flat range [0, numel). A generation's live replicas split it into contiguous,
balanced shards in replica order. With `shard_redundancy: "neighbour"` each replica also holds a
copy of the shard of the previous live replica on the ring (topology.ring_after): the one it
covers when that replica fails alone (topology.ring_cover), so the replica that takes over a failed rank's micro-batches
already holds its optimizer state.

On a new generation every shard and copy of the new layout comes from a replica that still holds
it (its old owner, or the holder of its copy), or is lost: both holders died in one step, or there
was no copy (one live replica, or no redundancy). What to do with a lost range (rebuild it, or give
up) is the caller's decision. Pure functions of (numel, live replicas, survivors): every rank
computes the same plan, and the simulator can call them too.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Iterable, List, Optional, Tuple

from megatron_mecefo.elastic.plan.topology import ring_after

__all__ = ["shard_bounds", "ShardLayout", "Move", "Reshard", "reshard"]

Range = Tuple[int, int]


def shard_bounds(numel: int, parts: int, align: int = 1) -> List[Range]:
    """[start, end) of `parts` contiguous shards of [0, numel): each boundary a multiple of `align`
    (the last end is numel), sizes differ by at most `align`."""
    if numel < 0 or parts < 1 or align < 1:
        raise ValueError(f"need numel >= 0, parts >= 1, align >= 1; got {numel}, {parts}, {align}")
    units = -(-numel // align)  # whole aligned units, the last one possibly short
    base, extra = divmod(units, parts)
    bounds, start = [], 0
    for i in range(parts):
        end = min(numel, start + (base + (i < extra)) * align)
        bounds.append((start, end))
        start = end
    return bounds


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """Who owns, and who holds a copy of, which range of one position's optimizer state."""

    numel: int
    live: Tuple[int, ...]
    """The generation's live replicas (data-parallel indices of the original job)."""
    neighbour_copy: bool = True
    align: int = 1

    def __post_init__(self) -> None:
        if not self.live or list(self.live) != sorted(set(self.live)):
            raise ValueError(f"live replicas must be sorted, distinct and non-empty: {self.live}")

    def shard(self, replica: int) -> Range:
        """The range `replica` owns (updates in the optimizer step)."""
        return dict(zip(self.live, shard_bounds(self.numel, len(self.live), self.align)))[replica]

    def copy_of(self, replica: int) -> Optional[int]:
        """Whose shard `replica` holds a copy of: the previous live replica on the ring (None: no copy)."""
        if not self.neighbour_copy or len(self.live) < 2:
            return None
        return ring_after(self.live, replica)[-1]

    def copy_holder(self, owner: int) -> Optional[int]:
        """Who holds a copy of `owner`'s shard: the next live replica on the ring (None: nobody)."""
        if not self.neighbour_copy or len(self.live) < 2:
            return None
        return ring_after(self.live, owner)[0]

    def held(self, replica: int) -> Dict[str, Range]:
        """What `replica` keeps: its "shard" and, with redundancy, the "copy" of its predecessor's."""
        out = {"shard": self.shard(replica)}
        if self.copy_of(replica) is not None:
            out["copy"] = self.shard(self.copy_of(replica))
        return out

    def held_bytes(self, replica: int, bytes_per_element: int) -> int:
        return sum(end - start for start, end in self.held(replica).values()) * bytes_per_element


@dataclasses.dataclass(frozen=True)
class Move:
    """Elements [start, end) go from `src` (which holds them) to `dst`'s "shard" or "copy"."""

    src: int
    dst: int
    start: int
    end: int
    into: str

    @property
    def local(self) -> bool:
        return self.src == self.dst


@dataclasses.dataclass(frozen=True)
class Reshard:
    moves: Tuple[Move, ...]
    lost: Tuple[Range, ...]
    """Ranges no surviving replica holds (merged, sorted)."""

    def sent_by(self, replica: int) -> List[Move]:
        return [m for m in self.moves if m.src == replica and not m.local]

    def received_by(self, replica: int) -> List[Move]:
        return [m for m in self.moves if m.dst == replica and not m.local]


def reshard(old: ShardLayout, new: ShardLayout, holding: Iterable[int]) -> Reshard:
    """The moves that fill every shard and copy of `new` from the replicas of `old` in `holding` (the
    survivors that still hold their old shard and copy; a joiner holds nothing), and what is lost.

    A range is taken from its old owner when it holds, else from its copy's holder; a replica that
    already holds a range keeps it (a local move)."""
    if old.numel != new.numel:
        raise ValueError(f"the state changed size: {old.numel} -> {new.numel} elements")
    holding = set(holding) & set(old.live)
    pieces: List[Tuple[int, int, List[int]]] = []  # (start, end, replicas holding it, preferred first)
    for owner in old.live:
        start, end = old.shard(owner)
        holders = [r for r in (owner, old.copy_holder(owner)) if r is not None and r in holding]
        pieces.append((start, end, holders))
    moves: List[Move] = []
    lost: List[Range] = []
    for dst in new.live:
        for into, (lo, hi) in new.held(dst).items():
            for start, end, holders in pieces:
                a, b = max(lo, start), min(hi, end)
                if a >= b:
                    continue
                if not holders:
                    lost.append((a, b))
                    continue
                src = dst if dst in holders else holders[0]
                moves.append(Move(src, dst, a, b, into))
    merged: List[Range] = []
    for a, b in sorted(set(lost)):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return Reshard(tuple(moves), tuple(merged))
