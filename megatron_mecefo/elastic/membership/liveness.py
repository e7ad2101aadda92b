"""Liveness: every rank's heartbeat, scanned by one rank at a time, and the waits built on it.

* Each rank bumps `hb/{rank}` from a thread every heartbeat_interval_s (one store call). A rank is
  presumed failed when its counter has not moved for heartbeat_timeout_s of the observer's clock (no
  clock sync), at once when the launcher marked its exit (a value below 0, keys.mark_exited); a
  SIGSTOPped rank's counter stops too.
* A scan reads any number of heartbeats in one call (`multi_get`).
* The generation's lowest member scans every member once per beat from its heartbeat thread
  (`StallReport`, one call per interval in the job) and writes the ranks it saw stalled when that
  set changes. An agreement's publisher starts from that report (`Liveness.learn_stalls`), so a
  hung rank, stalled for the whole collective timeout before anyone looks, is not watched again
  for heartbeat_timeout_s first.
* `await_key`: every member waits for one key (a decision, a generation formed) server-side
  (`store.wait` on a poke key that whoever sets the key sets for all members in one call). Its
  heartbeat thread keeps a vigil meanwhile: the lowest member not presumed dead scans the others
  once per beat and settles the key when one of them is dead; every other member checks a few
  members below it, and takes the watch over when they are all dead. So a wait costs each member
  O(1) calls, and the job one scan per beat. No wait on the training thread's connection times
  out early: a timed-out `wait` on a libuv TCPStore server (torch 2.13's default) can stall that
  connection's next calls by 5 s when other clients wait too (measured; docs/design.md).

The heartbeat thread also refreshes what the training thread must not ask the store for itself on
every collective: whether its current step was declared failed (`Heartbeat.aborted`).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from datetime import timedelta
from typing import Callable, Dict, Iterable, List, Optional, Sequence

import torch.distributed as dist

from megatron_mecefo.elastic.membership import keys

__all__ = ["Heartbeat", "Liveness", "StallReport", "await_key", "backoff"]

logger = logging.getLogger("megatron_mecefo.elastic.membership")


ABSENT = "<absent>"
"""compare_set's expected value that no key holds: `compare_set(key, ABSENT, ABSENT)` reads a key
in one call if it exists, and returns ABSENT otherwise."""


def backoff(first: float = 0.0002, last: float = 0.002):
    """Poll delays of the one rank that polls: start at 0.2 ms (a store round trip is ~20 us on
    loopback), grow to 2 ms: a late wake-up delays the next step of every member."""
    delay = first
    while True:
        yield delay
        delay = min(last, delay * 1.5)


class Liveness:
    """One rank's view of the others' heartbeats (see the module docstring)."""

    def __init__(self, store: dist.Store, rank: int, timeout_s: float) -> None:
        self.store, self.rank, self.timeout_s = store, rank, timeout_s
        self.seen: Dict[int, tuple] = {}
        """rank -> (last counter, local time it last changed)."""
        self._exists: set = set()

    def forget(self) -> None:
        self.seen.clear()

    def scan(self, ranks: Iterable[int]) -> List[int]:
        """The ranks among `ranks` presumed alive, in one store call (two the first time a rank is
        seen). A rank that has not started its heartbeat yet counts as alive: the caller's deadline
        bounds how long it is waited for."""
        now = time.monotonic()
        others = sorted({r for r in ranks if r != self.rank})
        out = [self.rank] if self.rank in ranks else []
        if not others:
            return out
        new = [r for r in others if r not in self._exists]
        if new and not self.store.check([keys.hb(r) for r in new]):
            for r in new:  # multi_get waits for missing keys: make them ("not started")
                self.store.add(keys.hb(r), 0)
        self._exists.update(new)
        values = self.store.multi_get([keys.hb(r) for r in others])
        for r, raw in zip(others, values):
            value = int(raw)
            if value < 0:  # the launcher's exit mark
                self.seen[r] = (value, float("-inf"))
                continue
            if value == 0:
                out.append(r)
                continue
            last = self.seen.get(r)
            if last is None or last[0] != value:
                self.seen[r] = (value, now)
                out.append(r)
            elif now - last[1] < self.timeout_s:
                out.append(r)
        return sorted(out)

    def stalls(self) -> Dict[int, list]:
        """{rank: [counter, seconds it has not moved]} of the ranks seen stalled (exit marks apart)."""
        now = time.monotonic()
        return {r: [value, round(now - since, 3)] for r, (value, since) in self.seen.items()
                if value > 0 and now - since >= self.timeout_s}

    def learn_stalls(self) -> None:
        """Start from the watcher's report (keys.STALE, one call): a rank reported stalled at the
        counter it still shows counts as stalled since then. A counter that moved meanwhile, or a
        rank this view watched for longer, keeps this view's own observation."""
        raw = self.store.compare_set(keys.STALE, ABSENT, ABSENT)
        if raw == ABSENT.encode():
            return
        now = time.monotonic()
        for r, (value, seconds) in json.loads(raw).items():
            r = int(r)
            last = self.seen.get(r)
            if last is None or (last[0] == value and last[1] > now - seconds):
                self.seen[r] = (value, now - seconds)

    def why_dead(self, rank: int) -> str:
        last = self.seen.get(rank)
        if last is None:
            return "no heartbeat"
        if last[0] < 0:
            return "its process exited"
        return f"no heartbeat for {time.monotonic() - last[1]:.1f} s"


