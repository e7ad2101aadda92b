"""examples/pretrain_gpt with ds_config "zero_optimization.stage": 1: the optimizer state sharded over
the live replicas, each shard also on its covering neighbour. With the approximations off a kill (in
the backward, or after the commit while the shards are gathered) and the rejoin give the replicated
fault-free losses; a sharded checkpoint resumes at another replica count; a shard with no copy left
ends the job with a checkpoint that says what it lacks. Real processes, SIGKILL."""

import json
import re
import sys

import pytest

from tests.data.pretrain import SMALL, losses, spawn_if_refused, valid_loss
from tests.helpers import ROOT, run_launcher

pytestmark = [pytest.mark.dist, pytest.mark.fault]

EXACT = ["--mecefo", "--no-mecefo-skip-attention", "--no-mecefo-lowrank-ffn", "--mecefo-recompute-ffn", "never"]


def ds_config(tmp_path, stage, mecefo=None):
    path = tmp_path / f"ds{stage}.json"
    path.write_text(json.dumps({"optimizer": {"type": "AdamW", "params": {"betas": [0.9, 0.95], "torch_adam": True}},
                                "gradient_clipping": 1.0, "zero_optimization": {"stage": stage},
                                **({"mecefo": mecefo} if mecefo else {})}))
    return str(path)


def run(tmp_path, nproc, stage, *extra, launcher=(), expect=0, iters=8, mecefo=None):
    cmd = [sys.executable, "-m", "megatron_mecefo.elastic.launch", "--nproc-per-node", str(nproc), "--master-port", "0",
           *launcher, *spawn_if_refused(expect), str(ROOT / "examples/pretrain_gpt/pretrain_gpt.py"), *SMALL,
           "--global-batch-size", "12",
           "--train-iters", str(iters), "--eval-interval", str(iters), "--deepspeed_config", ds_config(tmp_path, stage, mecefo),
           *extra]
    proc = run_launcher(cmd, timeout=300)
    assert proc.returncode == expect, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def replicated(tmp_path_factory, shared_run):
    """The fault-free run with a replicated optimizer state: losses of iterations 1..8, validation
    (once per session: xdist may run this module's tests on both workers)."""
    tmp = tmp_path_factory.mktemp("replicated")
    out = shared_run("sharded-replicated", [3, 0, *EXACT], lambda: run(tmp, 3, 0, *EXACT)).stdout
    return losses(out), valid_loss(out)


def steps_of(log_dir, rank):
    return [json.loads(line) for line in (log_dir / f"steps_rank{rank}.jsonl").read_text().splitlines()]


def events_of(log_dir, event, rank=0):
    return [e for e in map(json.loads, (log_dir / f"events_rank{rank}.jsonl").read_text().splitlines())
            if e["event"] == event]


def assert_fault_free_losses(out, replicated, iterations=range(1, 9)):
    """The losses of `iterations` are the replicated fault-free run's (approximations off)."""
    ref_losses, _ = replicated
    got = losses(out)
    assert [got[i] for i in iterations] == pytest.approx([ref_losses[i] for i in iterations], rel=1e-5)


