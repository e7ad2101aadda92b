"""Liveness, agreement on the members of each generation, and the per-step commit decision.

Everything goes through a key-value store (a `torch.distributed.TCPStore` hosted by the launcher or
a daemon, so any training rank may die) and is keyed by generation, so stale keys of an earlier
generation never mislead a later one:

* heartbeats  `hb/{rank}`: a counter each rank bumps from a thread. A rank is presumed failed when
  its counter has not moved for `heartbeat_timeout_s` of the observer's own clock (no clock sync
  needed); a SIGSTOPped rank's counter stops too.
* agreement   `gen{g}/in/{rank}`, `gen{g}/agreed`: survivors check in with the step whose state they
  hold (-1: none, a restarted rank); once every candidate has checked in or is presumed failed, the
  lowest live checked-in rank publishes the agreement (members, joiners = members without the newest
  state, step) with compare-and-set; everyone adopts the first published agreement. A restarted rank
  asking to join is not waited for (it comes in at a step boundary); the publisher logs why each
  candidate was left out. A failure during agreement only delays it; the next generation starts
  over. An agreement with no state holder is never published: "lost" ends the job instead.
* commit      `gen{g}/step{s}/vote/{rank}`, `.../oks`, `.../decision`: each member votes ok/abort
  after its gradient reduction (an ok vote also counts up `oks`; an abort vote decides abort at
  once); the lowest live member decides commit (`oks` reached the member count) or abort (a member
  presumed failed) with compare-and-set, and everyone follows the one decision. A rank that dies
  after the decision does not change it, so the optimizer step is all-or-nothing.
* exits       `exited/{rank}`: set by the launcher when a rank's process ends abnormally, so a
  crash is known at once instead of after heartbeat_timeout_s.
* joins       `join/{rank}`, `joinee/{rank}`: a restarted rank announces itself; the decider names
  the generation it will be admitted to at the next step boundary.
* outcome     `job/finished`, `job/failed` (the reason a rank gave up; every waiting rank and the
  launcher read it and end).

It knows nothing of models or gradients.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Sequence

import torch.distributed as dist

from megatron_mecefo.errors import AgreementTimeout, JobAborted, JobFinished, JoinTimeout, NoCoverAvailable, NotAMember, \
    StateLost

__all__ = ["Membership", "Decision", "Agreement", "OrphanWatch"]

logger = logging.getLogger(__name__)

_POLL_S = 0.02


_FAST_POLL_S = 0.002


def _backoff():
    """Poll delays for the per-step commit: start at 0.2 ms (a store round trip is ~20 us on
    loopback), grow to 2 ms. A fixed 20 ms poll cost ~10 % of a healthy step, and a backoff up to
    20 ms still cost ~7 % with pipeline parallelism, where the last stage waits a whole backward for
    the first and a late wake-up delays the next collective (benchmarks/healthy_overhead.py)."""
    delay = 0.0002
    while True:
        yield delay
        delay = min(_FAST_POLL_S, delay * 1.5)


@dataclasses.dataclass(frozen=True)
class Decision:
    commit: bool
    joiners: tuple = ()
    """Ranks to admit in the next generation (only with commit)."""
    next_generation: Optional[int] = None


@dataclasses.dataclass(frozen=True)
class Agreement:
    """The agreed composition of one generation."""

    members: tuple
    """Sorted ranks of the generation (joiners included)."""
    joiners: tuple
    """Members without the training state of `step`: they receive it before the generation trains."""
    step: int
    """The step whose training state the generation starts from."""
    info: Mapping[int, str] = dataclasses.field(default_factory=dict)
    """What the members posted with their check-in (`agree(info=...)`), by rank: identical on every member."""

    @property
    def holders(self) -> tuple:
        return tuple(r for r in self.members if r not in self.joiners)


class Membership:
    """Store-backed liveness and agreement for one rank. Call `start()` once, `stop()` at exit.

    Args:
        store: this rank's store client in the job's namespace (used from the training thread).
        connect: opens another such connection, for the heartbeat thread.
        rank: this rank's global rank (stable across generations and restarts).
        heartbeat_interval_s, heartbeat_timeout_s, agree_timeout_s: see MeCeFOConfig.
        whole: ranks -> the ranks among them whose replica is complete (Grid.whole). Generations and
            admissions take whole replicas only; the default (tp = pp = 1) takes every rank.
    """

    def __init__(
        self,
        store: dist.Store,
        connect: Callable[[], dist.Store],
        rank: int,
        *,
        heartbeat_interval_s: float,
        heartbeat_timeout_s: float,
        agree_timeout_s: float,
        whole: Optional[Callable[[Iterable[int]], List[int]]] = None,
    ) -> None:
        self.store = store
        self.whole = whole or (lambda ranks: sorted(ranks))
        self._connect = connect
        self.rank = rank
        self.hb_interval = heartbeat_interval_s
        self.hb_timeout = heartbeat_timeout_s
        self.agree_timeout = agree_timeout_s
        self._seen: Dict[int, tuple] = {}  # rank -> (last counter, local time it last changed)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._watch: Optional[int] = None
        self._on_excluded: Optional[Callable[[int, list], None]] = None

    # -- heartbeats -------------------------------------------------------------------------------

    def start(self) -> None:
        self.store.add(f"hb/{self.rank}", 1)
        self._thread = threading.Thread(target=self._beat, name=f"mecefo-heartbeat-{self.rank}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.hb_interval + 1)

    def _beat(self) -> None:
        # A failed store call is retried on a new connection for up to heartbeat_timeout_s: a
        # transient error (a loaded store host) must not silence a healthy rank for good. Past
        # that the store is gone: the job is ending.
        store, failing_since = None, None
        while True:
            try:
                if store is None:
                    store = self._connect()
                store.add(f"hb/{self.rank}", 1)
                failing_since = None
                if self._watch is not None:
                    self._check_excluded(store)
            except Exception:
                store = None
                failing_since = failing_since or time.monotonic()
                if time.monotonic() - failing_since > self.hb_timeout:
                    return
            if self._stop.wait(self.hb_interval):
                return

    def watch_exclusion(self, generation: Optional[int], on_excluded: Optional[Callable[[int, list], None]] = None) -> None:
        """From the heartbeat thread, call `on_excluded(generation, members)` once a generation after
        `generation` is agreed without this rank (None: stop watching). A rank stuck where no error
        reaches it (a pipeline peer of a replica already retired) learns it this way."""
        if on_excluded is not None:
            self._on_excluded = on_excluded
        self._watch = generation

    def _check_excluded(self, store: dist.Store) -> None:
        g = self._watch
        while g is not None and store.check([f"gen{g + 1}/agreed"]):
            members = json.loads(store.get(f"gen{g + 1}/agreed"))["members"]
            if self.rank not in members:
                self._watch = None
                if self._on_excluded is not None:
                    self._on_excluded(g + 1, members)
                return
            g += 1

    def alive(self, ranks: Iterable[int]) -> List[int]:
        """The ranks among `ranks` whose heartbeat moved within the last heartbeat_timeout_s.

        A rank that has not started its heartbeat yet (still importing, say) counts as alive; the
        agreement deadline bounds how long it is waited for. A rank whose process the launcher saw
        exit (`exited/{rank}`) is dead at once.
        """
        now = time.monotonic()
        out = []
        for r in ranks:
            if r == self.rank:
                out.append(r)
                continue
            if self.store.check([f"exited/{r}"]):
                continue
            value = self.store.add(f"hb/{r}", 0)
            if value == 0:
                out.append(r)
                continue
            last = self._seen.get(r)
            if last is None or last[0] != value:
                self._seen[r] = (value, now)
                out.append(r)
            elif now - last[1] < self.hb_timeout:
                out.append(r)
        return out

    # -- job-wide outcome ---------------------------------------------------------------------------

    def check_job(self) -> None:
        """Raise if the job has ended: JobAborted when a rank gave up, JobFinished when it is done."""
        if self.store.check(["job/failed"]):
            info = json.loads(self.store.get("job/failed"))
            raise JobAborted(f"[rank {self.rank}] the job gave up: {info['reason']}")
        if self.store.check(["job/finished"]):
            raise JobFinished(f"[rank {self.rank}] the job finished")

    def mark_failed(self, reason: str, **fields) -> None:
        """Tell every rank (and the launcher) that the job gave up; the first reason stays."""
        self.store.compare_set("job/failed", "", json.dumps({"reason": reason, "rank": self.rank, **fields}))

    # -- agreement --------------------------------------------------------------------------------

    def agree(self, generation: int, candidates: Sequence[int], step: Optional[int], info: Optional[str] = None) -> Agreement:
        """Agree with the other live candidates on the members of `generation`.

        Call on every survivor (and admitted joiner) with the same `candidates`. `step` is the step
        this rank holds the training state of, or None for a rank without state (a restarted or
        late rank). The agreement names the members holding the state of the newest step (one of them
        sends it) and the joiners, who must receive it before the generation trains: a rank without
        state never trains or votes. `info` (a string, e.g. this rank's measured costs) is published
        with the agreement, so every member reads the same members' posts.

        Returns:
            The agreed Agreement; its members contain this rank.

        Candidates that have not checked in by agree_timeout_s are left out (a late starter then
        rejoins like a restarted rank); the lowest live rank that checked in then publishes at once.

        Raises:
            AgreementTimeout: still no agreement 2 x heartbeat_timeout_s after agree_timeout_s (every rank
                that could publish it died meanwhile).
            StateLost: every live candidate is without state and no other can bring it.
            JobAborted: another rank gave up meanwhile.
            NotAMember: the agreed list leaves this rank out (it was presumed failed).
        """
        prefix = f"gen{generation}"
        if info is not None:  # before the check-in: whoever publishes reads it
            self.store.set(f"{prefix}/info/{self.rank}", info)
        self.store.set(f"{prefix}/in/{self.rank}", str(-1 if step is None else step))
        deadline = time.monotonic() + self.agree_timeout
        agreed_key = f"{prefix}/agreed"
        candidates = sorted(set(candidates) | {self.rank})
        while not self.store.check([agreed_key]):
            if self.store.check(["job/failed"]) or self.store.check(["job/finished"]):
                self.check_job()
            now = time.monotonic()
            if now > deadline + 2 * self.hb_timeout:
                raise AgreementTimeout(
                    f"[gen {generation} rank {self.rank}] no agreement on the survivors within "
                    f"{self.agree_timeout:.0f} s (mecefo.agree_timeout_s) + 2 heartbeat timeouts"
                )
            checked = {r: int(self.store.get(f"{prefix}/in/{r}")) for r in candidates
                       if self.store.check([f"{prefix}/in/{r}"])}
            asking = self._asking_to_join(r for r in candidates if r not in checked)
            live = set(self.alive(candidates)) - asking
            pending = [r for r in candidates if r in live and r not in checked]
            voters = [r for r in sorted(checked) if r in live]
            # past the deadline, go on without ranks that never checked in (they may rejoin later)
            if (not pending or now > deadline) and voters and voters[0] == self.rank:
                whole = self.whole(voters)  # a replica with a lost rank retires whole
                steps = [checked[r] for r in whole if checked[r] >= 0]
                if steps:
                    newest = max(steps)
                    agreed = {"members": whole, "joiners": [r for r in whole if checked[r] != newest], "step": newest,
                              "info": {str(r): self.store.get(f"{prefix}/info/{r}").decode() for r in whole
                                       if self.store.check([f"{prefix}/info/{r}"])}}
                    if self.store.compare_set(agreed_key, "", json.dumps(agreed)).decode() == json.dumps(agreed):
                        self._explain(generation, candidates, whole, checked, live, asking)
                elif any(checked[r] >= 0 for r in voters):  # the state lives on in broken replicas only
                    self.store.compare_set(agreed_key, "", json.dumps({"members": [], "joiners": [], "step": -1,
                                                                    "voters": voters}))
                elif not pending:  # nobody left who could bring the state
                    self.store.compare_set(agreed_key, "", json.dumps({"lost": True, "members": voters}))
            time.sleep(_POLL_S)
        agreed = json.loads(self.store.get(agreed_key))
        if not agreed.get("lost") and not agreed["members"]:
            err = NoCoverAvailable(
                f"[gen {generation} rank {self.rank}] every replica lost a rank: no whole replica is left to train "
                f"(live ranks {agreed['voters']})")
            err.members = agreed["voters"]
            raise err
        if agreed.get("lost"):
            raise StateLost(
                f"[gen {generation} rank {self.rank}] no rank holding the training state is left: the live "
                f"ranks {agreed['members']} are all restarted ranks that never received it"
            )
        if self.rank not in agreed["members"]:
            raise NotAMember(
                f"[gen {generation} rank {self.rank}] left out of generation {generation} (presumed failed; "
                f"members {agreed['members']}); this rank must stop"
            )
        return Agreement(tuple(agreed["members"]), tuple(agreed["joiners"]), int(agreed["step"]),
                         {int(r): v for r, v in agreed.get("info", {}).items()})

    def _asking_to_join(self, ranks: Iterable[int]) -> set:
        """Restarted incarnations waiting to be named for a generation (`request_join`): they come in
        at a step boundary, never to this agreement, so waiting for them would only run out the
        deadline."""
        out = set()
        for r in ranks:
            if r != self.rank and self.store.check([f"join/{r}"]) and self.store.get(f"join/{r}") == b"waiting" \
                    and self.store.check([f"joinee/{r}"]) and not self.store.get(f"joinee/{r}"):
                out.add(r)
        return out

    def _explain(self, generation: int, candidates, members, checked, live, asking) -> None:
        """Say on the publishing rank why each candidate left out of `generation` was left out: a
        healthy rank presumed failed (late, say, under load) is then told apart from a dead one."""
        for r in sorted(set(candidates) - set(members)):
            if r in asking:
                why = "restarted; it rejoins at a step boundary"
            elif r not in live:
                last = self._seen.get(r)
                why = ("its process exited" if self.store.check([f"exited/{r}"]) else
                       f"no heartbeat for {time.monotonic() - last[1]:.1f} s" if last else "no heartbeat")
            elif r not in checked:
                why = f"alive but not checked in within {self.agree_timeout:.0f} s (mecefo.agree_timeout_s)"
            else:
                why = "a rank of its replica is lost (replicas retire whole)"
            logger.warning("[gen %d rank %d] rank %d left out: %s", generation, self.rank, r, why)

    def members_of(self, generation: int) -> List[int]:
        """The agreed members of an earlier generation."""
        return json.loads(self.store.get(f"gen{generation}/agreed"))["members"]

    def latest_agreement(self, since: int = 0) -> tuple:
        """(generation, agreement dict) of the newest published agreement at or after generation `since`."""
        g = since
        while self.store.check([f"gen{g + 1}/agreed"]):
            g += 1
        if not self.store.check([f"gen{g}/agreed"]):
            return g, None
        return g, json.loads(self.store.get(f"gen{g}/agreed"))

    # -- commit -----------------------------------------------------------------------------------

    def decide(self, generation: int, step: int, members: Sequence[int], ok: bool, world: int) -> Decision:
        """Vote ok/abort for this step and return the one decision all members follow.

        Call on every member once per step, after the gradient reduction and before the optimizer.
        A decision that does not come within agree_timeout_s is replaced by abort (compare-and-set:
        if a commit got there first, it stands).
        """
        prefix = f"gen{generation}/step{step}"
        self.store.set(f"{prefix}/vote/{self.rank}", "1" if ok else "0")
        if ok:
            self.store.add(f"{prefix}/oks", 1)
        else:
            self.store.compare_set(f"{prefix}/decision", "", json.dumps({"commit": False}))
        key = f"{prefix}/decision"
        deadline = time.monotonic() + self.agree_timeout
        delays = _backoff()
        decider, next_liveness = False, 0.0
        while not self.store.check([key]):
            now = time.monotonic()
            if now > deadline:  # the decider is stuck elsewhere: abort; the survivors re-agree
                logger.warning("[gen %d rank %d step %d] no commit decision within %.0f s: aborting the step",
                               generation, self.rank, step, self.agree_timeout)
                self.store.compare_set(key, "", json.dumps({"commit": False}))
                break
            if now >= next_liveness:  # who decides, and is everyone alive: every _POLL_S, not every poll
                next_liveness = now + _POLL_S
                if self.store.check(["job/failed"]):
                    self.check_job()
                live = self.alive(members)
                decider = bool(live) and live[0] == self.rank  # the lowest live member
                if decider and len(live) < len(members):
                    self.store.compare_set(key, "", json.dumps({"commit": False}))
                    continue
            if decider and int(self.store.add(f"{prefix}/oks", 0)) >= len(members):
                joiners = self.pending_joiners(members, world)
                decision = {"commit": True, "joiners": joiners}
                if joiners:
                    decision["next_generation"] = generation + 1
                    candidates = sorted(set(members) | set(joiners))
                    self.store.set(f"gen{generation + 1}/candidates", ",".join(map(str, candidates)))
                if self.store.compare_set(key, "", json.dumps(decision)).decode() == json.dumps(decision):
                    for j in joiners:
                        self.store.set(f"joinee/{j}", str(generation + 1))
                continue
            time.sleep(next(delays))
        d = json.loads(self.store.get(key))
        return Decision(d["commit"], tuple(d.get("joiners", ())), d.get("next_generation"))

    # -- joins ------------------------------------------------------------------------------------

    def pending_joiners(self, members: Sequence[int], world: int) -> List[int]:
        """Restarted ranks that announced themselves and are not members, by whole replicas: a
        replica is admitted once all its ranks wait."""
        waiting = self._waiting(members, world)
        return sorted(set(self.whole(set(members) | set(waiting))) - set(members))

    def _waiting(self, members: Sequence[int], world: int) -> List[int]:
        out = []
        for r in range(world):
            if r in members:
                continue
            if self.store.check([f"join/{r}"]):
                value = self.store.get(f"join/{r}").decode()
                if value != "admitted":
                    out.append(r)
        return out

    def abort_step(self, generation: int, step: int) -> None:
        """Decide abort for (generation, step) unless a decision exists, and mark the generation as
        not formed: peers waiting in `formed()` or already in that step's collective or commit stop
        waiting (a rank leaving a generation that did not form for it)."""
        self.store.compare_set(f"gen{generation}/formed", "", "no")
        self.store.compare_set(f"gen{generation}/step{step}/decision", "", json.dumps({"commit": False}))

    def not_formed(self, generation: int) -> bool:
        """Whether a member already decided that `generation` will not form (or the job ended)."""
        if self.store.check(["job/failed"]) or self.store.check(["job/finished"]):
            return True
        key = f"gen{generation}/formed"
        return self.store.check([key]) and self.store.get(key).decode() == "no"

    def formed(self, generation: int, members: Sequence[int]) -> bool:
        """Report that this member's data-parallel group of `generation` is built (and its joiners
        hold the state); return whether the whole generation formed. One outcome for all members
        (compare-and-set): with tensor or pipeline parallelism each position forms its own group,
        and a position whose group failed must not leave the others training without it.
        """
        prefix = f"gen{generation}"
        self.store.add(f"{prefix}/ready", 1)
        key, deadline = f"{prefix}/formed", time.monotonic() + self.agree_timeout
        delays, next_liveness = _backoff(), 0.0
        while not self.store.check([key]):
            now = time.monotonic()
            if int(self.store.add(f"{prefix}/ready", 0)) >= len(members):
                self.store.compare_set(key, "", "yes")
            elif now > deadline:
                self.store.compare_set(key, "", "no")
            elif now >= next_liveness:
                next_liveness = now + _POLL_S
                self.check_job()
                if len(self.alive(members)) < len(members):
                    self.store.compare_set(key, "", "no")
            else:
                time.sleep(next(delays))
        return self.store.get(key).decode() == "yes"

    def request_join(self, deadline: float) -> int:
        """Announce this restarted rank; return the generation it is admitted to.

        Raises:
            JobFinished: training ended first.
            JobAborted: the job gave up meanwhile.
            StateLost: no live rank of the newest generation holds the state (nobody can admit this
                rank or send it the state); the job is marked failed.
            JoinTimeout: not admitted by `deadline` (time.monotonic(); the rank's start + join_timeout_s).
        """
        self.store.set(f"joinee/{self.rank}", "")
        self.store.delete_key(f"exited/{self.rank}")
        self._seen.clear()
        self.store.set(f"join/{self.rank}", "waiting")
        watch = OrphanWatch(self)
        while True:
            value = self.store.get(f"joinee/{self.rank}").decode()
            if value:
                self.store.set(f"join/{self.rank}", "admitted")
                return int(value)
            self.check_job()
            if time.monotonic() > deadline:
                raise JoinTimeout(f"[rank {self.rank}] not admitted within mecefo.join_timeout_s of its start")
            watch.check()
            time.sleep(_POLL_S * 5)


class OrphanWatch:
    """Polled by a rank waiting outside the job (to be admitted, or for its trace's rejoin step):
    raises StateLost, and marks the job failed, once no live rank of the newest generation holds
    the state for longer than heartbeat_timeout_s; nobody could admit it or send it the state."""

    def __init__(self, membership: Membership) -> None:
        self.m = membership
        self.since = 0
        self.orphaned_since: Optional[float] = None
        self.next_check = time.monotonic() + membership.hb_timeout

    def check(self) -> None:
        now = time.monotonic()
        if now < self.next_check:
            return
        self.next_check = now + 0.5
        m, store = self.m, self.m.store
        self.since, agreed = m.latest_agreement(self.since)
        holders = [r for r in (agreed or {}).get("members", []) if r != m.rank
                   and not (store.check([f"join/{r}"]) and store.get(f"join/{r}").decode() == "waiting")]
        if agreed is not None and not agreed.get("lost") and m.alive(holders):
            self.orphaned_since = None
        elif self.orphaned_since is None:
            self.orphaned_since = now
        elif now - self.orphaned_since > m.hb_timeout:
            reason = (f"no rank holding the training state is left (generation {self.since} had members "
                      f"{(agreed or {}).get('members')}; none is alive)")
            m.mark_failed(reason)
            raise StateLost(f"[rank {m.rank}] {reason}")
