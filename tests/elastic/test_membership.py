"""Membership logic against a real TCPStore, ranks as threads (no processes, no failures injected)."""

import collections
import json
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from megatron_mecefo.elastic.comm.replica import replica_round
from megatron_mecefo.elastic.membership import Membership, keys
from megatron_mecefo.elastic.membership.admission import announce
from megatron_mecefo.elastic.plan.topology import Grid
from megatron_mecefo.errors import JobAborted, NoCoverAvailable, NotAMember, StateLost
from megatron_mecefo.testing.counting import Counted

pytestmark = pytest.mark.dist


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False)


def member(store, rank, **kw):
    """Rank `rank`'s membership on its own connection (a member blocks its connection while it waits)."""
    connect = lambda: dist.TCPStore("127.0.0.1", store.port, is_master=False, wait_for_workers=False)  # noqa: E731
    return Membership(connect(), connect, rank, heartbeat_interval_s=0.1, heartbeat_timeout_s=0.5,
                      agree_timeout_s=kw.get("agree_timeout_s", 5.0), whole=kw.get("whole"))


def agree_all(store, generation, steps, whole=None, candidates=None, agree_timeout_s=5.0):
    """Each rank of `steps` (rank -> step or None) agrees in its own thread."""
    out = {}

    def run(r):
        try:
            m = member(store, r, whole=whole, agree_timeout_s=agree_timeout_s)
            out[r] = m.generations.agree(generation, sorted(candidates or steps), steps[r])
        except Exception as e:  # noqa: BLE001 - the test inspects it
            out[r] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in steps]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_a_rank_without_state_joins_as_a_joiner_of_the_newest_step(store):
    plans = agree_all(store, 3, {0: None, 1: 61, 2: 61})
    assert {r: (p.members, p.joiners, p.step) for r, p in plans.items()} == {
        r: ((0, 1, 2), (0,), 61) for r in range(3)}
    assert plans[0].holders == (1, 2)


def test_what_the_members_post_is_published_with_the_agreement(store):
    """The cover planner's costs: every member reads the same posts, a left-out rank's not among them."""
    out = {}

    def run(r):
        out[r] = member(store, r).generations.agree(4, [0, 1, 2, 3], 9, info=None if r == 2 else f"costs of {r}")

    keys.mark_exited(store, 3)  # rank 3 posted, then crashed before the agreement
    store.set("gen4/info/3", "costs of 3")
    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert {r: (a.members, dict(a.info)) for r, a in out.items()} == {
        r: ((0, 1, 2), {0: "costs of 0", 1: "costs of 1"}) for r in (0, 1, 2)}


def test_a_replica_that_lost_a_rank_is_left_out_whole(store):
    """T=2, D=2: rank 2 (replica 1) crashed; rank 3, alive, is not a member either (NotAMember), and
    the plan holds whole replica 0 only."""
    grid = Grid(tp=2, dp=2)
    keys.mark_exited(store, 2)
    out = agree_all(store, 1, {0: 7, 1: 7, 3: 7}, whole=grid.whole, candidates=[0, 1, 2, 3])
    assert (out[0].members, out[1].members) == ((0, 1), (0, 1))
    assert isinstance(out[3], NotAMember)


def test_every_replica_broken_gives_up_for_no_cover(store):
    grid = Grid(tp=2, dp=2)
    for r in (1, 2):
        keys.mark_exited(store, r)
    out = agree_all(store, 1, {0: 7, 3: 7}, whole=grid.whole, candidates=[0, 1, 2, 3])
    assert all(isinstance(e, NoCoverAvailable) for e in out.values())


def test_a_restarted_replica_is_admitted_only_when_all_its_ranks_wait(store):
    m = member(store, 0, whole=Grid(tp=2, dp=2).whole)
    announce(store, 2)
    assert m.joins.pending([0, 1]) == []
    announce(store, 3)
    assert m.joins.pending([0, 1]) == [2, 3]


