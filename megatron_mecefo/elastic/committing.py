"""Whether a step commits, alike on every member: step 2 of the failure path (step.py).

With a replicated optimizer state there is no store round trip: after its reduction a member joins
one more all-reduce, the confirmation (`_confirm`), and commits where it completed. A member whose
confirmation failed while the others' completed still holds the step's reduced gradients; the
agreement that follows (regrouping.py) says whether a member committed the step (then it commits
it too, with its own bit-identical gradients) or none did (then the step is redone). With a sharded
optimizer state every shard steps or none does: the members vote in the store (`_voted_commit`,
membership.votes.decide). A committed step leaves its marks: the progress trace-restarted ranks read,
the step record, and the joiners its commit admits (formed at the next step boundary).
"""

from __future__ import annotations

import time
from typing import Any, Dict, Optional

import torch

from megatron_mecefo.elastic.comm import groups
from megatron_mecefo.elastic.comm.replica import replica_collectives
from megatron_mecefo.elastic.current import Current
from megatron_mecefo.elastic.latch import StepLatch
from megatron_mecefo.elastic.membership import Membership, keys
from megatron_mecefo.elastic.regrouping import Regrouping
from megatron_mecefo.errors import IncompleteStep, MeCeFOError, StoreLost

__all__ = ["Committer", "STORE_ERRORS"]

STORE_ERRORS = (torch.distributed.DistNetworkError, torch.distributed.DistStoreError)
"""What a store call raises when the store is gone (a killed store resets its connections)."""


