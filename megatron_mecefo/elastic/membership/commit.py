"""The per-step commit vote and a generation's formed/not-formed outcome, O(1) store calls per member.

* commit: each member counts its ok (`add` on the step's `oks`: one call) after its gradient
  reduction, or decides abort at once (compare-and-set) when its reduction failed. The member whose
  ok completes the count decides commit (naming the joiners that asked meanwhile: one call), and the
  others wait for the decision server-side; the lowest live member watches the others' heartbeats
  (liveness.await_key) and decides abort once one is presumed dead. A decision is one for all: a
  rank that dies after it does not change it, so the optimizer step is all-or-nothing.
* formed: the same count over `ready`; any member that saw the generation fail says "no".
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from typing import Callable, Optional, Sequence

from megatron_mecefo.elastic.membership import keys
from megatron_mecefo.elastic.membership.liveness import Heartbeat, await_key, settle

__all__ = ["Decision", "StepVotes", "decide", "formed", "abort_step", "not_formed"]

logger = logging.getLogger("megatron_mecefo.elastic.membership")

ABORT = json.dumps({"commit": False})


@dataclasses.dataclass(frozen=True)
class Decision:
    commit: bool
    joiners: tuple = ()
    """Ranks to admit in the next generation (only with commit)."""
    next_generation: Optional[int] = None


def decide(store, heartbeat: Heartbeat, generation: int, step: int, members: Sequence[int], ok: bool, *,
           timeout_s: float, hb_timeout_s: float, check_job: Callable[[], None],
           joiners: Callable[[Sequence[int]], list]) -> Decision:
    """Vote ok/abort for this step and return the one decision all members follow (Membership.decide)."""
    key = keys.decision(generation, step)
    if not ok:
        settle(store, key, ABORT, members)
    elif int(store.add(keys.oks(generation, step), 1)) >= len(members):  # the last ok: decide
        admitted = joiners(members)
        decision = {"commit": True, "joiners": admitted}
        if admitted:
            decision["next_generation"] = generation + 1
            store.set(keys.candidates(generation + 1), ",".join(map(str, sorted(set(members) | set(admitted)))))
        if settle(store, key, json.dumps(decision), members).decode() == json.dumps(decision):
            for j in admitted:
                store.set(keys.joinee(j), str(generation + 1))
    raw = await_key(store, heartbeat, key, members, deadline=time.monotonic() + timeout_s, on_dead=ABORT,
                    on_deadline=ABORT, timeout_s=hb_timeout_s, check_job=check_job)
    d = json.loads(raw)
    return Decision(d["commit"], tuple(d.get("joiners", ())), d.get("next_generation"))


def abort_step(store, generation: int, step: int) -> None:
    """Decide abort for (generation, step) unless a decision exists, and mark the generation as not
    formed: peers waiting in `formed()` or already in that step's collective or commit stop waiting
    (a rank leaving a generation that did not form for it)."""
    store.compare_set(keys.formed(generation), "", "no")
    store.compare_set(keys.decision(generation, step), "", ABORT)


def not_formed(store, generation: int) -> bool:
    """Whether a member already decided that `generation` will not form (or the job ended)."""
    if store.check([keys.JOB_FAILED]) or store.check([keys.JOB_FINISHED]):
        return True
    key = keys.formed(generation)
    return store.check([key]) and store.get(key).decode() == "no"


def formed(store, heartbeat: Heartbeat, generation: int, members: Sequence[int], *, timeout_s: float,
           hb_timeout_s: float, check_job: Callable[[], None]) -> bool:
    """Report that this member's group of `generation` is built (and its joiners hold the state);
    return whether the whole generation formed (Membership.formed)."""
    key = keys.formed(generation)
    if int(store.add(keys.ready(generation), 1)) >= len(members):
        settle(store, key, "yes", members)
    raw = await_key(store, heartbeat, key, members, deadline=time.monotonic() + timeout_s, on_dead="no",
                    on_deadline="no", timeout_s=hb_timeout_s, check_job=check_job)
    return raw.decode() == "yes"


class StepVotes:
    """One rank's handle on the per-step vote (Membership.votes): the functions above, with what
    they share."""

    def __init__(self, store, heartbeat: Heartbeat, *, timeout_s: float, hb_timeout_s: float,
                 check_job: Callable[[], None], joiners: Callable[[Sequence[int], int], list]) -> None:
        self._store, self._heartbeat, self._timeout_s, self._hb_timeout_s = store, heartbeat, timeout_s, hb_timeout_s
        self._check_job, self._joiners = check_job, joiners

    def decide(self, generation: int, step: int, members: Sequence[int], ok: bool, world: int) -> Decision:
        """Vote ok/abort for this step and return the one decision all members follow (`decide`).

        Call on every member once per step, after the gradient reduction and before the optimizer.
        A decision that does not come within agree_timeout_s is replaced by abort (compare-and-set:
        if a commit got there first, it stands).
        """
        return decide(self._store, self._heartbeat, generation, step, members, ok, timeout_s=self._timeout_s,
                      hb_timeout_s=self._hb_timeout_s, check_job=self._check_job,
                      joiners=lambda members: self._joiners(members, generation))

    def abort(self, generation: int, step: int) -> None:
        """Decide abort for (generation, step) unless decided, and mark the generation not formed
        (`abort_step`): a rank leaving a generation that did not form for it."""
        abort_step(self._store, generation, step)

    def watch(self, generation: int, step: int) -> None:
        """The heartbeat thread watches this step's decision from now on (`aborted`)."""
        self._heartbeat.watch_abort(keys.decision(generation, step))

    def aborted(self, generation: int, step: int) -> bool:
        """Whether a member declared the step failed, as the heartbeat thread last saw it (no store
        call: polled while waiting on a collective)."""
        return self._heartbeat.aborted(keys.decision(generation, step))