def test_replica_rounds_skip_stale_and_dead_slots(store):
    """Replica 0 (2 ranks) formed round 0. Rank 1 was restarted (incarnation 1: round 0 is stale for
    it, it claims round 1) and died again before rank 0 came back. Rank 0's new incarnation must not
    form a group with that dead claim: both later arrivals meet in round 2."""
    prefix = dist.PrefixStore("job", store)
    rounds = {}

    def start(local, inc):
        rounds[(local, inc)] = replica_round(prefix, replica=0, local_rank=local, size=2, incarnation=inc, rank=local,
                                             timeout_s=10, poll_s=0.01)

    def together(*arrivals):
        threads = [threading.Thread(target=start, args=a) for a in arrivals]
        [t.start() for t in threads]
        [t.join(15) for t in threads]

    together((0, 0), (1, 0))
    assert int(prefix.get("replica0/round")) == 0
    # incarnation 1 of rank 1, as it would have left the store: moved to round 1, claimed, then died
    prefix.set("replica0/round", "1")
    prefix.set("replica0/round1/slot/1", "1:1")
    prefix.add("replica0/round1/count", 1)
    prefix.set("exited/1/1", "1")
    together((0, 1), (1, 2))
    assert int(prefix.get("replica0/round")) == 2
    assert set(rounds) == {(0, 0), (1, 0), (0, 1), (1, 2)}
    assert prefix.get("replica0/round2/slot/0") == b"1:0" and prefix.get("replica0/round2/slot/1") == b"2:1"


def test_only_ranks_without_state_left_is_state_lost(store):
    store.append("gen2/in", keys.checkin_line(1, 40, None))  # the only holder checked in, then crashed
    keys.mark_exited(store, 1)
    out = agree_all(store, 2, {0: None, 2: None}, candidates=[0, 1, 2])
    assert isinstance(out[0], StateLost) and isinstance(out[2], StateLost)
    assert keys.read_agreement(store.get("gen2/agreed")) == {"lost": True, "members": [0, 2]}


def test_a_waiting_joiner_ends_the_job_when_no_holder_is_alive(store):
    store.set("gen0/agreed", json.dumps({"members": [0, 1], "joiners": [], "step": 0}))
    store.set("gen1/agreed", json.dumps({"members": [1], "joiners": [], "step": 7}))
    store.add("hb/1", 1)
    keys.mark_exited(store, 1)
    t0 = time.monotonic()
    with pytest.raises(StateLost, match=r"generation 1 had members \[1\]"):
        member(store, 0).request_join(time.monotonic() + 30)
    assert time.monotonic() - t0 < 5
    assert "no rank holding the training state" in json.loads(store.get("job/failed"))["reason"]
    with pytest.raises(JobAborted, match="the job gave up"):  # everybody else learns it
        member(store, 2).check_job()


def test_a_waiting_joiner_keeps_waiting_while_a_holder_lives(store):
    store.set("gen0/agreed", json.dumps({"members": [1], "joiners": [], "step": 0}))
    stop = threading.Event()

    def beat():
        while not stop.wait(0.1):
            store.add("hb/1", 1)

    threading.Thread(target=beat, daemon=True).start()
    threading.Timer(2.0, lambda: store.set("joinee/0", "5")).start()
    try:
        assert member(store, 0).request_join(time.monotonic() + 30) == 5
    finally:
        stop.set()


def test_a_missing_commit_decision_becomes_an_abort(store):
    m = member(store, 1, agree_timeout_s=1.0)
    # rank 0, the decider, never decides (it is stuck elsewhere but its heartbeat is fine)
    stop = threading.Event()

    def beat():
        while not stop.wait(0.1):
            store.add("hb/0", 1)

    threading.Thread(target=beat, daemon=True).start()
    t0 = time.monotonic()
    try:
        decision = m.votes.decide(4, 9, [0, 1], ok=True, world=2)
    finally:
        stop.set()
    assert not decision.commit and 1.0 <= time.monotonic() - t0 < 3
    # a commit that got there first stands
    store.set("gen4/step10/decision", json.dumps({"commit": True, "joiners": []}))
    assert m.votes.decide(4, 10, [0, 1], ok=True, world=2).commit


def _beating(store, rank):
    """A live heartbeat for `rank` until the returned event is set."""
    stop = threading.Event()

    def beat():
        while not stop.wait(0.1):
            store.add(f"hb/{rank}", 1)

    store.add(f"hb/{rank}", 1)
    threading.Thread(target=beat, daemon=True).start()
    return stop


