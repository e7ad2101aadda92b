"""Installing generations on one rank: the first one at the start, a rejoin, an admission at a
step boundary, and the survivors' new one after a failure (steps 3 and 4 of the failure path,
step.py). `Formation` (formation.py) agrees and builds a generation; this installs it: the group,
the cover, the plan and, on a joiner, the training state it received; then logs it and watches the
new members' heartbeats.
"""

from __future__ import annotations

import time
from typing import Callable, Optional, Sequence

from megatron_mecefo.elastic.comm import groups
from megatron_mecefo.elastic.comm.transfer import decode_state
from megatron_mecefo.elastic.current import Current
from megatron_mecefo.elastic.formation import Formation
from megatron_mecefo.elastic.latch import StepLatch
from megatron_mecefo.elastic.leaving import retire
from megatron_mecefo.elastic.membership import Membership
from megatron_mecefo.errors import MeCeFOError, NotAMember

__all__ = ["Regrouping"]


class Regrouping:
    """The generations of one rank (see the module docstring).

    Args:
        now: the rank's standing, which this changes (generation, members, group, cover, plan,
            step, has_state, pending).
        formation, membership, latch: the rank's parts (formation.py, membership/, latch.py).
        set_state: loads the training state a joiner received (StateHooks.set).
        cover: the configured cover mode's name, for the log line; collective_timeout_s: bounds
            a group's abort; join_deadline: time.monotonic() by which a restarted rank is back.
    """

    def __init__(self, now: Current, formation: Formation, membership: Membership, latch: StepLatch, *,
                 set_state: Optional[Callable], events, log, cover: str, collective_timeout_s: float,
                 join_deadline: float) -> None:
        self.now, self._formation, self._membership, self._latch = now, formation, membership, latch
        self._set_state, self._events, self._log = set_state, events, log
        self._cover_mode, self._timeout_s, self._join_deadline = cover, collective_timeout_s, join_deadline
        self._detected_wall: Optional[float] = None
        self.rejoined = False
        """True when this rank came in after generation 0 and received the live state from a peer."""

    def join(self, incarnation: int, world: int) -> int:
        """Generation 0 for a first incarnation; otherwise (or when it started too late for it) a
        rejoin at a step boundary. Returns the step to train next."""
        now = self.now
        if incarnation == 0:
            now.has_state = True  # every first incarnation starts from the same initial state
            try:
                self.regroup(0, list(range(world)))
                return now.step
            except NotAMember:  # started too late for generation 0: come in like a restarted rank
                now.has_state = False
                self._log.warning("not in the first generation; joining at the next step boundary")
        t0 = time.monotonic()
        generation, candidates = self._formation.request_join(incarnation, self._join_deadline)
        self.regroup(generation, candidates)
        self.rejoined = True
        self._events.write("rejoined", generation=now.generation, step=now.step, wait_s=time.monotonic() - t0)
        self._log.info("rejoined at step %d", now.step)
        return now.step

    def recover(self, reduced: bool = False) -> bool:
        """Agree on the survivors and regroup. `reduced`: this rank holds the current step's reduced
        gradients (its confirmation failed). Returns True when a member committed that step: this
        rank then commits it too, with those gradients."""
        now = self.now
        t_detect = self._latch.error_time or time.monotonic()
        self._detected_wall = self._latch.error_wall or time.time()
        t0 = time.monotonic()
        self.drop_group()
        self._log.warning("step %d aborted; agreeing on survivors", now.step)
        generation, candidates = now.generation + 1, now.members
        if now.pending is not None:  # the commit had admitted joiners: that generation, with them
            generation, candidates = now.pending
            now.pending = None
        return self.regroup(generation, candidates, detected_at=t_detect, t_start=t0, reduced=reduced)

    def admit_pending(self) -> None:
        """At a step boundary: form the generation a commit admitted joiners into, if any."""
        if self.now.pending is not None:
            generation, candidates = self.now.pending
            self.now.pending = None
            self.regroup(generation, candidates)

    def regroup(self, generation: int, candidates: Sequence[int], detected_at: Optional[float] = None,
                t_start: Optional[float] = None, reduced: bool = False) -> bool:
        """Form the next generation (formation.py) and install it. Returns whether this rank rolls
        its held step forward (`recover`)."""
        now = self.now
        t0 = t_start or time.monotonic()
        self.drop_group()  # a rejoin replaces a healthy group: its communicator goes first
        held = now.step if now.has_state else None
        new = self._formation.form(generation, candidates, held, reduced=reduced)
        rolled = now.rank in new.rolled
        if new.state is not None:
            if held is not None and now.generation >= 0:
                # a member whose state is older than the generation's without holding the step's
                # gradients: it cannot take the newest state mid-step; restarted, it rejoins with it
                raise NotAMember(f"[gen {generation} rank {now.rank}] holds the state of step {held}, the members "
                                 f"step {new.step}: leaving to rejoin with it")
            self._load_state(new.state, new.step)
        now.group, now.generation, now.members = new.group, new.number, list(new.members)
        now.cover, now.plan, now.step = new.cover, new.plan, new.step
        t_done, wall = time.monotonic(), time.time()
        self._events.write(
            "regroup", generation=now.generation, step=now.step, members=now.members,
            cover={str(k): v for k, v in new.cover.cover.items()}, joiners=list(new.joiners), rolled=list(new.rolled),
            detected_at=self._detected_wall if detected_at else None,
            agreed_at=wall - (t_done - new.t_agreed), regrouped_at=wall,
            detect_to_recover_s=(t0 - detected_at) if detected_at else None,
            agree_s=new.t_agreed - t0, regroup_s=t_done - new.t_agreed, plan=new.plan.summary(now.k),
            groups_alive=groups.alive(collect=False),  # 1: the old communicator was freed with its last reference
        )
        if now.generation > 0:
            runners = {f: rs[0] if len(rs) == 1 else list(rs) for f, rs in new.plan.runners().items()}
            self._log.warning("generation %d: members %s, cover %s (%s; slowest replica %.2fx a normal step "
                              "predicted, %d micro-batches approximated)", now.generation, now.members,
                              runners or "none", self._cover_mode, new.plan.slowest / (now.k * new.plan.costs.exact),
                              new.plan.approximated)
        self._membership.watch_liveness(now.members)
        if now.grid.tp * now.grid.pp > 1:
            self._membership.watch_exclusion(now.generation, self._excluded)
        return rolled

    def drop_group(self) -> None:
        """Abort this rank's data-parallel group (bounded: groups.AbortHung when NCCL's abort hangs)
        and drop the reference, so its communicator is freed before the next one is built."""
        group, self.now.group = self.now.group, None
        groups.destroy_group(group, self._timeout_s)

    def _excluded(self, generation: int, members: list) -> None:
        """Left out of a generation (whatever it waits on may never return): retire."""
        retire(self._events, self.now.rank, generation, members, f"generation {generation} was agreed without "
               f"this rank (members {members}): its replica is out of the job")

    def _load_state(self, payload: bytes, step: int) -> None:
        user = decode_state(payload, step=step, rank=self.now.rank)
        if user is not None:
            if self._set_state is None:
                raise MeCeFOError("a rejoining rank needs ElasticRuntime(state=...) to load the training state")
            self._set_state(user)
        self.now.step, self.now.has_state = step, True
