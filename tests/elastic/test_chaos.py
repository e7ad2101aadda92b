"""The chaos harness: schedules, the invariant checker (it must catch broken runs), and a fixed set
of compound-failure schedules on the toy runtime job, each a regression test."""

import json
from pathlib import Path

import pytest

from megatron_mecefo.config import MeCeFOConfig
from megatron_mecefo.elastic.plan.fold import fold_neighbor
from megatron_mecefo.elastic.plan.topology import Grid, ring_cover
from megatron_mecefo.testing import chaos
from megatron_mecefo.testing.chaos import Fault, Schedule

# -- schedules (pure) ------------------------------------------------------------------------------


@pytest.mark.unit
def test_random_schedules_are_deterministic_and_parse_as_flags():
    a = [chaos.random_schedule(s, 4, 30) for s in range(50)]
    assert a == [chaos.random_schedule(s, 4, 30) for s in range(50)]
    kinds = {f.phase for s in a for f in s.faults}
    assert {"recovery", "join", "transfer", "admit"} <= kinds, "compound orders are drawn"
    assert any(f.rank == 0 for s in a for f in s.faults), "the deciding rank is a target"
    assert any(f.incarnation == 1 for s in a for f in s.faults), "restarted ranks are targets"
    for s in a:
        rules = MeCeFOConfig.from_ds_config({"inject": [f.flag() for f in s.faults]}).inject
        assert [(r["kind"], r["rank"], r["step"], r["phase"], r["incarnation"]) for r in rules] == \
               [(f.kind, f.rank, f.step, f.phase, f.incarnation) for f in s.faults]
        assert all(0 <= f.rank < 4 for f in s.faults)


# -- the checker catches what it must --------------------------------------------------------------

K = 2


def _write_logs(d: Path, steps, world=3, drop=None, hash_of=None, silent=None, regroup=True):
    """Step records of a healthy 3-rank run, with optional damage. `silent` = (step, rank): that
    rank writes nothing from `step` on (SIGKILLed after the step's commit, before its record);
    with `regroup` the others go on from step + 1 in generation 1, covering it."""
    grid = Grid(dp=world)
    for r in range(world):
        with open(d / f"steps_rank{r}.jsonl", "w") as f:
            for s in range(steps):
                if silent and r == silent[1] and s >= silent[0]:
                    break
                live, gen = list(range(world)), 0
                if silent and regroup and s > silent[0]:
                    live, gen = [x for x in live if x != silent[1]], 1
                plan = ring_cover(grid, live)
                mbs = [[m.replica, m.index, m.covering] for m in fold_neighbor(plan, K).micro_batches(r)]
                if drop == (s, r):
                    mbs = mbs[:1]
                rec = {"event": "step", "rank": r, "step": s, "generation": gen, "live": live,
                       "cover": {str(f): c for f, c in plan.cover.items()}, "micro_batches": mbs,
                       "param_sha256": (hash_of or {}).get((s, r), f"h{s}")}
                f.write(json.dumps(rec) + "\n")


def _result(code, elapsed=10.0, stderr=""):
    return chaos.RunResult(code, elapsed, "", stderr)


SCHED = Schedule(seed=0, world=3, steps=5, faults=(Fault("kill", 1, 2, "backward"),), restart_after=None)


