"""Fail-slow in real processes: a replica slowed by an injected slow-down (it sleeps for the extra
compute) sheds micro-batches to the others once its window says it is slow, on every member at the
same step, and takes them back once it is fast again. The math does not change: the final
parameters equal the fault-free reference, and every step consumed the global batch once."""

import json

import pytest

from tests.elastic.test_fault_tolerance import K, STEPS, check_run, launch, references  # noqa: F401

pytestmark = [pytest.mark.dist, pytest.mark.fault]


def events(out, rank, kind):
    path = out / f"events_rank{rank}.jsonl"
    return [e for e in map(json.loads, path.read_text().splitlines()) if e["event"] == kind]


def test_a_transient_straggler_sheds_micro_batches_and_takes_them_back(tmp_path, references):
    """D = 4, k = 2, rank 2 twice as slow in steps 1..5, a window of 2 steps: slow after steps 1 and
    2 committed, so step 3 runs rebalanced (rank 2 one micro-batch, one other replica three); fast
    again after steps 6 and 7, so step 8 runs the even plan."""
    proc, _ = launch(tmp_path, 4, "--step-sleep", "0.2", "--mecefo-rebalance", "--mecefo-rebalance-window", "2",
                     "--mecefo-inject", "slow:2:2:1:6")
    records = check_run(tmp_path, 4, [0, 1, 2, 3], references[4], proc)
    plans = [[(e["step"], e["micro_batches"], sorted(e["factors"])) for e in events(tmp_path, r, "rebalance")]
             for r in range(4)]
    assert all(p == plans[0] for p in plans), plans
    (s1, counts1, slow1), (s2, counts2, slow2) = plans[0]
    assert (s1, slow1, counts1["2"], sorted(counts1.values())) == (3, ["2"], 1, [1, 2, 2, 3]), plans[0]
    assert (s2, slow2, sorted(counts2.values())) == (8, [], [2, 2, 2, 2]), plans[0]
    factor = events(tmp_path, 0, "rebalance")[0]["factors"]["2"]
    assert 1.7 < factor < 2.3, factor
    ran = {step: {r["rank"]: len(r["micro_batches"]) for r in recs} for step, recs in records.items()}
    assert all(ran[s][2] == (1 if 3 <= s < 8 else K) for s in range(STEPS)), ran
    assert "replicas [2] slow (x" in proc.stderr and "no replica slow any more" in proc.stderr


def test_a_kill_during_a_rebalanced_step_leaves_a_cover_plan_rebalanced_anew(tmp_path, references):
    """Rank 2 twice as slow from step 1 (rebalanced from step 3); rank 1 killed in step 5's backward.
    The new generation starts from its cover plan, rank 2 (rank 1's ring neighbour) running 2k
    micro-batches while slow, and after two committed steps in it sheds them again (step 7)."""
    proc, _ = launch(tmp_path, 4, "--step-sleep", "0.2", "--mecefo-rebalance", "--mecefo-rebalance-window", "2",
                     "--mecefo-inject", "slow:2:2:1", "--mecefo-inject", "kill:1:5:backward")
    records = check_run(tmp_path, 4, [0, 2, 3], references[4], proc)
    plans = [[(e["generation"], e["step"], e["micro_batches"]) for e in events(tmp_path, r, "rebalance")]
             for r in (0, 2, 3)]
    assert all(p == plans[0] for p in plans), plans
    assert [(g, s) for g, s, _ in plans[0]] == [(0, 3), (1, 7)], plans[0]
    gen1 = plans[0][1][2]
    assert set(gen1) == {"0", "2", "3"} and gen1["2"] < 2 * K and sum(gen1.values()) == 4 * K, gen1
    ran = {step: {r["rank"]: len(r["micro_batches"]) for r in recs} for step, recs in records.items()}
    assert [ran[s][2] for s in (5, 6)] == [2 * K, 2 * K], "the new generation's cover plan, not the old deal"
    assert all(ran[s][2] == gen1["2"] for s in range(7, STEPS)), ran


def test_a_replica_slower_than_retire_slower_than_is_retired_and_rejoins(tmp_path, references):
    """Rank 2 four times as slow in steps 1..4, retire_slower_than 3, a window of 2: after steps 1
    and 2 every member names it too slow; at step 3 it leaves (exit 4), the others cover it, the
    launcher restarts it and it rejoins (the job waits for it at step 7); the math is unchanged."""
    proc, _ = launch(tmp_path, 4, "--step-sleep", "0.2", "--mecefo-rebalance", "--mecefo-rebalance-window", "2",
                     "--mecefo-retire-slower-than", "3", "--mecefo-inject", "slow:2:4:1:5",
                     "--mecefo-inject", "hold:2:7:1", restart_after=0.5)
    check_run(tmp_path, 4, [0, 1, 2, 3], references[4], proc)
    (retired,) = events(tmp_path, 2, "retired")
    assert retired["reason"] == "slow" and retired["step"] == 3 and retired["factor"] > 3, retired
    decided = [events(tmp_path, r, "retire_slow") for r in (0, 1, 3)]
    assert all([(e["step"], e["replicas"]) for e in d] == [(3, [2])] for d in decided), decided
    regroups = [e for e in events(tmp_path, 0, "regroup") if e["generation"] > 0]
    assert 2 not in regroups[0]["members"] and regroups[0]["cover"] == {"2": 3}, regroups[0]
    assert any(e["joiners"] == [2] for e in regroups), "the retired rank rejoined"
    assert "retired as failed (slower than retire_slower_than 3.0)" in proc.stderr


def test_without_rebalance_a_slow_replica_keeps_its_micro_batches(tmp_path, references):
    proc, _ = launch(tmp_path, 3, "--step-sleep", "0.05", "--mecefo-inject", "slow:1:2:1")
    records = check_run(tmp_path, 3, [0, 1, 2], references[3], proc)
    assert not events(tmp_path, 0, "rebalance")
    assert all(len(r["micro_batches"]) == K for recs in records.values() for r in recs)
    (slow,) = [e for e in events(tmp_path, 1, "inject") if e["kind"] == "slow"]
    assert (slow["step"], slow["factor"]) == (1, 2.0)

