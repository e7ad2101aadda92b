"""Agreement on the members of a generation, in O(N) store calls.

Each candidate appends one check-in (its rank, the step whose state it holds, -1 for none, and what
it posts, e.g. its measured costs) to the generation's log, then waits server-side for the result.
One candidate publishes: the first to check in (compare-and-set on `gen{g}/publisher`). It reads
the whole log in one call per poll, the heartbeats of the candidates it still waits for in one more
(a launcher's exit mark ends the wait at once), and everyone's once per interval, starting from the
ranks the generation's watcher reported stalled (liveness.StallReport); once every live candidate
checked in (or the deadline passed) it publishes the agreement (members, joiners =
members without the newest state, step) with compare-and-set, and everyone adopts the first one
published. The others wake every half heartbeat timeout, check the publisher's heartbeat, and one of
them takes over (compare-and-set) once it is presumed dead. So each candidate makes 4 calls (check
in, learn the publisher, wait, read the result) and the publisher O(1) per poll. A restarted rank
asking to join is not waited for (it comes in at a step boundary); the publisher logs why each
candidate was left out. An agreement with no state holder is never published: "lost" ends the job.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from datetime import timedelta
from typing import Callable, Dict, Mapping, Optional, Sequence

import torch.distributed as dist

from megatron_mecefo.elastic.membership import keys
from megatron_mecefo.elastic.membership.commit import formed, not_formed
from megatron_mecefo.elastic.membership.liveness import ABSENT, Heartbeat, Liveness, poke_key, settle
from megatron_mecefo.errors import AgreementTimeout, NoCoverAvailable, NotAMember, StateLost

__all__ = ["Agreement", "Generations", "agree"]

logger = logging.getLogger("megatron_mecefo.elastic.membership")

POLL_S = 0.02
"""How often the publisher reads the check-ins (one call)."""
READ_BYTES_PER_S = 50e6
"""The publisher reads a long check-in log (16,384 ranks: ~1 MB) at most at this rate."""


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
    """What the members posted with their check-in, by rank (only without `summarize`)."""
    summary: Optional[str] = None
    """`summarize(posts)` of the publisher: identical on every member, one string for any N."""
    rolled: tuple = ()
    """Members that checked in with the reduced gradients of step - 1, which a member committed:
    they commit it too (not joiners; not donors until they have)."""

    @property
    def holders(self) -> tuple:
        """The members holding the state of `step` now (a donor is one of them)."""
        return tuple(r for r in self.members if r not in self.joiners and r not in self.rolled)


def agree(store: dist.Store, liveness: Liveness, heartbeat: Heartbeat, generation: int, candidates: Sequence[int],
          step: Optional[int], *, timeout_s: float, interval_s: float, whole: Callable, check_job: Callable[[], None],
          asking_to_join: Callable[[Sequence[int]], set], info: Optional[str] = None,
          summarize: Optional[Callable[[Dict[int, str]], str]] = None, reduced: bool = False) -> Agreement:
    """Agree with the other live candidates on the members of `generation` (Membership.agree)."""
    me = liveness.rank
    agreed_key = keys.agreed(generation)
    store.append(keys.checkins(generation), keys.checkin_line(me, -1 if step is None else step, info, reduced))
    deadline = time.monotonic() + timeout_s
    candidates = sorted(set(candidates) | {me})
    dead: set = set()  # publishers presumed dead before this rank took over
    if int(store.add(keys.arrivals(generation), 1)) == 1:  # the first to check in publishes
        store.set(keys.publisher(generation), str(me))
    else:
        watch = _PublisherWatch(generation, me, liveness.timeout_s)
        while not watch.publishing:
            heartbeat.vigil = watch
            try:
                store.wait([watch.poke], timedelta(seconds=max(0.01, deadline + 2 * liveness.timeout_s - time.monotonic())))
            except dist.DistStoreError:
                raise AgreementTimeout(
                    f"[gen {generation} rank {me}] no agreement on the survivors within {timeout_s:.0f} s "
                    "(mecefo.agree_timeout_s) + 2 heartbeat timeouts") from None
            finally:
                heartbeat.vigil = None
            raw = store.compare_set(agreed_key, ABSENT, ABSENT)  # the agreement, if there is one
            if raw != ABSENT.encode():
                return _adopt(raw, generation, me)
            check_job()
            watch.woken()
        dead = watch.dead
    next_scan, live, asking, pending = 0.0, set(candidates), set(), []
    while True:  # the publisher
        now = time.monotonic()
        if now > deadline + 2 * liveness.timeout_s:
            raise AgreementTimeout(
                f"[gen {generation} rank {me}] no agreement on the survivors within {timeout_s:.0f} s "
                "(mecefo.agree_timeout_s) + 2 heartbeat timeouts")
        if store.check([agreed_key]):
            break
        raw = store.get(keys.checkins(generation))
        checked, posts, holding = keys.parse_checkins(raw)
        if now >= next_scan:  # one scan of everyone per interval, by the publisher only
            next_scan = now + interval_s
            check_job()
            liveness.learn_stalls()  # a rank the generation's watcher saw stalled is not watched again
            live = set(liveness.scan(candidates + [r for r in checked if r not in candidates])) - dead
            asking = asking_to_join([r for r in candidates if r not in checked])
        elif pending:  # the ranks it waits for, every poll: a launcher's exit mark ends the wait at once
            live -= set(pending) - set(liveness.scan(pending))
        pending = [r for r in candidates if r in live - asking and r not in checked]
        voters = [r for r in sorted(checked) if r in live - asking]  # a joiner named meanwhile checks in too
        # past the deadline, go on without ranks that never checked in (they may rejoin later)
        if voters and (not pending or now > deadline):
            _publish(store, liveness, generation, candidates, checked, posts, holding, voters, pending, live - asking,
                     asking, whole, summarize, timeout_s)
            continue
        time.sleep(max(POLL_S, len(raw) / READ_BYTES_PER_S))  # a long log is read less often
    return _adopt(store.get(agreed_key), generation, me)


class Generations:
    """One rank's handle on the generations (Membership.generations): agreeing on the members,
    and whether a generation formed (commit.formed, commit.not_formed)."""

    def __init__(self, store, liveness: Liveness, heartbeat: Heartbeat, *, timeout_s: float, interval_s: float,
                 hb_timeout_s: float, whole, check_job: Callable[[], None], asking: Callable) -> None:
        self._store, self._liveness, self._heartbeat = store, liveness, heartbeat
        self._timeout_s, self._interval_s, self._hb_timeout_s = timeout_s, interval_s, hb_timeout_s
        self._whole, self._check_job, self._asking = whole, check_job, asking

    def agree(self, generation: int, candidates: Sequence[int], step: Optional[int], info: Optional[str] = None,
              summarize: Optional[Callable[[Dict[int, str]], str]] = None, reduced: bool = False) -> Agreement:
        """Agree with the other live candidates on the members of `generation` (`agree` above).

        Call on every survivor (and admitted joiner) with the same `candidates`. `step` is the step
        this rank holds the training state of, or None for a rank without state (a restarted or
        late rank). The agreement names the members holding the state of the newest step (one of them
        sends it) and the joiners, who must receive it before the generation trains: a rank without
        state never trains or votes. `info` (a string, e.g. this rank's measured costs) is posted
        with the check-in; the agreement carries the members' posts, or `summarize(posts)` of the
        publisher (one string for any N), so every member reads the same. `reduced`: this rank
        also holds the reduced gradients of step `step` (its commit was not confirmed); if a member
        committed that step, the agreement names it `rolled`: it commits the step too.

        Returns:
            The agreed Agreement; its members contain this rank.

        Candidates that have not checked in by agree_timeout_s are left out (a late starter then
        rejoins like a restarted rank); the publisher then publishes at once.

        Raises:
            AgreementTimeout: still no agreement 2 x heartbeat_timeout_s after agree_timeout_s (every rank
                that could publish it died meanwhile).
            StateLost: every live candidate is without state and no other can bring it.
            NoCoverAvailable: every replica lost a rank.
            JobAborted: another rank gave up meanwhile.
            NotAMember: the agreed list leaves this rank out (it was presumed failed).
        """
        return agree(self._store, self._liveness, self._heartbeat, generation, candidates, step,
                     timeout_s=self._timeout_s, interval_s=self._interval_s, whole=self._whole,
                     check_job=self._check_job, asking_to_join=self._asking, info=info, summarize=summarize,
                     reduced=reduced)

    def formed(self, generation: int, members: Sequence[int]) -> bool:
        """Report that this member's data-parallel group of `generation` is built (and its joiners
        hold the state); return whether the whole generation formed. One outcome for all members
        (compare-and-set): with tensor or pipeline parallelism each position forms its own group,
        and a position whose group failed must not leave the others training without it."""
        return formed(self._store, self._heartbeat, generation, members, timeout_s=self._timeout_s,
                      hb_timeout_s=self._hb_timeout_s, check_job=self._check_job)

    def not_formed(self, generation: int) -> bool:
        """Whether a member already decided that `generation` will not form (or the job ended)."""
        return not_formed(self._store, generation)


class _PublisherWatch:
    """The vigil of a candidate waiting for the agreement (from its heartbeat thread, each beat):
    wakes it once the agreement is out (a check-in the publisher did not see) or the job ended, and
    once the publisher is presumed dead, claims the publishing (compare-and-set) and wakes it."""

    def __init__(self, generation: int, rank: int, timeout_s: float) -> None:
        self.generation, self.rank, self._timeout_s = generation, rank, timeout_s
        self.wakes = 0
        self.poke = self._poke()
        self.publishing = False
        self.dead: set = set()
        """Publishers this rank saw presumed dead (the one that takes over leaves them out)."""
        self._liveness: Optional[Liveness] = None

    def _poke(self) -> str:
        return poke_key(keys.agreed(self.generation), self.rank) + (f"/{self.wakes}" if self.wakes else "")

    def woken(self) -> None:
        """The training thread woke without an agreement: it publishes now, or waits again."""
        self.wakes += 1
        self.poke = self._poke()

    def __call__(self, store: dist.Store) -> None:
        g = self.generation
        if store.check([keys.agreed(g)]) or store.check([keys.JOB_FAILED]) or store.check([keys.JOB_FINISHED]):
            store.set(self.poke, "1")
            return
        if not store.check([keys.publisher(g)]):
            return
        publisher = int(store.get(keys.publisher(g)))
        if self._liveness is None or self._liveness.store is not store:
            self._liveness = Liveness(store, self.rank, self._timeout_s)
        if not self._liveness.scan([publisher]):
            logger.warning("[gen %d rank %d] the publisher of the agreement, rank %d, is presumed dead (%s)", g,
                           self.rank, publisher, self._liveness.why_dead(publisher))
            self.dead.add(publisher)
            if int(store.compare_set(keys.publisher(g), str(publisher), str(self.rank))) == self.rank:
                self.publishing = True
                store.set(self.poke, "1")


def _publish(store, liveness, generation, candidates, checked, posts, holding, voters, pending, live, asking, whole,
             summarize, timeout_s) -> None:
    members = whole(voters)  # a replica with a lost rank retires whole
    steps = [checked[r] for r in members if checked[r] >= 0]
    if steps:
        newest = max(steps)
        # a member that reduced the step some member committed commits it too, with its own gradients
        rolled = [r for r in members if r in holding and checked[r] == newest - 1]
        agreed = {"members": keys.encode_ranks(members), "rolled": keys.encode_ranks(rolled), "step": newest,
                  "joiners": keys.encode_ranks(r for r in members if checked[r] != newest and r not in rolled)}
        mine = {r: posts[r] for r in members if r in posts}
        if summarize is not None:
            agreed["summary"] = summarize(mine)
        else:
            agreed["info"] = {str(r): v for r, v in mine.items()}
        if _settle(store, generation, json.dumps(agreed)):
            _explain(liveness, generation, candidates, members, checked, live, asking, timeout_s)
    elif any(checked[r] >= 0 for r in voters):  # the state lives on in broken replicas only
        _settle(store, generation, json.dumps({"members": [], "joiners": [], "step": -1,
                                               "voters": keys.encode_ranks(voters)}))
    elif not pending:  # nobody left who could bring the state
        _settle(store, generation, json.dumps({"lost": True, "members": keys.encode_ranks(voters)}))


def _settle(store, generation: int, value: str) -> bool:
    """Publish `value` unless an agreement stands, and wake everyone who checked in (read again
    after the publishing: a late check-in is in it). Returns whether `value` stands."""
    stands = store.compare_set(keys.agreed(generation), "", value).decode() == value
    checked, _, _ = keys.parse_checkins(store.get(keys.checkins(generation)))
    settle(store, keys.agreed(generation), value, list(checked))
    return stands


def _adopt(raw: bytes, generation: int, me: int) -> Agreement:
    agreed = keys.read_agreement(raw)
    if not agreed.get("lost") and not agreed["members"]:
        err = NoCoverAvailable(
            f"[gen {generation} rank {me}] every replica lost a rank: no whole replica is left to train "
            f"(live ranks {agreed['voters']})")
        err.members = agreed["voters"]
        raise err
    if agreed.get("lost"):
        raise StateLost(
            f"[gen {generation} rank {me}] no rank holding the training state is left: the live ranks "
            f"{agreed['members']} are all restarted ranks that never received it")
    if me not in agreed["members"]:
        raise NotAMember(
            f"[gen {generation} rank {me}] left out of generation {generation} (presumed failed; members "
            f"{agreed['members']}); this rank must stop")
    return Agreement(tuple(agreed["members"]), tuple(agreed["joiners"]), int(agreed["step"]),
                     {int(r): v for r, v in agreed.get("info", {}).items()}, agreed.get("summary"),
                     tuple(agreed.get("rolled", ())))


def _explain(liveness: Liveness, generation, candidates, members, checked, live, asking, timeout_s) -> None:
    """Say on the publishing rank why each candidate left out of `generation` was left out: a
    healthy rank presumed failed (late, say, under load) is then told apart from a dead one."""
    for r in sorted(set(candidates) - set(members)):
        if r in asking:
            why = "restarted; it rejoins at a step boundary"
        elif r not in live:
            why = liveness.why_dead(r)
        elif r not in checked:
            why = f"alive but not checked in within {timeout_s:.0f} s (mecefo.agree_timeout_s)"
        else:
            why = "a rank of its replica is lost (replicas retire whole)"
        logger.warning("[gen %d rank %d] rank %d left out: %s", generation, liveness.rank, r, why)