@pytest.mark.unit
def test_checker_passes_a_good_run_and_catches_damage(tmp_path):
    _write_logs(tmp_path, 5)
    assert chaos.check_run(_result(0), tmp_path, SCHED, k=K, bound_s=60) == ("finished", [])
    outcome, bad = chaos.check_run(_result(0, elapsed=100), tmp_path, SCHED, k=K, bound_s=60)
    assert outcome == "failed" and "over the bound" in bad[0]
    assert chaos.check_run(_result(None), tmp_path, SCHED, k=K, bound_s=60)[1][0].endswith("(hung)")
    assert "exit status 1" in chaos.check_run(_result(1), tmp_path, SCHED, k=K, bound_s=60)[1][-1]
    _write_logs(tmp_path, 4)
    assert "committed steps are not 0..4" in chaos.check_run(_result(0), tmp_path, SCHED, k=K, bound_s=60)[1][0]
    _write_logs(tmp_path, 5, drop=(3, 1))
    assert "exactly once" in chaos.check_run(_result(0), tmp_path, SCHED, k=K, bound_s=60)[1][0]
    _write_logs(tmp_path, 5, hash_of={(2, 2): "other"})
    assert chaos.check_run(_result(0), tmp_path, SCHED, k=K, bound_s=60)[1] == ["replicas differ at the start of step 2"]
    # killed between the store's commit decision and its record: the step still ran the whole batch
    _write_logs(tmp_path, 5, silent=(2, 1))
    assert chaos.check_run(_result(0), tmp_path, SCHED, k=K, bound_s=60) == ("finished", [])
    # ... but a member that wrote no record while its generation went on with it is a violation
    _write_logs(tmp_path, 5, silent=(2, 1), regroup=False)
    assert "no record of step 2, yet generation 0 went on with it" in \
        chaos.check_run(_result(0), tmp_path, SCHED, k=K, bound_s=60)[1][0]


def _gave_up(d: Path, rank, **fields):
    rec = {"event": "gave_up", "rank": rank, "kind": "NoCoverAvailable", "reason": "r", "step": 3,
           "members": [0], "has_state": True, "checkpoint": None, **fields}
    with open(d / f"events_rank{rank}.jsonl", "a") as f:
        f.write(json.dumps(rec) + "\n")


@pytest.mark.unit
def test_checker_accepts_only_real_give_ups(tmp_path):
    said = "[mecefo-launch] the job gave up: ..."
    _write_logs(tmp_path, 3)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    _gave_up(tmp_path, 0, checkpoint=str(ckpt))
    assert chaos.check_run(_result(3, stderr=said), tmp_path, SCHED, k=K, bound_s=60) == ("gave_up", [])
    # the launcher must say why
    assert "did not say why" in chaos.check_run(_result(3), tmp_path, SCHED, k=K, bound_s=60)[1][0]
    # survivors [0, 1] of 3 replicas can be covered: giving up is a bug
    (tmp_path / "events_rank0.jsonl").unlink()
    _gave_up(tmp_path, 0, checkpoint=str(ckpt), members=[0, 1])
    assert "can be covered" in chaos.check_run(_result(3, stderr=said), tmp_path, SCHED, k=K, bound_s=60)[1][0]
    # a state holder gave up but wrote no checkpoint
    (tmp_path / "events_rank0.jsonl").unlink()
    _gave_up(tmp_path, 0)
    assert "no checkpoint was written" in chaos.check_run(_result(3, stderr=said), tmp_path, SCHED, k=K, bound_s=60)[1][0]
    # a checkpoint of the wrong step
    (tmp_path / "events_rank0.jsonl").unlink()
    _gave_up(tmp_path, 0, checkpoint=str(ckpt), step=2)
    assert "checkpoint of step 2, but 3 steps" in chaos.check_run(_result(3, stderr=said), tmp_path, SCHED, k=K, bound_s=60)[1][0]
    # a timeout is not a reason
    (tmp_path / "events_rank0.jsonl").unlink()
    _gave_up(tmp_path, 0, checkpoint=str(ckpt), kind="AgreementTimeout")
    assert "gave up for AgreementTimeout" in chaos.check_run(_result(3, stderr=said), tmp_path, SCHED, k=K, bound_s=60)[1][0]


# -- fixed compound schedules on the toy runtime job (real processes, SIGKILL / SIGSTOP) ------------

from megatron_mecefo.testing import chaos_runs as chaos_util  # noqa: E402

def _hold(rank, step, incarnation=1):
    """The job waits at `step` for that restarted incarnation: keyed to the rejoin, not the clock."""
    return Fault("hold", rank, step, "forward", incarnation)