def test_a_restarted_rank_asking_to_join_is_not_waited_for(store, caplog):
    """Rank 2 was killed and its restart (heartbeat beating) asks to join while 0 and 1 agree on the
    survivors: it never checks in here, so waiting for it would only run out agree_timeout_s (60 s)."""
    store.set("joinee/2", "")
    announce(store, 2)
    stop = _beating(store, 2)
    t0 = time.monotonic()
    try:
        with caplog.at_level("WARNING", logger="megatron_mecefo.elastic.membership"):
            out = agree_all(store, 3, {0: 12, 1: 12}, candidates=[0, 1, 2], agree_timeout_s=60.0)
    finally:
        stop.set()
    assert {r: p.members for r, p in out.items()} == {0: (0, 1), 1: (0, 1)}
    assert time.monotonic() - t0 < 30, "waited for the deadline"
    assert "rank 2 left out: restarted; it rejoins at a step boundary" in caplog.text


def test_a_joiner_named_for_the_generation_is_waited_for(store):
    """Rank 2 asked to join and was named for generation 3 (joinee/2) but has not yet marked itself
    admitted: it is coming to this agreement, so the plan waits for it and names it a joiner."""
    announce(store, 2)
    store.set("joinee/2", "3")
    stop = _beating(store, 2)

    def late_check_in():
        time.sleep(1.0)
        store.set("join/2", "admitted")
        return member(store, 2).generations.agree(3, [0, 1, 2], None)

    late = {}
    t = threading.Thread(target=lambda: late.update(p=late_check_in()))
    t.start()
    try:
        out = agree_all(store, 3, {0: 12, 1: 12}, candidates=[0, 1, 2], agree_timeout_s=60.0)
        t.join(30)
    finally:
        stop.set()
    assert out[0].members == out[1].members == late["p"].members == (0, 1, 2)
    assert out[0].joiners == (2,)


def test_a_rank_left_out_for_a_late_check_in_is_explained(store, caplog):
    stop = _beating(store, 2)  # alive, never checks in
    try:
        with caplog.at_level("WARNING", logger="megatron_mecefo.elastic.membership"):
            out = agree_all(store, 1, {0: 5, 1: 5}, candidates=[0, 1, 2], agree_timeout_s=1.0)
    finally:
        stop.set()
    assert out[0].members == (0, 1)
    assert "rank 2 left out: alive but not checked in within 1 s" in caplog.text


def test_the_heartbeat_outlives_a_failed_store_call(store):
    """A store call of the heartbeat thread that fails once (a loaded store host) is retried on a new
    connection: the rank stays alive in its peers' eyes."""
    real = lambda: dist.TCPStore("127.0.0.1", store.port, is_master=False, wait_for_workers=False)  # noqa: E731
    calls = {"n": 0}

    class Flaky:
        def __init__(self):
            self.inner = real()

        def add(self, key, value):
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("store call timed out")
            return self.inner.add(key, value)

    m = Membership(store, Flaky, 1, heartbeat_interval_s=0.1, heartbeat_timeout_s=0.5, agree_timeout_s=5.0)
    m.start()
    try:
        time.sleep(1.5)
        before = int(store.add("hb/1", 0))
        time.sleep(0.5)
        assert int(store.add("hb/1", 0)) > before, "the heartbeat stopped after one failed call"
    finally:
        m.stop()


def _counted_members(store, n, counts, beating=()):
    """n members whose training-thread store calls are counted per rank; the heartbeat threads of
    `beating` run (their calls are not counted)."""
    out = []
    for r in range(n):
        connect = lambda: dist.TCPStore("127.0.0.1", store.port, is_master=False, wait_for_workers=False)  # noqa: E731
        m = Membership(Counted(connect(), counts, r), connect, r, heartbeat_interval_s=0.1, heartbeat_timeout_s=0.5,
                       agree_timeout_s=20.0)
        if r in beating:
            m.start()
        out.append(m)
    counts.clear()
    return out


def _in_threads(members, fn):
    out = {}

    def run(m):
        try:
            out[m.rank] = fn(m)
        except Exception as e:  # noqa: BLE001 - the test inspects it
            out[m.rank] = e

    threads = [threading.Thread(target=run, args=(m,)) for m in members]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_an_agreement_costs_each_member_four_store_calls(store):
    """16 members: one check-in, the publisher's name, a server-side wait and the result; only the
    publisher reads everyone's check-ins (O(1) calls per poll), so the total is 4N + O(1)."""
    counts = collections.Counter()
    members = _counted_members(store, 16, counts, beating=range(16))
    try:
        out = _in_threads(members, lambda m: m.generations.agree(1, list(range(16)), 7))
    finally:
        for m in members:
            m.stop()
    assert {p.members for p in out.values()} == {tuple(range(16))}, out
    publisher = int(store.get("gen1/publisher"))
    others = [counts[r] for r in range(16) if r != publisher]
    assert max(others) <= 4, counts
    assert sum(counts.values()) <= 4 * 16 + 60, counts


