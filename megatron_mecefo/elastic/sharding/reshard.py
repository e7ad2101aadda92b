"""Re-sharding a ShardedOptimizer (zero.py) over a new generation: the layout shared, the
parameters re-sent from a surviving holder, every range's state moved to its new holders in one
all-to-all, built aside until the generation formed (`install`). The layout and the moves
themselves are pure (shards.py)."""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_mecefo.elastic.sharding.shards import Reshard, ShardLayout, reshard
from megatron_mecefo.errors import GaveUp

__all__ = ["Resharding", "ShardLost"]


class ShardLost(GaveUp):
    """A range of the sharded optimizer state has no live holder (its owner and the holder of its
    copy failed together, or there was no copy): the job ends with the last checkpoint."""


class Resharding:
    """The re-shard of one ShardedOptimizer (`opt`), whose held ranges and layout it replaces."""

    def __init__(self, opt) -> None:
        self.opt = opt

    def regroup(self, group, peers: Sequence[int], replicas: Sequence[int], holders: Sequence[int], rank: int,
                replicas_total: int, midway: Callable[[], None] = lambda: None,
                should_abort: Optional[Callable[[], bool]] = None):
        """Re-shard over the generation whose data-parallel group at this position is `group`.

        Call on every peer (in the group's order: `peers` global ranks, `replicas` their replica
        indices; `replicas_total`: D of the original job); `holders`: the peers holding the training
        state (joiners do not); `midway` runs once the layout is shared, before anything moves (an
        injection point). The new held ranges are built aside; `install` makes them current once
        the whole generation formed. The parameters are re-sent in place: the holders' values,
        which every survivor takes in any generation that forms. `should_abort` is polled while
        waiting (groups.wait_): a peer that saw the generation fail ends the wait at once.

        Raises:
            ShardLost: a range of the state has no surviving holder (on_loss "give_up").
            whatever the collectives raise (a peer died): the optimizer state is unchanged.
        """
        me = peers.index(rank)
        donor = min(peers.index(h) for h in holders)
        old = self._share_layout(group, donor, me, replicas_total, should_abort)
        midway()
        new = ShardLayout(self.opt.numel, tuple(sorted(replicas)), neighbour_copy=self.opt.neighbour_copy)
        held_by = {replicas[peers.index(h)] for h in holders}
        mine = replicas[me]
        if old is None:  # the whole state on every holder (fresh, or loaded): carve locally or send
            change = _whole_layout_moves(new, held_by)
        else:
            change = reshard(old, new, held_by)
        if old is not None:  # first, so that a give-up checkpoint's module is the same on every survivor
            self._sync_parameters(group, old, held_by, replicas, should_abort)
        if change.lost and self.opt.on_loss != "reinit":
            lost = ", ".join(f"[{a}, {b})" for a, b in change.lost)
            error = ShardLost(f"the sharded optimizer state lost elements {lost} of {self.opt.numel}: their owner and "
                              "the holder of their copy failed together (or shard_redundancy is \"none\"); the job ends "
                              "with the last checkpoint (on_shard_loss: \"reinit\" rebuilds such ranges instead)")
            error.peers = list(peers)  # this position's survivors: they write their ranges of the give-up checkpoint
            raise error
        fresh = {into: self.opt._new_held(a, b) for into, (a, b) in new.held(mine).items()}
        width = len(self.opt.keys) + len(self.opt.fresh_scalars)
        # every remote move in one all-to-all (gloo's send/recv cannot be polled, so a peer could not
        # stop waiting when another saw the generation fail); each pair's moves in their order
        n = len(replicas)
        outgoing, incoming = [[] for _ in range(n)], [[] for _ in range(n)]
        for mv in change.moves:
            if mv.src == mine:
                payload = self._slice(mv.start, mv.end, whole=old is None)
                if mv.local:
                    self._fill(fresh[mv.into], mv, payload)
                else:
                    outgoing[replicas.index(mv.dst)].append(payload.float())
            elif mv.dst == mine:
                incoming[replicas.index(mv.src)].append(mv)
        if any(not mv.local for mv in change.moves):  # the moves are the same on every peer: all call it or none
            from megatron_mecefo.elastic.comm import groups

            device = next(p.device for g in self.opt.optimizer.param_groups for p in g["params"])
            send_splits = [sum(t.numel() for t in ts) for ts in outgoing]
            recv_splits = [sum((mv.end - mv.start) * width for mv in mvs) for mvs in incoming]
            sent = torch.cat([t.to(device) for ts in outgoing for t in ts]) if any(send_splits) else \
                torch.empty(0, device=device)
            got = torch.empty(sum(recv_splits), device=device)
            groups.wait_(group.alltoall_base(got, sent, recv_splits, send_splits, dist.AllToAllOptions()),
                         should_abort)
            at = 0
            for mvs in incoming:
                for mv in mvs:
                    size = (mv.end - mv.start) * width
                    self._fill(fresh[mv.into], mv, got[at:at + size])
                    at += size
        for held in fresh.values():  # a lost range (reinit) keeps its fresh state: zeros, step 0
            self.opt._bind(held)
        return new, mine, fresh, change, group, list(replicas)

    def install(self, pending) -> None:
        """Make the re-sharded state current (the generation formed)."""
        self.opt.layout, self.opt.replica, self.opt.held, self.opt.last_reshard, self.opt.group, self.opt._group_replicas = pending
        self.opt._source = None
        self.opt.optimizer.state.clear()  # the whole state it may have held (a loaded checkpoint) is now sharded

    def _share_layout(self, group, donor: int, me: int, width: int, should_abort=None) -> Optional[ShardLayout]:
        """The donor's layout (its live replicas; -1: the whole state), broadcast to the peers."""
        info = torch.full((width,), -2, dtype=torch.int64)
        if me == donor:
            live = list(self.opt.layout.live) if self.opt.layout is not None else [-1]
            info[:len(live)] = torch.tensor(live)
        from megatron_mecefo.elastic.comm import groups

        groups.broadcast_(group, info, donor, should_abort)
        live = [int(x) for x in info if x != -2]
        if live == [-1]:
            return None
        return ShardLayout(self.opt.numel, tuple(live), neighbour_copy=self.opt.neighbour_copy)

    def _sync_parameters(self, group, old: ShardLayout, held_by, replicas: Sequence[int], should_abort=None) -> None:
        """Every old shard's parameters from a surviving holder (its owner, else its copy's holder, else
        the lowest survivor) to every peer: after a gather that a death cut short, no rank keeps a
        half-updated model."""
        from megatron_mecefo.elastic.comm import groups

        for owner in old.live:
            a, b = old.shard(owner)
            holder = owner if owner in held_by else old.copy_holder(owner)
            if holder not in held_by:  # lost (reinit): any one survivor's values, the same everywhere
                holder = min(held_by)
            buf = self.opt._read(a, b) if holder == self.opt.replica else torch.empty(b - a)
            groups.broadcast_(group, buf, replicas.index(holder), should_abort)
            if holder != self.opt.replica:
                self.opt._write(a, buf)
        if self.opt.on_parameters is not None:
            self.opt.on_parameters()

    def _slice(self, start: int, end: int, whole: bool) -> torch.Tensor:
        """What a move of [start, end) carries: the per-element state key after key, then the
        scalars per element, from what this rank holds."""
        if whole:
            return torch.cat([self._whole_state(start, end)] + self._whole_scalar_elems(start, end))
        for held in self.opt.held.values():
            if held.start <= start and end <= held.end:
                return torch.cat([held.state[k][start - held.start:end - held.start] for k in self.opt.keys]
                                 + self.opt._scalar_elems(held, start, end))
        raise RuntimeError(f"[{start}, {end}) is not held here: the re-shard's moves and the held ranges disagree")

    def _fill(self, held, mv, payload: torch.Tensor) -> None:
        n, at = mv.end - mv.start, slice(mv.start - held.start, mv.end - held.start)
        for i, k in enumerate(self.opt.keys):
            held.state[k][at] = payload[i * n:(i + 1) * n]
        for i, k in enumerate(self.opt.fresh_scalars, start=len(self.opt.keys)):
            held.scalars[k][at] = payload[i * n:(i + 1) * n]

    # -- the whole state (before the first generation): the host optimizer's, or a checkpoint's ----

    def _whole_state(self, start: int, end: int) -> torch.Tensor:
        if self.opt._source is not None:
            return torch.cat([self.opt._source.read(k, start, end) for k in self.opt.keys])
        out = []
        for k in self.opt.keys:
            if k == "master":
                out.append(self.opt._read(start, end))
                continue
            flat = torch.zeros(end - start)
            for p, sl, at in self.opt._spans(start, end):
                st = self.opt.optimizer.state.get(p, {})
                if k in st:
                    flat[at:at + sl.stop - sl.start] = st[k].reshape(-1)[sl].float()
            out.append(flat)
        return torch.cat(out)

    def _whole_scalar_elems(self, start: int, end: int) -> List[torch.Tensor]:
        if self.opt._source is not None:
            return self.opt._source.scalars(self.opt.fresh_scalars, start, end)
        out = [torch.full((end - start,), float(v)) for v in self.opt.fresh_scalars.values()]
        for p, sl, at in self.opt._spans(start, end):
            st = self.opt.optimizer.state.get(p)
            if st:
                for i, k in enumerate(self.opt.fresh_scalars):
                    out[i][at:at + sl.stop - sl.start] = float(st[k])
        return out



def _whole_layout_moves(new: ShardLayout, held_by) -> Reshard:
    """Every holder holds everything: each range from itself if it holds, else from the lowest holder."""
    from megatron_mecefo.elastic.sharding.shards import Move

    first = min(held_by)
    moves = tuple(Move(dst if dst in held_by else first, dst, a, b, into)
                  for dst in new.live for into, (a, b) in new.held(dst).items() if a < b)
    return Reshard(moves, ())