REGRESSIONS = {
    # The compound-failure reproducer, on the toy: rank 0 is killed and restarted; rank 2 hangs while
    # rank 0 waits to be admitted (the job holds at step 12 until rank 0 has asked to rejoin, so
    # the recovery from the hang happens with a joiner waiting); rank 3 dies right after the
    # agreement of the generation that admits rank 0. Before the fix, the next generation took
    # rank 0 in without the state (step 0) and the job deadlocked on two different commit keys.
    "joiner_caught_in_a_recovery": Schedule(1001, 4, 24, (
        Fault("kill", 0, 8, "optimizer"), _hold(0, 12), Fault("hang", 2, 12, "allreduce"),
        Fault("kill", 3, 13, "recovery")), 0.5),
    # A member that is not the donor dies while the state goes to a restarted rank.
    "member_dies_mid_transfer": Schedule(1007, 4, 24, (
        Fault("kill", 1, 3, "backward"), _hold(1, 6), Fault("kill", 3, "*", "transfer")), 0.5),
    # The donor dies while it sends the state to a restarted rank: the others form a new generation
    # and the next donor sends it (before the fix the receivers crashed).
    "donor_dies_mid_transfer": Schedule(1002, 3, 24, (
        Fault("kill", 1, 3, "backward"), _hold(1, 6), Fault("kill", 0, "*", "transfer")), 0.5),
    # The restarted rank itself dies while it receives the state; then comes back once more.
    "joiner_dies_mid_transfer": Schedule(1003, 3, 24, (
        Fault("kill", 2, 3, "allreduce"), _hold(2, 6), Fault("kill", 2, "*", "transfer", 1), _hold(2, 14, 2)), 0.5),
    # The deciding rank and its covering neighbour fail together, during the recovery.
    "decider_and_cover_together": Schedule(1004, 4, 24, (
        Fault("kill", 0, 5, "allreduce"), Fault("hang", 1, 5, "recovery")), 1.0),
    # The last rank that holds the state cannot cover: the job gives up with a checkpoint; the
    # launcher restarts nobody into the dead job (before the fix: no checkpoint, and restarted ranks
    # waited until an outside kill).
    "last_survivor_gives_up": Schedule(1005, 4, 24, (
        Fault("hang", 3, 4, "backward"), Fault("kill", 0, 8, "forward"), Fault("kill", 1, 9, "backward")), 0.5),
    # Found by the harness (seed 116): every rank crashes, one during the recovery. Nobody is left to
    # give up; the launcher ends the job with exit 3 and says why (it exited 1 without a reason).
    "every_rank_dies": Schedule(116, 3, 24, (
        Fault("kill", 0, 1, "backward"), Fault("kill", 1, 2, "backward"), Fault("kill", 2, 2, "recovery")), None),
    # Found by the harness (seeds 27, 45): every rank hangs. The launcher killed them and exited 1
    # without a reason; now it ends the job with exit 3 and says why.
    "every_rank_hangs": Schedule(27, 2, 24, (
        Fault("hang", 0, 10, "allreduce"), Fault("hang", 1, 10, "backward"), Fault("kill", 0, 13, "forward")), 4.0),
    # The commit's confirmation fails on rank 1 although the others' completed (they commit step 5):
    # rank 1 keeps its reduced gradients and, at the agreement, commits step 5 with them.
    "a_member_whose_confirmation_failed_commits_late": Schedule(1008, 3, 24, (
        Fault("error", 1, 5, "commit"),), 0.5),
    # The same on the lowest rank (it names joiners and marks the progress), while rank 2 dies right
    # after the agreement that lets rank 0 commit late: that generation does not form, and rank 0,
    # still holding its gradients, commits step 5 in the next one; rank 2 rejoins.
    "the_lowest_commits_late_as_a_rank_dies": Schedule(1009, 4, 24, (
        Fault("error", 0, 5, "commit"), Fault("kill", 2, 6, "recovery")), 0.5),
    # The last rank with the state dies right after its commit decision admits a restarted rank:
    # nobody can send the joiner the state, so it ends the job (StateLost) instead of waiting.
    "state_lost_when_the_admitting_rank_dies": Schedule(1006, 2, 24, (
        Fault("kill", 1, 2, "backward"), _hold(1, 5), Fault("kill", 0, "*", "admit")), 0.3),
}