class Committer:
    """Decides this rank's steps (see the module docstring).

    Args:
        now: the rank's standing (reads it; sets `pending` when a commit admits joiners).
        world: the original number of ranks; sharding: the sharded optimizer (None: replicated).
        store, store_health, membership: the job's store (counting its calls), its health, the
            control plane.
        latch, regrouping: the step in progress; the generations (`recover` after a failed step).
        fire: () -> the injection point of a phase of the current step.
        device: () -> the device of the generation's collectives.
        steps_log, events, log: the step records, the events, the rank's logger.
    """

    def __init__(self, now: Current, *, world: int, sharding, store, store_health, membership: Membership,
                 latch: StepLatch, regrouping: Regrouping, fire, device, steps_log, events, log) -> None:
        self.now, self._world, self._sharding = now, world, sharding
        self._store, self._health, self._membership = store, store_health, membership
        self._latch, self._regrouping, self._fire, self._device = latch, regrouping, fire, device
        self._steps_log, self._events, self._log = steps_log, events, log
        self._t_step, self._calls = 0.0, 0

    def begin(self, t_step: float) -> None:
        """A step starts: its record counts time and store calls from here."""
        self._t_step, self._calls = t_step, self._store.calls

    def step_aborted(self) -> bool:
        """A member declared this step failed (polled while waiting on a collective; no store call:
        the heartbeat thread watches the step's decision, membership.watch_step)."""
        return self._membership.votes.aborted(self.now.generation, self.now.step)

    def commit(self, record: Dict[str, Any]) -> bool:
        now = self.now
        ok = not self._latch.failed
        whole, ran = now.grid.dp * now.k, self._latch.ran  # summed over my position's data-parallel group
        if ok and ran is not None and ran != whole:
            raise IncompleteStep(
                f"[gen {now.generation} rank {now.rank} step {now.step}] the members ran {ran} of the "
                f"{whole} micro-batches of the global batch: the step is not committed (the training loop must run "
                "every micro-batch of plan().micro_batches)")
        if self._sharding is not None:  # every shard steps or none does: voted in the store
            return self._voted_commit(ok, record)
        step, ran = now.step, now.as_ran()
        confirmed, admit, store_lost = self._confirm(ok)
        if store_lost:  # every member learnt it in the same collectives: none commits this step
            raise StoreLost(self._health.message(step), writer=now.grid.replica_of(min(now.members)))
        if confirmed:
            self._committed(step, {**ran, **record}, admit=admit)
            return True
        if ok:  # reduced here; whether the others committed is known at the agreement
            self._log.warning("step %d reduced here but not confirmed by every member; holding its gradients "
                              "until the survivors agree", step)
        # peers still waiting in this step's collectives stop (their heartbeat thread sees the mark)
        self._membership.votes.abort(now.generation, step)
        if self._regrouping.recover(reduced=ok):  # the others committed it: take the same step with these gradients
            self._committed(step, {**ran, **record}, admit=False)
            return True
        return False

    def position_barrier(self) -> None:
        """Every live member of this rank's position (its data-parallel group) got here."""
        groups.allreduce_min_(self.now.group, torch.zeros(1, device=self._device()))

    def replica_min(self, flags: list) -> list:
        """The element-wise MIN of `flags` over this rank's replica (T x P ranks; as is with T = P = 1)."""
        grid = self.now.grid
        if grid.tp * grid.pp == 1:
            return flags
        with replica_collectives(grid.tp * grid.pp, self.now.rank, self.now.step, self._events):
            return groups.replica_min(flags)

    # -- replicated state: the confirmation -------------------------------------------------------

    def _confirm(self, reduced: bool) -> tuple:
        """The commit's collective: the MIN over the data-parallel group of "every rank of my
        replica reduced" (with T or P > 1: a MIN over the replica first, which every rank of the
        replica joins whatever its own reduction did, and once more after, so a replica commits
        alike). True: every member holds this step's reduced gradients and commits it. False: this
        rank does not commit now; if it `reduced`, it keeps its gradients, and the agreement that
        follows says whether a member committed the step (then it commits it too) or none did (then
        the step is redone). A replica that did not all reduce stays out of the data-parallel
        confirmation, which then completes nowhere.

        The same collectives carry, as -MAX, whether the lowest member named restarted ranks to
        admit at this step's end (`_admission`): every rank of every position learns it with no
        store call of its own, and, as -1, whether a rank found the store lost (then no member
        commits: `commit` raises StoreLost everywhere). Returns (confirmed, admit, store_lost)."""
        flags = self.replica_min([1.0 if reduced else 0.0, -1.0 if reduced and self._admission() else 0.0,
                                  -1.0 if self._health.lost_since() is not None else 0.0])
        if flags[0] == 1.0:
            t = torch.tensor(flags, device=self._device())
            try:
                groups.allreduce_min_(self.now.group, t, should_abort=self.step_aborted)
                self._fire("commit")
                flags = t.tolist()
            except MeCeFOError:
                raise
            except Exception as e:  # gloo: connection closed / timed out; an injected error
                self._latch.report_error(e)
                flags = [0.0, 0.0, flags[2]]
        flags = self.replica_min(flags)
        return flags[0] == 1.0, flags[0] == 1.0 and flags[1] < 0, flags[2] < 0

    def _admission(self) -> bool:
        """On the lowest member (one store call: the join count; more only when it moved): the
        restarted ranks this step's commit admits, written under the step's key."""
        now = self.now
        if self._sharding is not None or not now.decides:
            return False  # a sharded state's commit is voted: its decider names the joiners
        try:
            joiners = self._membership.joins.pending(now.members, now.generation)
            if joiners:
                self._store.set(keys.admit(now.generation, now.step), ",".join(map(str, joiners)))
        except Exception as e:  # the store is gone: every member learns it in this confirmation
            self._health.failed(e)
            return False
        return bool(joiners)

    def _committed(self, step: int, record: Dict[str, Any], admit: bool) -> None:
        """A committed step's bookkeeping: the progress mark, the step record, and the joiners its
        commit admits (named under the step's key by the lowest member, `_admission`)."""
        now = self.now
        self._mark_progress(step)
        if admit:
            joiners = [int(r) for r in self._store.get(keys.admit(now.generation, step)).decode().split(",")]
            candidates = sorted(set(now.members) | set(joiners))
            now.pending = (now.generation + 1, candidates)
            if now.decides:  # the candidates first: a named joiner reads them
                self._store.set(keys.candidates(now.generation + 1), ",".join(map(str, candidates)))
                for j in joiners:
                    self._store.set(keys.joinee(j), str(now.generation + 1))
        self._write_step(step, record)
        if admit:
            self._fire("admit", step)

    def _mark_progress(self, step: int) -> None:
        """The lowest member's one store call of a committed step: the progress trace-restarted ranks
        read. A store that fails here is found by the next step's confirmation or vote."""
        if self.now.decides and self._health.lost_since() is None:
            try:
                self._store.set(keys.PROGRESS, str(step + 1))
            except Exception as e:  # a store error of any kind: the job's end is agreed in a collective
                self._health.failed(e)

    def _write_step(self, step: int, record: Dict[str, Any]) -> None:
        """`record` holds `Current.as_ran()`'s fields (a step committed after a regroup ran in the last one)."""
        self._steps_log.write("step", step=step, step_time_s=time.monotonic() - self._t_step,
                              store_calls=self._store.calls - self._calls, **record)

    # -- sharded state: the vote ------------------------------------------------------------------

    def _voted_commit(self, ok: bool, record: Dict[str, Any]) -> bool:
        now = self.now
        step = now.step
        try:
            decision = self._membership.votes.decide(now.generation, step, now.members, ok, self._world)
        except STORE_ERRORS as e:
            if not ok:  # this rank's reduction failed as well: no collective left to agree in
                raise
            self._health.failed(e)
            decision = None  # whether the others read a commit is agreed below
        if decision is not None and decision.commit and not ok:
            raise IncompleteStep(
                f"[gen {now.generation} rank {now.rank} step {step}] the step was decided commit although this "
                "rank's gradient reduction failed: the store's decisions do not match this job; not committing")
        if decision is None or decision.commit:
            everyone_read = self._everyone_read_commit(decision is not None)
            if everyone_read is False or (everyone_read is None and decision is None):
                # the store was lost between the decision and a member's read: no shard steps, and the
                # members agreed on that in a collective, so they agree on the writer as well
                writer = now.grid.replica_of(min(now.members)) if everyone_read is False else None
                raise StoreLost(self._health.message(step), writer=writer)
        if decision.commit:
            self._mark_progress(step)
            if decision.joiners:
                now.pending = (decision.next_generation, sorted(set(now.members) | set(decision.joiners)))
            self._write_step(step, {**now.as_ran(), **record})
            if decision.joiners:
                self._fire("admit", step)
            return True
        self._regrouping.recover()
        return False

    def _everyone_read_commit(self, read: bool) -> Optional[bool]:
        """After a sharded step's vote: the MIN over every member of "read the commit decision" (a
        member whose store call failed says no), so either every shard steps or none does. None: the
        collective failed here (a peer died after the vote; the decision stands where it was read)."""
        try:
            t = torch.tensor(self.replica_min([1.0 if read else 0.0]), device=self._device())
            groups.allreduce_min_(self.now.group, t, should_abort=self.step_aborted)
            flags = self.replica_min(t.tolist())
        except MeCeFOError:
            raise
        except Exception as e:  # gloo: connection closed / timed out; the parameter gather finds the peer
            self._log.warning("the confirmation after step %d's vote failed: %s", self.now.step,
                              str(e).splitlines()[0][:200])
            return None
        return flags[0] == 1.0