class StallReport:
    """On the generation's lowest member, from its heartbeat thread: one scan of every member per
    beat, and keys.STALE rewritten when the set of stalled ranks changes (see the module docstring)."""

    def __init__(self, members: Sequence[int], rank: int, timeout_s: float) -> None:
        self.members, self.rank, self.timeout_s = sorted(members), rank, timeout_s
        self._liveness: Optional[Liveness] = None
        self._written: Optional[set] = None

    def __call__(self, store: dist.Store) -> None:
        if self._liveness is None or self._liveness.store is not store:
            self._liveness = Liveness(store, self.rank, self.timeout_s)
        self._liveness.scan(self.members)
        stalls = self._liveness.stalls()
        if set(stalls) != self._written:
            store.set(keys.STALE, json.dumps(stalls))
            self._written = set(stalls)


class Heartbeat:
    """The thread that keeps this rank alive in the others' eyes, and the few things it watches.

    Args:
        connect: opens this thread's own store connection (reopened after a failed call).
        on_beat: called with that connection after each beat (the exclusion watch, membership.py).
    """

    def __init__(self, store: dist.Store, connect: Callable[[], dist.Store], rank: int, *, interval_s: float,
                 timeout_s: float, on_beat: Optional[Callable[[dist.Store], None]] = None) -> None:
        self.store, self._connect, self.rank = store, connect, rank
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self._on_beat = on_beat
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._abort_key: Optional[str] = None
        self._aborted_key: Optional[str] = None
        self._asked = float("-inf")
        self.vigil: Optional[Callable[[dist.Store], None]] = None
        """What the training thread asks this thread to watch while it waits (await_key)."""
        self.lost_since: Optional[float] = None
        """When the store stopped answering (time.time()), once it failed for heartbeat_timeout_s."""

    def start(self) -> None:
        # a restarted incarnation goes on above the launcher's exit mark (keys.mark_exited)
        value = int(self.store.add(keys.hb(self.rank), 1))
        if value <= 0:
            self.store.set(keys.hb(self.rank), str(1 - value + 1))
        self._thread = threading.Thread(target=self._run, name=f"mecefo-heartbeat-{self.rank}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval_s + 1)

    def watch_abort(self, key: Optional[str]) -> None:
        """From now on, each beat also checks whether `key` (the current step's decision) exists."""
        self._abort_key = key

    def aborted(self, key: str) -> bool:
        """Whether a beat saw `key` set (at most heartbeat_interval_s old; no store call). Beats
        check `key` only while this is being asked (a collective is waited for)."""
        self._asked = time.monotonic()
        return self._aborted_key == key

    def _run(self) -> None:
        # A failed store call is retried on a new connection for up to heartbeat_timeout_s: a
        # transient error (a loaded store host) must not silence a healthy rank for good. Past
        # that the store is gone: the job is ending.
        store, failing_since = None, None
        while True:
            try:
                if store is None:
                    store = self._connect()
                store.add(keys.hb(self.rank), 1)
                failing_since = None
                key = self._abort_key
                if key is not None and key != self._aborted_key and \
                        time.monotonic() - self._asked < 2 * self.interval_s and store.check([key]):
                    self._aborted_key = key
                if self._on_beat is not None:
                    self._on_beat(store)
                vigil = self.vigil
                if vigil is not None:
                    vigil(store)
            except Exception:
                store = None
                failing_since = failing_since or time.monotonic()
                if time.monotonic() - failing_since > self.timeout_s:
                    # the training thread learns it at its next commit (committing.Committer's confirmation)
                    self.lost_since = time.time() - self.timeout_s
                    return
            if self._stop.wait(self.interval_s):
                return


def poke_key(key: str, rank: int) -> str:
    """What `rank` waits for server-side while it waits for `key` (see `await_key`)."""
    return f"{key}/poke/{rank}"


def settle(store: dist.Store, key: str, value: str, members: Sequence[int]) -> bytes:
    """Set `key` to `value` unless it is set (compare-and-set), then wake every member waiting for
    it (one call for all of them). Returns the value that stands."""
    current = store.compare_set(key, "", value)
    ranks = sorted(members)
    store.multi_set([poke_key(key, r) for r in ranks], ["1"] * len(ranks))
    return current


class Vigil:
    """What the heartbeat thread watches while the training thread waits for `key` (each beat, on
    the heartbeat's own connection): `key` set without a poke, the job's end, and, on the lowest
    member not presumed dead, the others' heartbeats (then it settles `key` to `on_dead`). Every
    other member checks only the few members below it, so a beat costs the job O(N) calls."""

    BELOW = 4
    """How many of the members below it a waiting member checks per beat."""

    def __init__(self, key: str, members: Sequence[int], rank: int, timeout_s: float, on_dead: Optional[str]) -> None:
        self.key, self.members, self.rank, self.on_dead = key, sorted(members), rank, on_dead
        self.poke = poke_key(key, rank)
        self._wakes = 0
        self._timeout_s = timeout_s
        self._liveness: Optional[Liveness] = None
        self._dead: set = set()

    def woken(self) -> None:
        """The waiter woke with `key` still unset: the next wake needs a fresh poke key."""
        self._wakes += 1
        self.poke = f"{poke_key(self.key, self.rank)}/{self._wakes}"

    def __call__(self, store: dist.Store) -> None:
        if store.check([self.key]) or store.check([keys.JOB_FAILED]) or store.check([keys.JOB_FINISHED]):
            store.set(self.poke, "1")
            return
        if self.on_dead is None:
            return
        if self._liveness is None or self._liveness.store is not store:
            self._liveness = Liveness(store, self.rank, self._timeout_s)
        below = [r for r in self.members if r < self.rank and r not in self._dead][:self.BELOW]
        if below:
            alive = self._liveness.scan(below)
            self._dead |= set(below) - set(alive)
            if alive or [r for r in self.members if r < self.rank and r not in self._dead]:
                return
        if len(self._liveness.scan(self.members)) < len(self.members):  # this rank watches: one scan of all
            logger.warning("[rank %d] a member of %s is presumed dead: %s", self.rank, self.key, self.on_dead)
            settle(store, self.key, self.on_dead, self.members)


def await_key(store: dist.Store, heartbeat: "Heartbeat", key: str, members: Sequence[int], *, deadline: float,
              on_dead: Optional[str], on_deadline: str, timeout_s: float, check_job: Callable[[], None]) -> bytes:
    """Wait until `key` is set, and return its value (see the module docstring): O(1) calls.

    The training thread waits server-side for its poke (`settle` wakes every member at once; a
    rank that sets `key` otherwise leaves it to the waiters' heartbeat threads, one beat later),
    with no timed-out wait before `deadline` (time.monotonic(); then `key` is set to `on_deadline`
    by compare-and-set: a value that got there first stands). The heartbeat thread keeps the vigil
    (`Vigil`: a dead member settles `key` to `on_dead`; None: nobody watches the members), and
    wakes it when the job ended (`check_job` raises then).
    """
    vigil = Vigil(key, members, heartbeat.rank, timeout_s, on_dead)
    heartbeat.vigil = vigil
    try:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                value = store.compare_set(key, "", on_deadline)
                if value.decode() == on_deadline:
                    logger.warning("[rank %d] %s was not set in time: %s", heartbeat.rank, key, on_deadline)
                return value
            try:
                store.wait([vigil.poke], timedelta(seconds=remaining))
            except dist.DistStoreError:
                continue
            value = store.compare_set(key, ABSENT, ABSENT)
            if value != ABSENT.encode():
                return value
            check_job()
            vigil.woken()
    finally:
        heartbeat.vigil = None