@pytest.fixture(scope="module")
def toy_references(tmp_path_factory):
    return {w: chaos_util.toy_reference(tmp_path_factory.mktemp(f"ref{w}"), w) for w in (2, 3, 4)}


def run_clean(tmp_path, references, schedule, **options):
    """Run `schedule` on the toy job; no invariant may be violated. Returns (outcome, result)."""
    outcome, bad, result = chaos_util.run_toy(schedule, tmp_path, references[schedule.world], **options)
    assert not bad, f"{schedule.describe()}\n" + "\n".join(bad) + "\n" + result.stderr[-4000:]
    return outcome, result


@pytest.mark.dist
@pytest.mark.fault
@pytest.mark.parametrize("name", sorted(REGRESSIONS))
def test_compound_schedule(tmp_path, toy_references, name):
    schedule = REGRESSIONS[name]
    outcome, result = run_clean(tmp_path, toy_references, schedule)
    fired = sum(line.startswith("[mecefo inject]") for line in result.stderr.splitlines())
    holds = [f for f in schedule.faults if f.kind == "hold"]
    waited = chaos.events(tmp_path, schedule.world, "hold")
    assert {(e["rank_awaited"], e["incarnation"]) for e in waited} == {(f.rank, f.incarnation) for f in holds}
    if name == "joiner_caught_in_a_recovery":
        assert outcome == "finished" and fired == 3
        assert "rank 3: kill at step 13 (recovery)" in result.stderr, "the admission generation lost a member"
        # the recovery from the hang ran while rank 0 waited to be admitted
        recovered = [e for e in chaos.events(tmp_path, 4, "regroup") if e["step"] == 12 and e["generation"] > 1]
        assert recovered and all(0 not in e["members"] for e in recovered)
        rejoined = [e for e in chaos.events(tmp_path, 4, "regroup") if e["rank"] == 0 and e["joiners"] == [0]]
        assert [e["step"] for e in rejoined] == [13], "rank 0 got the state of step 13 before it trained"
    elif name in ("donor_dies_mid_transfer", "joiner_dies_mid_transfer", "member_dies_mid_transfer"):
        assert outcome == "finished" and fired == 2
        # an admission was under way when the fault struck (a generation that did not form is logged
        # as regroup_failed: with it, no member trains in a generation one position could not form)
        attempts = chaos.events(tmp_path, schedule.world, "regroup") + chaos.events(tmp_path, schedule.world, "regroup_failed")
        assert any(e["joiners"] for e in attempts)
    elif name == "last_survivor_gives_up":
        assert outcome == "gave_up"
        (ckpt,) = [e for e in chaos.events(tmp_path, 4, "gave_up") if e["checkpoint"]]
        assert ckpt["kind"] == "NoCoverAvailable" and ckpt["rank"] == 2
        import torch

        assert torch.load(ckpt["checkpoint"], weights_only=False)["step"] == 9
        assert "will restart" not in result.stderr.split("ended: exit code 3")[-1], "no restart into a job that gave up"
    elif name in ("every_rank_dies", "every_rank_hangs"):
        assert outcome == "gave_up" and fired == min(3, schedule.world)
        assert "the job gave up: no rank of the job is left running" in result.stderr
    elif name in ("a_member_whose_confirmation_failed_commits_late", "the_lowest_commits_late_as_a_rank_dies"):
        assert outcome == "finished" and fired == len(schedule.faults)
        late = schedule.faults[0].rank
        rolled = [e for e in chaos.events(tmp_path, schedule.world, "regroup") if e.get("rolled")]
        assert rolled and {tuple(e["rolled"]) for e in rolled} == {(late,)} and {e["step"] for e in rolled} == {6}, rolled
    elif name == "state_lost_when_the_admitting_rank_dies":
        assert outcome == "gave_up"
        kinds = {e["kind"] for e in chaos.events(tmp_path, 2, "gave_up")}
        assert "StateLost" in kinds, kinds
    else:
        assert outcome == "finished" and fired == len(schedule.faults) - len(holds)


