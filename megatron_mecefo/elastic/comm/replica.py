"""A replica's own process group: the T*P ranks of one data-parallel index, formed per replica epoch.

With tensor or pipeline parallelism a replica is several ranks. torch.distributed's default group
(and Megatron's parallel_state on top of it) spans one replica, so its tensor- and pipeline-parallel
collectives never wait on another replica. When any rank of a replica fails, the whole replica
leaves the job (its surviving ranks exit; the launcher restarts them), and the new incarnations
form a fresh group: a new *round* of the replica's rendezvous, under its own store prefix, so no
key of the broken group is read again.

Rounds (store keys `replica{d}/round`, `replica{d}/round{r}/slot/{local}`, `.../count`):
a rank claims its slot in the current round with compare-and-set. A slot that already holds another
incarnation means the round belongs to an earlier epoch: the rank moves the replica to the next
round (compare-and-set, so two ranks that see it together agree on one) and claims there. The round
is complete when all T*P slots are claimed by live incarnations: a slot whose incarnation the
launcher saw exit (`exited/{rank}/{incarnation}`, a rank restarted again before its mates came
back) moves the replica on too. A rank waiting for it follows the replica to a newer round if a
mate moves it on. Waits end early when the job has finished or failed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from typing import Callable, List, Optional

import torch.distributed as dist

from megatron_mecefo.errors import (RETIRED_EXIT_CODE, JobAborted, JobFinished, JoinTimeout, MeCeFOError, ReplicaLost,
                                   exit_now)

__all__ = ["replica_round", "watch_replica", "mark_started", "replica_collectives"]

logger = logging.getLogger(__name__)

_STARTED = threading.Event()


def mark_started() -> None:
    """The runtime has joined the job: from now on the job's end is its business, not the watch's."""
    _STARTED.set()


def _check_job(store: dist.Store, rank: int) -> None:
    if store.check(["job/failed"]):
        raise JobAborted(f"[rank {rank}] the job gave up: {json.loads(store.get('job/failed'))['reason']}")
    if store.check(["job/finished"]):
        raise JobFinished(f"[rank {rank}] the job finished")


def _holds_a_dead_slot(store: dist.Store, base: str, r: int, size: int) -> bool:
    """A slot of round r claimed by an incarnation the launcher saw exit (`exited/{rank}/{inc}`)."""
    for local in range(size):
        key = f"{base}/round{r}/slot/{local}"
        if store.check([key]):
            incarnation, rank = store.get(key).decode().split(":")
            if store.check([f"exited/{rank}/{incarnation}"]):
                return True
    return False


def replica_round(store: dist.Store, *, replica: int, local_rank: int, size: int, incarnation: int, rank: int,
                  timeout_s: float, poll_s: float = 0.05, owners: Optional[List[str]] = None,
                  while_waiting: Optional[Callable[[], None]] = None) -> dist.PrefixStore:
    """Wait until every rank of `replica` has claimed its slot in one round; return that round's store
    prefix, for `init_process_group(store=..., rank=local_rank, world_size=size)`.

    Args:
        store: the job's namespaced store.
        local_rank: this rank's index in the replica (tp + T * pp, Megatron's order inside one replica).
        incarnation: this process's incarnation (a restarted rank counts up).

    Raises:
        JobFinished / JobAborted: the job ended while the replica waited for its ranks.
        JoinTimeout: the replica's other ranks did not come within `timeout_s`.
    """
    base = f"replica{replica}"
    store.add(f"{base}/round", 0)
    me = f"{incarnation}:{rank}"
    deadline = time.monotonic() + timeout_s
    while True:
        r = int(store.get(f"{base}/round"))
        owner = store.compare_set(f"{base}/round{r}/slot/{local_rank}", "", me).decode()
        if owner != me:  # a stale round: an earlier incarnation holds this slot
            store.compare_set(f"{base}/round", str(r), str(r + 1))
            continue
        store.add(f"{base}/round{r}/count", 1)
        while int(store.add(f"{base}/round{r}/count", 0)) < size or _holds_a_dead_slot(store, base, r, size):
            _check_job(store, rank)
            if while_waiting is not None:
                while_waiting()
            if _holds_a_dead_slot(store, base, r, size):  # an incarnation that claimed a slot died meanwhile
                store.compare_set(f"{base}/round", str(r), str(r + 1))
            if int(store.get(f"{base}/round")) != r:
                break  # a mate found this round stale: follow it to the next one
            if time.monotonic() > deadline:
                raise JoinTimeout(f"[rank {rank}] the other ranks of replica {replica} did not start within "
                                  f"{timeout_s:.0f} s (round {r})")
            time.sleep(poll_s)
        else:
            logger.info("[rank %d] replica %d formed in round %d", rank, replica, r)
            if owners is not None:
                owners[:] = [store.get(f"{base}/round{r}/slot/{i}").decode() for i in range(size)]
            return dist.PrefixStore(f"{base}/round{r}/pg", store)


def watch_replica(connect: Callable[[], dist.Store], owners: List[str], rank: int, under_launcher: bool,
                  interval_s: float = 0.5) -> None:
    """A daemon thread that ends this process when its replica cannot train: a rank of its round
    exited (the launcher's `exited/{rank}/{incarnation}`: retire, so the launcher restarts it), or
    the job ended before this rank joined it (a start-up collective would otherwise wait for a mate
    that is gone, up to the default group's timeout)."""
    mates = [o for o in owners if o.split(":")[1] != str(rank)]
    if not mates:
        return

    def run():
        try:
            store = connect()
        except Exception:
            return
        while True:
            time.sleep(interval_s)
            try:
                gone = [o for o in mates if store.check(["exited/{1}/{0}".format(*o.split(":"))])]
                ended = not _STARTED.is_set() and (store.check(["job/finished"]) or store.check(["job/failed"]))
            except Exception:  # the store is gone: the job is over
                return
            if gone:
                exit_now(RETIRED_EXIT_CODE if under_launcher else 0,
                         f"[mecefo] rank {rank}: rank {gone[0].split(':')[1]} of this replica exited: the replica "
                         "leaves the job; leaving so the launcher restarts it")
            if ended:
                exit_now(0, f"[mecefo] rank {rank}: the job ended before this replica joined it")

    threading.Thread(target=run, name=f"mecefo-replica-watch-{rank}", daemon=True).start()


@contextlib.contextmanager
def replica_collectives(tp_pp: int, rank: int, step: int, events):
    """Collectives inside this rank's replica (tensor/pipeline parallel) run in the block: one that
    fails means a rank of the replica crashed or hangs, and the replica leaves the job (ReplicaLost;
    it rejoins once its ranks are restarted). A no-op with `tp_pp` (T x P) = 1."""
    try:
        yield
    except RuntimeError as e:
        if tp_pp == 1 or isinstance(e, MeCeFOError):
            raise
        first = str(e).splitlines()[0][-200:] if str(e) else type(e).__name__
        events.write("replica_lost", step=step, error=first)
        raise ReplicaLost(f"[rank {rank} step {step}] a collective of this rank's replica failed ({first}): "
                          "the replica leaves the job and rejoins when its ranks are restarted") from e