def test_a_publisher_that_hangs_is_replaced(store):
    """Rank 0 checks in first (so it publishes) and hangs: its heartbeat stops. One of the 15 others
    takes over once it is presumed dead, and the generation goes on without it."""
    members = _counted_members(store, 16, collections.Counter(), beating=range(1, 16))
    store.add("hb/0", 1)
    store.append("gen1/in", keys.checkin_line(0, 7, None))
    store.add("gen1/arrivals", 1)
    store.set("gen1/publisher", "0")
    t0 = time.monotonic()
    try:
        out = _in_threads(members[1:], lambda m: m.generations.agree(1, list(range(16)), 7))
    finally:
        for m in members:
            m.stop()
    assert {p.members for p in out.values()} == {tuple(range(1, 16))}, out
    assert int(store.get("gen1/publisher")) != 0
    assert time.monotonic() - t0 < 10, "the takeover waited for the agreement deadline"


def test_the_vote_of_a_sharded_step_costs_each_member_three_calls_and_a_dead_watcher_is_replaced(store):
    """The vote (kept for a sharded optimizer state): each of 16 members counts its ok, waits for
    the decision server-side and reads it. When the watcher (rank 0) hangs before it votes, another
    member takes the watch over and decides abort."""
    counts = collections.Counter()
    members = _counted_members(store, 16, counts, beating=range(16))
    try:
        out = _in_threads(members, lambda m: m.votes.decide(0, 3, list(range(16)), True, 16))
        assert all(d.commit for d in out.values()), out
        # the vote, the wait, the decision; the last voter: + the joiners, the decision, the pokes
        assert sorted(counts.values())[:-1] == [3] * 15 and max(counts.values()) <= 6, counts
        members[0].stop()  # rank 0 hangs
        t0 = time.monotonic()
        out = _in_threads(members[1:], lambda m: m.votes.decide(0, 4, list(range(16)), True, 16))
    finally:
        for m in members:
            m.stop()
    assert not any(d.commit for d in out.values()), out
    assert time.monotonic() - t0 < 10


def test_a_store_that_pauses_for_less_than_the_heartbeat_timeout_declares_nobody_dead():
    """The store's process is stopped (SIGSTOP) for 0.6 s, less than the 1.5 s heartbeat timeout,
    while 4 members beat; then they agree: nobody is left out."""
    import os
    import signal
    import subprocess
    import sys

    from tests.helpers import ROOT, free_port

    port = free_port()
    daemon = subprocess.Popen([sys.executable, "-m", "megatron_mecefo.elastic.launch.store_daemon", "--host", "127.0.0.1",
                               "--port", str(port), "--grace", "0", "--idle-timeout", "0"], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert daemon.stdout.readline().startswith("ready: the store of job")
        connect = lambda: dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,  # noqa: E731
                                        timeout=timedelta(seconds=30))
        members = [Membership(connect(), connect, r, heartbeat_interval_s=0.1, heartbeat_timeout_s=1.5,
                              agree_timeout_s=10.0) for r in range(4)]
        for m in members:
            m.start()
        assert members[0].alive(range(4)) == [0, 1, 2, 3]
        os.kill(daemon.pid, signal.SIGSTOP)
        time.sleep(0.6)
        os.kill(daemon.pid, signal.SIGCONT)
        assert members[0].alive(range(4)) == [0, 1, 2, 3]
        out = _in_threads(members, lambda m: m.generations.agree(1, [0, 1, 2, 3], 3))
        assert {p.members for p in out.values()} == {(0, 1, 2, 3)}, out
        for m in members:
            m.stop()
    finally:
        daemon.kill()