SHARDED = {
    # A shard owner dies after the commit (the survivors' parameter gather fails and they regroup at
    # once); its restarted incarnation dies again while its admission re-shards (receiving its
    # shard and copy): that generation never forms, the survivors go on from the state they held,
    # and the next incarnation is admitted.
    "gather_then_reshard_during_the_rejoin": Schedule(2001, 4, 24, (
        Fault("kill", 1, 4, "optimizer"), _hold(1, 8), Fault("kill", 1, "*", "reshard", 1), _hold(1, 14, 2)), 0.3),
    # The commit that admits restarted rank 1 (step 5's: the hold) is followed by
    # rank 2's death before its optimizer step: the survivors' gather fails with the admission
    # pending, and they regroup into the admitted generation (rank 2's shard from its copy on 3).
    "gather_fails_as_a_joiner_is_admitted": Schedule(2003, 4, 24, (
        Fault("kill", 1, 2, "backward"), _hold(1, 5), Fault("kill", 2, "*", "admit")), 0.3),
    # Two neighbours die in one step: the shard whose owner and copy holder are both gone is lost,
    # and with on_shard_loss "give_up" the job ends cleanly (never trains on a partial state).
    "two_neighbours_in_one_step": Schedule(2002, 4, 24, (
        Fault("kill", 1, 5, "backward"), Fault("kill", 2, 5, "backward")), None),
}


@pytest.mark.dist
@pytest.mark.fault
@pytest.mark.parametrize("name", sorted(SHARDED))
def test_sharded_compound_schedule(tmp_path, toy_references, name):
    """The toy job with its Adam state sharded (neighbour copies): the chaos invariants, and every
    element of the state held by a finished rank and equal to the fault-free run's."""
    schedule = SHARDED[name]
    outcome, result = run_clean(tmp_path, toy_references, schedule, sharded=True)
    if name == "gather_then_reshard_during_the_rejoin":
        assert outcome == "finished"
        assert [e["step"] for e in chaos.events(tmp_path, 4, "gather_failed") if e["rank"] == 0] == [4]
        failed = [e for e in chaos.events(tmp_path, 4, "regroup_failed") if e["rank"] == 0]
        assert [e["joiners"] for e in failed] == [[1]], "the admission that lost its joiner mid re-shard"
        assert "rank 1: kill at step" in result.stderr and "(reshard)" in result.stderr
    elif name == "gather_fails_as_a_joiner_is_admitted":
        assert outcome == "finished"
        (gather,) = [e["step"] for e in chaos.events(tmp_path, 4, "gather_failed") if e["rank"] == 0]
        after = [e for e in chaos.events(tmp_path, 4, "regroup") if e["rank"] == 0 and e["step"] == gather + 1]
        # the hold pins the admission to step 5's commit, however fast the rank came back
        assert gather == 5 and after and 2 not in after[0]["members"]
    else:
        assert outcome == "gave_up"
        assert "the sharded optimizer state lost elements" in result.stderr


