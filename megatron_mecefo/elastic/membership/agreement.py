"""Agreement on the members of a generation, in O(N) store calls.

Each candidate appends one check-in (its rank, the step whose state it holds, -1 for none, and what
it posts, e.g. its measured costs) to the generation's log, then waits server-side for the result.
One candidate publishes: the first to check in (compare-and-set on `gen{g}/publisher`). It reads
the whole log in one call per poll and scans the candidates' heartbeats once per interval; once every
live candidate checked in (or the deadline passed) it publishes the agreement (members, joiners =
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
from megatron_mecefo.elastic.membership.liveness import Liveness
from megatron_mecefo.errors import AgreementTimeout, NoCoverAvailable, NotAMember, StateLost

__all__ = ["Agreement", "agree"]

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

    @property
    def holders(self) -> tuple:
        return tuple(r for r in self.members if r not in self.joiners)


def agree(store: dist.Store, liveness: Liveness, generation: int, candidates: Sequence[int], step: Optional[int], *,
          timeout_s: float, interval_s: float, whole: Callable, check_job: Callable[[], None],
          asking_to_join: Callable[[Sequence[int]], set], info: Optional[str] = None,
          summarize: Optional[Callable[[Dict[int, str]], str]] = None) -> Agreement:
    """Agree with the other live candidates on the members of `generation` (Membership.agree)."""
    me = liveness.rank
    store.append(keys.checkins(generation), keys.checkin_line(me, -1 if step is None else step, info))
    deadline = time.monotonic() + timeout_s
    agreed_key, publisher_key = keys.agreed(generation), keys.publisher(generation)
    candidates = sorted(set(candidates) | {me})
    publisher = int(store.compare_set(publisher_key, "", str(me)))  # the first to check in publishes
    next_scan, live, asking, delay = 0.0, set(candidates), set(), POLL_S
    slice_s = max(0.05, liveness.timeout_s / 2)
    while True:
        now = time.monotonic()
        if now > deadline + 2 * liveness.timeout_s:
            raise AgreementTimeout(
                f"[gen {generation} rank {me}] no agreement on the survivors within {timeout_s:.0f} s "
                "(mecefo.agree_timeout_s) + 2 heartbeat timeouts")
        if publisher != me:
            try:
                store.wait([agreed_key], timedelta(seconds=slice_s))
                break
            except dist.DistStoreError:  # still none: is the publisher alive?
                check_job()
                if not liveness.scan([publisher]):  # take over (one of the waiters wins)
                    publisher = int(store.compare_set(publisher_key, str(publisher), str(me)))
                continue
        if store.check([agreed_key]):
            break
        raw = store.get(keys.checkins(generation))
        checked, posts = keys.parse_checkins(raw)
        if now >= next_scan:  # one scan of everyone per interval, by the publisher only
            next_scan = now + interval_s
            check_job()
            live = set(liveness.scan(candidates))
            asking = asking_to_join([r for r in candidates if r not in checked])
        pending = [r for r in candidates if r in live - asking and r not in checked]
        voters = [r for r in sorted(checked) if r in live - asking and r in candidates]
        # past the deadline, go on without ranks that never checked in (they may rejoin later)
        if voters and (not pending or now > deadline):
            _publish(store, liveness, generation, candidates, checked, posts, voters, pending, live - asking, asking,
                     whole, summarize, timeout_s)
            continue
        time.sleep(max(POLL_S, len(raw) / READ_BYTES_PER_S))  # a long log is read less often
    return _adopt(store.get(agreed_key), generation, me)


def _publish(store, liveness, generation, candidates, checked, posts, voters, pending, live, asking, whole, summarize,
             timeout_s) -> None:
    agreed_key = keys.agreed(generation)
    members = whole(voters)  # a replica with a lost rank retires whole
    steps = [checked[r] for r in members if checked[r] >= 0]
    if steps:
        newest = max(steps)
        agreed = {"members": keys.encode_ranks(members),
                  "joiners": keys.encode_ranks(r for r in members if checked[r] != newest), "step": newest}
        mine = {r: posts[r] for r in members if r in posts}
        if summarize is not None:
            agreed["summary"] = summarize(mine)
        else:
            agreed["info"] = {str(r): v for r, v in mine.items()}
        if store.compare_set(agreed_key, "", json.dumps(agreed)).decode() == json.dumps(agreed):
            _explain(liveness, generation, candidates, members, checked, live, asking, timeout_s)
    elif any(checked[r] >= 0 for r in voters):  # the state lives on in broken replicas only
        store.compare_set(agreed_key, "", json.dumps({"members": [], "joiners": [], "step": -1,
                                                               "voters": keys.encode_ranks(voters)}))
    elif not pending:  # nobody left who could bring the state
        store.compare_set(agreed_key, "", json.dumps({"lost": True, "members": keys.encode_ranks(voters)}))


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
                     {int(r): v for r, v in agreed.get("info", {}).items()}, agreed.get("summary"))


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
