"""Admission of restarted ranks: the request, the joiners a commit names, and the orphan check.

A restarted rank clears its exit mark, sets `join/{rank}` = "waiting" and appends itself to the join
log (counted in `join/count`), then waits for `joinee/{rank}` to name its generation. The member
that decides a commit reads one counter per step (`Joins.pending`): only when it moved does it read
the log. A waiting rank ends the job when no rank of the newest generation holding the state is
left (`OrphanWatch`): nobody could admit it or send it the state.
"""

from __future__ import annotations

import json
import time
from typing import Callable, Iterable, List, Optional, Sequence

from megatron_mecefo.elastic.membership import keys
from megatron_mecefo.elastic.membership.liveness import Liveness
from megatron_mecefo.errors import JobAborted, JobFinished, JoinTimeout, StateLost

__all__ = ["Joins", "OrphanWatch", "announce", "check_job", "latest_agreement"]

POLL_S = 0.1


class Joins:
    """What one rank knows of the join requests (see the module docstring)."""

    def __init__(self, store, rank: int, whole: Callable[[Iterable[int]], List[int]], liveness: Liveness) -> None:
        self.store, self.rank, self.whole, self.liveness = store, rank, whole, liveness
        self._count = 0
        self._logged: List[int] = []
        self._pending: tuple = (None, [])

    def _requests(self) -> List[int]:
        count = int(self.store.add(keys.JOIN_COUNT, 0))
        if count != self._count:
            self._count = count
            self._logged = keys.parse_join_log(self.store.get(keys.JOIN_LOG))
        return self._logged

    def pending(self, members: Sequence[int], generation: Optional[int] = None) -> List[int]:
        """Restarted ranks that asked to join, are not members and are alive, by whole replicas: a
        replica is admitted once all its ranks wait. One store call when nobody asked since the last
        call for the same members of the same generation."""
        requests = self._requests()
        key = (self._count, tuple(members), generation)
        if self._pending[0] != key:
            waiting = [r for r in requests if r not in members and self.store.get(keys.join(r)).decode() != "admitted"]
            waiting = self.liveness.scan(waiting) if waiting else []
            self._pending = (key, sorted(set(self.whole(set(members) | set(waiting))) - set(members)))
        return self._pending[1]

    def asking(self, ranks: Sequence[int]) -> set:
        """Among `ranks`, restarted incarnations waiting to be named for a generation: they come in at
        a step boundary, never to an agreement, so waiting for them would only run out its deadline."""
        out = set()
        for r in set(ranks) & set(self._requests()):
            if r != self.rank and self.store.get(keys.join(r)) == b"waiting" \
                    and self.store.check([keys.joinee(r)]) and not self.store.get(keys.joinee(r)):
                out.add(r)
        return out

    def request(self, deadline: float, announced: Optional[Callable[[], None]] = None) -> int:
        """Announce this restarted rank; return the generation it is admitted to (Membership.request_join)."""
        store, me = self.store, self.rank
        store.set(keys.joinee(me), "")
        store.delete_key(keys.exited(me))
        self.liveness.forget()
        announce(store, me)
        if announced is not None:
            announced()
        watch = OrphanWatch(store, me, self.liveness.timeout_s)
        while True:
            value = store.get(keys.joinee(me)).decode()
            if value:
                store.set(keys.join(me), "admitted")
                return int(value)
            check_job(store, me)
            if time.monotonic() > deadline:
                raise JoinTimeout(f"[rank {me}] not admitted within mecefo.join_timeout_s of its start")
            watch.check()
            time.sleep(POLL_S)


def announce(store, rank: int) -> None:
    """Rank `rank` asks to join: waiting, in the log, counted."""
    store.set(keys.join(rank), "waiting")
    store.append(keys.JOIN_LOG, f"{rank},")
    store.add(keys.JOIN_COUNT, 1)


def latest_agreement(store, since: int = 0) -> tuple:
    """(generation, agreement dict) of the newest published agreement at or after generation `since`."""
    g = since
    while store.check([keys.agreed(g + 1)]):
        g += 1
    if not store.check([keys.agreed(g)]):
        return g, None
    return g, keys.read_agreement(store.get(keys.agreed(g)))


class OrphanWatch:
    """Polled by a rank waiting outside the job (to be admitted, or for its trace's rejoin step):
    raises StateLost, and marks the job failed, once no live rank of the newest generation holds
    the state for longer than `timeout_s` (heartbeat_timeout_s); nobody could admit it or send it
    the state. One scan of the holders' heartbeats every half second. Needs only the store: a rank
    waiting for its replica's mates has no Membership yet (launch/bootstrap.py)."""

    def __init__(self, store, rank: int, timeout_s: float) -> None:
        self.store, self.liveness = store, Liveness(store, rank, timeout_s)
        self.since = 0
        self.orphaned_since: Optional[float] = None
        self.next_check = time.monotonic() + timeout_s

    def check(self) -> None:
        now = time.monotonic()
        if now < self.next_check:
            return
        self.next_check = now + 0.5
        store, me = self.store, self.liveness.rank
        self.since, agreed = latest_agreement(store, self.since)
        members = [r for r in (agreed or {}).get("members", []) if r != me]
        waiting = set(keys.parse_join_log(store.get(keys.JOIN_LOG))) if store.check([keys.JOIN_LOG]) else set()
        holders = [r for r in members if r not in waiting or store.get(keys.join(r)).decode() != "waiting"]
        if agreed is not None and not agreed.get("lost") and self.liveness.scan(holders):
            self.orphaned_since = None
        elif self.orphaned_since is None:
            self.orphaned_since = now
        elif now - self.orphaned_since > self.liveness.timeout_s:
            reason = (f"no rank holding the training state is left (generation {self.since} had members "
                      f"{(agreed or {}).get('members')}; none is alive)")
            store.compare_set(keys.JOB_FAILED, "", keys.failure(reason, me))
            raise StateLost(f"[rank {me}] {reason}")


def check_job(store, rank: int) -> None:
    """Raise if the job has ended: JobAborted when a rank gave up, JobFinished when it is done."""
    if store.check([keys.JOB_FAILED]):
        info = json.loads(store.get(keys.JOB_FAILED))
        raise JobAborted(f"[rank {rank}] the job gave up: {info['reason']}")
    if store.check([keys.JOB_FINISHED]):
        raise JobFinished(f"[rank {rank}] the job finished")