def test_sharded_run_equals_replicated_through_a_kill_after_the_commit_and_a_rejoin(tmp_path, replicated):
    """Rank 1 (owner of the middle shard) is SIGKILLed after step 3's commit and restarted; the job
    waits for it at step 5 (hold). The survivors' parameter gather fails and they regroup at once
    (its shard's update lives on in rank 2's copy); the restarted rank receives its shard and copy.
    With ds_config "mecefo": {"cover": "spread"} its two micro-batches go one to each survivor
    (the shard copy stays on rank 2, the ring neighbour). (A kill before the commit: the re-shard tests below, the reinit
    test and the chaos schedules.)"""
    phase = "optimizer"
    logs = tmp_path / "logs"
    out = run(tmp_path, 3, 1, *EXACT, "--mecefo-inject", f"kill:1:3:{phase}", "--mecefo-inject", "hold:1:5",
              "--mecefo-log-dir", str(logs), "--mecefo-log-param-hash", launcher=["--restart-failed-after", "0"],
              mecefo={"cover": "spread"}).stdout
    assert "optimizer state sharded over 3 replicas (shard_redundancy=neighbour)" in out
    assert "cover 1->0+2" in out and "live 3/3" in out.split("cover 1->0+2")[-1], "degraded, then whole again"
    spread = [(rank, rec["micro_batches"]) for rank in (0, 2) for rec in steps_of(logs, rank) if rec["step"] == 4]
    assert spread == [(0, [[0, 0, False], [0, 1, False], [1, 1, False]]), (2, [[2, 0, False], [2, 1, False], [1, 0, False]])]
    assert sorted(losses(out)) == list(range(1, 9))
    assert_fault_free_losses(out, replicated)
    assert valid_loss(out) == pytest.approx(replicated[1], rel=1e-5)
    by_step = {}
    for rank in range(3):
        for rec in steps_of(logs, rank):
            by_step.setdefault(rec["step"], set()).add(rec["param_sha256"])
    assert sorted(by_step) == list(range(8))
    assert all(len(hashes) == 1 for hashes in by_step.values()), "replicas hold bit-identical parameters every step"
    assert [e["step"] for e in events_of(logs, "gather_failed")] == [3]
    for rank in range(3):  # the sharded state holds no old generation's group after a regroup
        alive = [e["groups_alive"] for e in events_of(logs, "regroup", rank)]
        assert len(alive) >= 2 and set(alive) == {1}, (rank, alive)


def test_a_sharded_checkpoint_resumes_at_another_replica_count_and_without_mecefo(tmp_path, replicated):
    """The sharded state is saved in DeepSpeed's own ZeRO format (one rank's file: the engine's world
    is the replica): MeCeFO resumes it on 2 replicas, and plain DeepSpeed (no --mecefo, ZeRO stage 1,
    one rank) leaves MeCeFO with it; both with the fault-free losses."""
    ckpt = tmp_path / "ckpt"
    run(tmp_path, 3, 1, *EXACT, "--save", str(ckpt), "--save-interval", "4", iters=4)
    files = sorted(p.name for p in (ckpt / "global_step4").glob("*optim*.pt"))
    assert files == ["zero_pp_rank_0_mp_rank_00_optim_states.pt"], files  # the shard files were gathered into it
    out = run(tmp_path, 2, 1, *EXACT, "--load", str(ckpt)).stdout
    assert "starting at iteration 4" in out and "sharded over 2 replicas" in out
    assert_fault_free_losses(out, replicated, range(5, 9))
    left = run(tmp_path, 1, 1, "--load", str(ckpt)).stdout
    assert "MeCeFO" not in left
    assert_fault_free_losses(left, replicated, range(5, 9))