SPREAD = {
    # cover "spread" (4 replicas, k = 2): replica 1's two micro-batches go to replicas 2 and 3; rank
    # 2, holding one of them, dies in the reduction of a spread step; its restarted incarnation and
    # rank 1's are admitted (the job waits for both at step 12), and a new plan deals the rest.
    "a_rank_holding_adopted_micro_batches_dies": Schedule(3001, 4, 24, (
        Fault("kill", 1, 3, "backward"), Fault("kill", 2, 6, "allreduce"), _hold(1, 12), _hold(2, 12)), 0.5),
    # The deciding rank dies right after the survivors agreed (with its measured costs published in
    # the agreement): that generation cannot form, the others agree again without it, and plan with
    # what the new members posted.
    "the_decider_dies_after_posting_its_costs": Schedule(3002, 4, 24, (
        Fault("kill", 1, 3, "backward"), Fault("kill", 0, 3, "recovery")), None),
}


@pytest.mark.dist
@pytest.mark.fault
@pytest.mark.parametrize("name, schedule", sorted(SPREAD.items()))
def test_spread_compound_schedule(tmp_path, toy_references, name, schedule):
    """cover "spread" on the toy job (exact fold): the chaos invariants (every step's global batch
    once, read from each generation's logged plan), the final state equal to the fault-free run's,
    and the lost micro-batches on more than one survivor."""
    outcome, result = run_clean(tmp_path, toy_references, schedule, cover="spread")
    assert outcome == "finished"
    plans = chaos.generation_plans(tmp_path, 4)
    if name == "a_rank_holding_adopted_micro_batches_dies":
        assert plans[1] == {"2": [[2, 0, False], [2, 1, False], [1, 0, False]],
                            "3": [[3, 0, False], [3, 1, False], [1, 1, False]]}, "replica 1's micro-batches on 2 and 3"
        # replicas 1 and 2 out: their four micro-batches on the two survivors, two each
        assert plans[2] == {"0": [[0, 0, False], [0, 1, False], [2, 0, False], [2, 1, False]],
                            "3": [[3, 0, False], [3, 1, False], [1, 0, False], [1, 1, False]]}
        assert max(plans) >= 3 and plans[max(plans)] == {}, "both came back: nobody covers"
    else:
        assert [e["generation"] for e in chaos.events(tmp_path, 4, "regroup_failed") if e["rank"] == 2] == [1]
        assert {e["generation"]: e["members"] for e in chaos.events(tmp_path, 4, "regroup") if e["rank"] == 2}[2] == [2, 3]
        assert plans[2] == {"2": [[2, 0, False], [2, 1, False], [0, 0, False], [0, 1, False]],
                            "3": [[3, 0, False], [3, 1, False], [1, 0, False], [1, 1, False]]}


@pytest.mark.unit
def test_a_member_that_died_after_a_rebalanced_commit_ran_the_rebalanced_plan():
    """D = 3, k = 2: from step 2 replica 1 runs one micro-batch and replica 0 three (a rebalance
    event); rank 1 dies after step 3's commit, before its record. The checker counts what the
    rebalanced plan gave it; with the generation's even plan the batch would not add up."""
    from megatron_mecefo.elastic.plan.topology import Grid

    grid = Grid(dp=3)

    def rec(rank, step, mbs):
        return {"rank": rank, "step": step, "generation": 0, "live": [0, 1, 2], "cover": {},
                "micro_batches": [[d, j, False] for d, j in mbs], "param_sha256": "h"}

    even = {0: [(0, 0), (0, 1)], 1: [(1, 0), (1, 1)], 2: [(2, 0), (2, 1)]}
    shed = {0: [(0, 0), (0, 1), (1, 1)], 1: [(1, 0)], 2: [(2, 0), (2, 1)]}
    records = {s: [rec(r, s, (even if s < 2 else shed)[r]) for r in range(3) if (s, r) != (3, 1)] for s in range(4)}
    plans = {0: {}, (0, 2): {str(r): [[d, j, False] for d, j in mbs] for r, mbs in shed.items()}}
    assert chaos.check_steps(records, grid, 2, 4, plans) == []
    bad = chaos.check_steps(records, grid, 2, 4, {0: {}})
    assert bad and "step 3 did not consume the global batch exactly once" in bad[0], bad
