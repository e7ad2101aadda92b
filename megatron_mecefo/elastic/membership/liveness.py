"""Liveness: every rank's heartbeat, scanned by one rank at a time, and the waits built on it.

* Each rank bumps `hb/{rank}` from a thread every heartbeat_interval_s (one store call). A rank is
  presumed failed when its counter has not moved for heartbeat_timeout_s of the observer's clock (no
  clock sync), at once when the launcher marked it EXITED; a SIGSTOPped rank's counter stops too.
* A scan reads any number of heartbeats in one call (`multi_get`).
* `await_key`: every member waits for one key (a decision, a generation formed) server-side
  (`store.wait`), except one watcher, the lowest member not presumed dead, which scans the others
  once per interval and sets the key when one of them is dead. A member wakes every half heartbeat
  timeout to check the members below it, and takes the watch over when they are all dead. So a wait
  costs each member O(1) calls, and the whole job one scan per interval.

The heartbeat thread also refreshes what the training thread must not ask the store for itself on
every collective: whether its current step was declared failed (`Heartbeat.aborted`).
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta
from typing import Callable, Dict, Iterable, List, Optional, Sequence

import torch.distributed as dist

from megatron_mecefo.elastic.membership import keys

__all__ = ["Heartbeat", "Liveness", "await_key", "backoff"]

logger = logging.getLogger("megatron_mecefo.elastic.membership")


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
            if value == keys.EXITED:
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

    def why_dead(self, rank: int) -> str:
        last = self.seen.get(rank)
        if last is None:
            return "no heartbeat"
        if last[0] == keys.EXITED:
            return "its process exited"
        return f"no heartbeat for {time.monotonic() - last[1]:.1f} s"


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

    def start(self) -> None:
        # a restarted incarnation starts over from a value the launcher may have marked EXITED
        self.store.set(keys.hb(self.rank), "1")
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
        """Whether a beat saw `key` set (at most heartbeat_interval_s old; no store call)."""
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
                if key is not None and key != self._aborted_key and store.check([key]):
                    self._aborted_key = key
                if self._on_beat is not None:
                    self._on_beat(store)
            except Exception:
                store = None
                failing_since = failing_since or time.monotonic()
                if time.monotonic() - failing_since > self.timeout_s:
                    return
            if self._stop.wait(self.interval_s):
                return


def await_key(store: dist.Store, liveness: Liveness, key: str, members: Sequence[int], *, deadline: float,
              on_dead: str, on_deadline: str, interval_s: float, check_job: Callable[[], None],
              below: Optional[Callable[[], List[int]]] = None) -> bytes:
    """Wait until `key` is set by a member, and return its value (see the module docstring).

    Args:
        members: the members waiting for it; the lowest one not presumed dead watches the others.
        deadline: time.monotonic() past which `key` is set to `on_deadline` (compare-and-set: a
            value that got there first stands).
        on_dead: what the watcher sets `key` to once a member is presumed dead.
        check_job: raises when the job ended (called at each wake-up).
        below: the members that watch before this one (default: the lower members).
    """
    me = liveness.rank
    members = sorted(members)
    below = below or (lambda: [r for r in members if r < me])
    watching = not below()
    next_scan, delays = 0.0, backoff()
    slice_s = max(0.05, liveness.timeout_s / 2)
    while True:
        now = time.monotonic()
        if now > deadline:
            if store.compare_set(key, "", on_deadline).decode() == on_deadline:
                logger.warning("[rank %d] %s was not set in time: %s", me, key, on_deadline)
            break
        if watching:
            if store.check([key]):
                break
            if now >= next_scan:
                next_scan = now + interval_s
                check_job()
                if len(liveness.scan(members)) < len(members):
                    store.compare_set(key, "", on_dead)
                    continue
            time.sleep(next(delays))
            continue
        try:
            store.wait([key], timedelta(seconds=max(0.01, min(slice_s, deadline - now))))
            break
        except dist.DistStoreError:  # not set yet: is anyone below still watching?
            check_job()
            watching = not liveness.scan(below())
    return store.get(key)