def test_a_give_up_checkpoint_gathers_the_shards_into_deepspeeds_format(tmp_path, replicated):
    """3 replicas, no restarts: rank 1 dies at step 3 (rank 2 covers it), rank 2 at step 6, and
    rank 0 cannot cover both: the job gives up (exit 3). Rank 0 holds every shard (its own and its
    copy of rank 2's) and writes the checkpoint of the last committed step with the state gathered
    into DeepSpeed's ZeRO file; plain DeepSpeed on one rank resumes it with the fault-free losses."""
    ckpt = tmp_path / "ckpt"
    proc = run(tmp_path, 3, 1, *EXACT, "--mecefo-inject", "kill:1:3", "--mecefo-inject", "kill:2:6", "--save", str(ckpt),
               expect=3)
    out = proc.stdout + proc.stderr
    tag = (ckpt / "latest").read_text().strip()
    assert f"checkpoint of step {tag.removeprefix('global_step')} written to" in out
    assert sorted(p.name for p in (ckpt / tag).glob("*optim*.pt")) == ["zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    left = run(tmp_path, 1, 1, "--load", str(ckpt)).stdout
    done = int(tag.removeprefix("global_step"))
    assert sorted(losses(left)) == list(range(done + 1, 9))
    assert_fault_free_losses(left, replicated, range(done + 1, 9))


def test_a_shard_without_copy_ends_the_job_with_a_checkpoint_that_says_what_it_lacks(tmp_path):
    """shard_redundancy "none": rank 1 is killed after step 3's commit (the others' parameter gather
    fails), its shard has no copy, and the job gives up with the checkpoint after that step (the
    survivors first re-send the parameters they hold); `--load` then refuses it."""
    ckpt = tmp_path / "ckpt"
    proc = run(tmp_path, 3, 1, *EXACT, "--mecefo-shard-redundancy", "none", "--mecefo-inject", "kill:1:3:optimizer",
               "--save", str(ckpt), expect=3)
    assert "the sharded optimizer state lost elements" in proc.stdout + proc.stderr
    assert (ckpt / "global_step4").is_dir() and len(list((ckpt / "global_step4").glob("mecefo_optim_*.pt"))) == 2
    resumed = run(tmp_path, 2, 1, *EXACT, "--load", str(ckpt), expect=2)
    assert "this checkpoint cannot resume the optimizer" in resumed.stdout + resumed.stderr


def test_a_shard_owner_hung_while_the_survivors_re_shard(tmp_path, replicated):
    """4 replicas: rank 1 is SIGKILLed in step 3's backward, and rank 3 hangs (SIGSTOP) in the
    re-shard of the generation that would have covered it: the others' sends time out. That
    generation never forms; the survivors (0 and 2) agree again and re-shard from the state they
    held before: rank 1's shard from its copy on 2, rank 3's from its copy on 0. One micro-batch per
    rank-step (k=3) keeps the global batch of the 3-replica reference. (A kill in a re-shard:
    tests/elastic/test_chaos.py, the joiner killed while its admission re-shards.)"""
    kind = "hang"
    logs = tmp_path / "logs"
    out = run(tmp_path, 4, 1, *EXACT, "--micro-batch-size", "1", "--mecefo-collective-timeout-s", "5",
              "--mecefo-inject", "kill:1:3:backward", "--mecefo-inject", f"{kind}:3:3:reshard",
              "--mecefo-log-dir", str(logs)).stdout
    assert "cover 1->2, 3->0" in out
    assert [e["generation"] for e in events_of(logs, "regroup_failed")] == [1]
    assert_fault_free_losses(out, replicated)


def test_pipeline_stages_shard_their_own_state_through_a_kill_and_a_rejoin(tmp_path):
    """D = 2 x P = 2: each stage's data-parallel group shards that stage's optimizer state. Rank 0
    (stage 0 of replica 0, the lead replica) is SIGKILLed in step 3's backward and restarted; its
    replica retires, replica 1 covers on both stages, and the replica rejoins at step 5. The losses
    are the replicated fault-free run's, and the checkpoint holds each stage's state as a ZeRO file."""
    layout = ["--pipeline-model-parallel-size", "2", "--global-batch-size", "8", "--mecefo-collective-timeout-s", "5",
              "--mecefo-agree-timeout-s", "20"]
    ref = losses(run(tmp_path, 4, 0, *EXACT, *layout).stdout)
    ckpt = tmp_path / "ckpt"
    # the job waits at step 5 for both ranks of replica 0 (the killed one and its mate, which leaves)
    out = run(tmp_path, 4, 1, *EXACT, *layout, "--mecefo-inject", "kill:0:3:backward", "--mecefo-inject", "hold:0:5",
              "--mecefo-inject", "hold:2:5", "--save", str(ckpt), launcher=["--restart-failed-after", "0"]).stdout
    assert "cover 0->1" in out and "live 2/2" in out.split("cover 0->1")[-1]
    got = losses(out)
    assert [got[i] for i in range(1, 9)] == pytest.approx([ref[i] for i in range(1, 9)], rel=1e-5)
    names = sorted(p.name for p in (ckpt / "global_step8").glob("*optim*.pt"))
    assert names == [f"zero_pp_rank_0_mp_rank_0{stage}_optim_states.pt" for stage in (0, 1)]


def test_reinit_rebuilds_a_lost_shard_and_training_goes_on(tmp_path, replicated):
    """shard_redundancy "none" + on_shard_loss "reinit": rank 1's shard dies with it at step 3; the
    survivors rebuild that range (fresh moments, step 0) and finish the whole batches. Before the
    loss the run is the replicated one; after it, only the rebuilt range's optimizer state differs,
    so the losses stay close to it but are not equal."""
    logs = tmp_path / "logs"
    out = run(tmp_path, 3, 1, *EXACT, "--mecefo-shard-redundancy", "none", "--mecefo-on-shard-loss", "reinit",
              "--mecefo-inject", "kill:1:3", "--mecefo-log-dir", str(logs), "--mecefo-log-param-hash").stdout
    (reinit,) = events_of(logs, "shard_reinit")
    assert reinit["step"] == 3 and 0 < reinit["elements"] < reinit["of"]
    assert_fault_free_losses(out, replicated, range(1, 5))
    got, ref_losses = losses(out), replicated[0]
    assert got[8] != pytest.approx(ref_losses[8], rel=1e-6) and got[8] == pytest.approx(ref_losses[8], rel=0.05)
    steps = steps_of(logs, 0)
    assert [s["step"] for s in steps] == list(range(8)) and all(s["samples"] == 12 for s in steps)
    assert {s["param_sha256"] for s in steps_of(logs, 2) if s["step"] >= 3} == {s["param_sha256"] for s in steps if s["step"] >= 3}


def test_a_shard_owner_hung_after_the_commit(tmp_path, replicated):
    """Rank 1 is hung (SIGSTOP) after step 3's commit: the survivors' parameter gather waits out the
    collective timeout, they regroup at once (it is presumed failed by its heartbeat) and go on with
    its shard from rank 2's copy; the launcher ends the hung process when the job is done."""
    logs = tmp_path / "logs"
    out = run(tmp_path, 3, 1, *EXACT, "--mecefo-collective-timeout-s", "5", "--mecefo-agree-timeout-s", "20",
              "--mecefo-inject", "hang:1:3:optimizer", "--mecefo-log-dir", str(logs)).stdout
    assert "cover 1->2" in out
    assert [e["step"] for e in events_of(logs, "gather_failed")] == [3]
    assert_fault_free_losses(out, replicated)
    assert valid_loss(out) == pytest.approx(replicated[1], rel=1e-5)


@pytest.mark.parametrize("policy", ["reinit", "give_up"])
def test_two_adjacent_owners_killed_in_one_step(tmp_path, policy):
    """4 replicas with the neighbour copy: ranks 1 and 2 are SIGKILLed in the backward of step 3.
    Rank 2 held the copy of rank 1's shard, so that range has no holder left (rank 2's own shard
    lives on in rank 3's copy). "reinit" rebuilds that range and only it, and the two survivors
    finish every whole batch with bit-identical parameters; "give_up" ends the job (exit 3) with a
    checkpoint of the last committed step, whose shard files lack the range: `--load` refuses it
    and resumes the periodic checkpoint before it."""
    logs, ckpt = tmp_path / "logs", tmp_path / "ckpt"
    out = run(tmp_path, 4, 1, *EXACT, "--global-batch-size", "16", "--mecefo-on-shard-loss", policy,
              "--mecefo-inject", "kill:1:3",
              "--mecefo-inject", "kill:2:3", "--mecefo-log-dir", str(logs), "--mecefo-log-param-hash",
              "--save", str(ckpt), "--save-interval", "2", expect=0 if policy == "reinit" else 3)
    assert "optimizer state sharded over 4 replicas (shard_redundancy=neighbour)" in out.stdout
    if policy == "reinit":
        (reinit,) = events_of(logs, "shard_reinit")
        assert reinit["step"] == 3 and reinit["of"] // 5 < reinit["elements"] < reinit["of"] // 3  # one shard of 4
        steps = steps_of(logs, 0)
        assert [s["step"] for s in steps] == list(range(8)) and all(s["samples"] == 16 for s in steps)
        assert [s["param_sha256"] for s in steps_of(logs, 3)] == [s["param_sha256"] for s in steps]
    else:
        assert "the sharded optimizer state lost elements" in out.stdout + out.stderr
        assert not events_of(logs, "shard_reinit")
        # the give-up checkpoint (after the last committed step) lacks the range: --load refuses it,
        # and the periodic one before it resumes
        assert sorted(p.name for p in ckpt.iterdir() if p.is_dir()) == ["global_step2", "global_step3"]
        refused = run(tmp_path, 2, 1, *EXACT, "--global-batch-size", "16", "--load", str(ckpt), expect=2)
        assert "this checkpoint cannot resume the optimizer" in refused.stdout + refused.stderr
        (ckpt / "latest").write_text("global_step2")
        resumed = run(tmp_path, 2, 1, *EXACT, "--global-batch-size", "16", "--load", str(ckpt), expect=0)
        assert "starting at iteration 2" in resumed.stdout


def test_bf16_keeps_the_fp32_masters_only_in_the_shards(tmp_path, replicated):
    """ds_config "bf16" with stage 1: DeepSpeed steps the bf16 parameters, no whole fp32 copy on
    any rank; the masters are in the held ranges (12 bytes per parameter replicated, 2/3 of it per
    rank at D = 3). Its losses track the fp32 run's (fp32 masters; a bf16 forward); a kill after
    step 3's commit and a rejoin keep the replicas bit-identical and the fault-free bf16 losses
    within the rounding of bf16 gradient accumulation (the covering rank sums its own and the
    adopted micro-batches in bf16, as DeepSpeed's bf16 mode accumulates)."""
    config = tmp_path / "bf16.json"
    config.write_text(json.dumps({"optimizer": {"type": "AdamW", "params": {"betas": [0.9, 0.95], "torch_adam": True}},
                                  "gradient_clipping": 1.0, "bf16": {"enabled": True},
                                  "zero_optimization": {"stage": 1}}))
    free = run(tmp_path, 3, 1, *EXACT, "--deepspeed_config", str(config)).stdout
    line = re.search(r"sharded over 3 replicas \(shard_redundancy=neighbour\): ([0-9.]+) MiB on this rank, "
                     r"replicated ([0-9.]+) MiB \(([0-9,]+) parameters, fp32 masters in the shards\)", free)
    params = int(line.group(3).replace(",", ""))
    assert float(line.group(2)) == pytest.approx(params * 12 / 2**20, abs=0.01)  # masters + moments
    assert float(line.group(1)) == pytest.approx(float(line.group(2)) * 2 / 3, rel=0.02)
    ref, got = replicated[0], losses(free)
    assert got[1] != ref[1]  # the forward runs in bf16
    assert [got[i] for i in range(1, 9)] == pytest.approx([ref[i] for i in range(1, 9)], rel=1e-3)
    logs = tmp_path / "logs"
    killed = run(tmp_path, 3, 1, *EXACT, "--deepspeed_config", str(config), "--mecefo-inject", "kill:1:3:optimizer",
                 "--mecefo-inject", "hold:1:5", "--mecefo-log-dir", str(logs), "--mecefo-log-param-hash",
                 launcher=["--restart-failed-after", "0"]).stdout
    assert "cover 1->2" in killed and "live 3/3" in killed.split("cover 1->2")[-1]
    after = losses(killed)
    assert [after[i] for i in range(1, 5)] == [got[i] for i in range(1, 5)]
    assert [after[i] for i in range(5, 9)] == pytest.approx([got[i] for i in range(5, 9)], rel=5e-4)
    by_step = {}
    for rank in range(3):
        for rec in steps_of(logs, rank):
            by_step.setdefault(rec["step"], set()).add(rec["param_sha256"])
    assert sorted(by_step) == list(range(8)) and all(len(h) == 1 for h in by_step.values())


def test_entering_mecefo_from_a_plain_deepspeed_zero1_checkpoint(tmp_path, replicated):
    """A run in progress enters MeCeFO: the example without --mecefo (plain DeepSpeed, ZeRO stage 1,
    one rank) saves at iteration 4; with --mecefo on 3 replicas it loads DeepSpeed's checkpoint (the
    moments and step counts from the ZeRO partition file into MeCeFO's shards) and goes on through a
    kill at step 6 with the fault-free losses."""
    ckpt = tmp_path / "ckpt"
    plain = run(tmp_path, 1, 1, "--save", str(ckpt), "--save-interval", "4", iters=4).stdout
    assert "MeCeFO" not in plain and (ckpt / "global_step4" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").exists()
    assert_fault_free_losses(plain, replicated, range(1, 5))
    out = run(tmp_path, 3, 1, *EXACT, "--load", str(ckpt), "--mecefo-inject", "kill:1:6").stdout
    assert "starting at iteration 4" in out and "sharded over 3 replicas" in out and "cover 1->2" in out
    assert_fault_free_losses(out, replicated, range(5, 9))