def test_a_joiner_arriving_while_16_members_agree_is_left_for_the_next_step_boundary(store):
    """Rank 5 of 16 died; its restart starts beating while the 15 survivors agree (keyed to half of
    them having checked in), beats for a while without having asked to join (the window between a
    restarted rank's heartbeat and its request), then asks. The survivors agree without it, well
    before the deadline, and the request is not lost: the next commit names rank 5 a joiner."""
    n, dead = 16, 5
    survivors = [r for r in range(n) if r != dead]
    members = _counted_members(store, n, collections.Counter(), beating=survivors)
    store.add(keys.hb(dead), 1)  # it beat once, then died
    time.sleep(0.6)  # longer than heartbeat_timeout_s: presumed dead
    joined, stop = {}, threading.Event()

    def restart():
        while int(store.add(keys.arrivals(2), 0)) < n // 2 and not stop.is_set():
            time.sleep(0.01)
        m = members[dead]
        m.start()
        time.sleep(0.5)  # beating, not yet asking
        try:
            joined["generation"] = m.request_join(time.monotonic() + 60)
        except Exception as e:  # noqa: BLE001 - the test inspects it
            joined["error"] = e

    t = threading.Thread(target=restart, daemon=True)
    t.start()
    t0 = time.monotonic()
    try:
        out = _in_threads([members[r] for r in survivors], lambda m: m.generations.agree(2, list(range(n)), 7))
        took = time.monotonic() - t0
        assert {getattr(p, "members", p) for p in out.values()} == {tuple(survivors)}, out
        assert took < 10, f"the agreement waited {took:.1f} s for the joiner (agree_timeout_s is 20 s)"
        deadline = time.monotonic() + 10
        while store.get(keys.join(dead)) != b"waiting" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert members[0].joins.pending(survivors) == [dead]
        assert not store.get(keys.joinee(dead)), "admitted outside a step boundary"
        print(f"agreed in {took:.2f} s")
        store.set(keys.joinee(dead), "3")  # what the commit that admits it writes
        t.join(10)
    finally:
        stop.set()
        for m in members:
            m.stop()
    assert joined == {"generation": 3}, joined


def _members(store, n, timeout_s):
    connect = lambda: dist.TCPStore("127.0.0.1", store.port, is_master=False, wait_for_workers=False)  # noqa: E731
    return [Membership(connect(), connect, r, heartbeat_interval_s=0.1, heartbeat_timeout_s=timeout_s,
                       agree_timeout_s=20.0) for r in range(n)]


def test_a_rank_the_watcher_saw_stalled_is_not_watched_again_by_the_publisher(store):
    """Rank 3 of 4 hangs (its heartbeat stops) during a step. The generation's lowest member reports
    it stalled once its counter has not moved for the heartbeat timeout; the agreement that follows
    the collective's timeout leaves it out at once, where the publisher, which never looked at its
    heartbeat before, would otherwise watch it for another heartbeat timeout (3 s here)."""
    members = _members(store, 4, timeout_s=3.0)
    for m in members:
        m.start()
        m.watch_liveness(range(4))
    try:
        time.sleep(0.3)
        members[3].stop()  # hung: no more beats
        deadline = time.monotonic() + 10
        while b'"3"' not in (store.get(keys.STALE) if store.check([keys.STALE]) else b"") and time.monotonic() < deadline:
            time.sleep(0.05)
        report = json.loads(store.get(keys.STALE))
        assert list(report) == ["3"] and report["3"][1] >= 3.0, report
        assert int(report["3"][0]) == int(store.add(keys.hb(3), 0))
        t0 = time.monotonic()
        out = _in_threads(members[:3], lambda m: m.generations.agree(1, [0, 1, 2, 3], 7))
        took = time.monotonic() - t0
    finally:
        for m in members:
            m.stop()
    assert {p.members for p in out.values()} == {(0, 1, 2)}, out
    assert took < 1.5, f"the publisher watched the stalled rank again ({took:.1f} s)"


def test_a_stall_report_is_trusted_only_while_the_counter_holds(store):
    """A rank reported stalled that beat since (a store that paused, then answered) stays alive."""
    members = _members(store, 3, timeout_s=0.5)
    store.add(keys.hb(2), 5)
    store.set(keys.STALE, json.dumps({"2": [4, 9.0]}))  # reported at counter 4; it is at 5 now
    store.add(keys.hb(1), 1)
    members[0].liveness.learn_stalls()
    assert members[0].alive([1, 2]) == [1, 2]
    store.set(keys.STALE, json.dumps({"2": [5, 9.0]}))  # the counter it still shows
    members[0].liveness.forget()
    members[0].liveness.learn_stalls()
    assert members[0].alive([1, 2]) == [1]
