"""Megatron-DeepSpeed's own pretrain_gpt.py, patched by mecefo-patch, on CPU: the user's flags plus
--mecefo, started by mecefo-launch; ranks really SIGKILLed. Upstream's log lines are the record."""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path

import pytest

from megatron_mecefo.testing import mds

pytestmark = [pytest.mark.dist]


def test_no_failure_matches_the_unpatched_run(mds_checkout, tmp_path):
    """Without --mecefo the patched script is upstream's (same losses, bit for bit); with --mecefo
    and no failure the loss curve and the validation losses are upstream's (float summation order)."""
    root, data = mds_checkout
    args = mds.args(data, tmp_path / "ds.json", dp=2)
    orig = mds.torchrun(root, 2, args, script="pretrain_gpt_upstream.py")
    patched = mds.torchrun(root, 2, args)
    mecefo = mds.mecefo_launch(root, 2, args + ["--mecefo", "--mecefo-rank", "16"])
    mds.assert_same_run(orig, patched, mecefo)


@pytest.mark.fault
def test_kill_is_absorbed_exactly_with_approximations_off(mds_checkout, tmp_path):
    """Rank 1 is SIGKILLed in the backward of step 4 and not restarted: rank 0 runs both replicas'
    micro-batches from then on. With every approximation off (and no dropout: a covering rank draws
    other masks than the failed rank would) the losses are the fault-free run's."""
    root, data = mds_checkout
    exact = ["--attention-dropout", "0", "--hidden-dropout", "0", "--mecefo", "--no-mecefo-skip-attention", "--no-mecefo-lowrank-ffn", "--mecefo-recompute-ffn", "never",
             "--mecefo-log-param-hash"]
    free = mds.mecefo_launch(root, 2, mds.args(data, tmp_path / "ds.json", dp=2,
                                               extra=exact + ["--mecefo-log-dir", str(tmp_path / "free")]))
    assert free.returncode == 0, free.stdout[-4000:]
    killed = mds.mecefo_launch(root, 2, mds.args(data, tmp_path / "ds.json", dp=2, extra=exact + [
        "--mecefo-log-dir", str(tmp_path / "killed"), "--mecefo-inject", "kill:1:4"]))
    assert killed.returncode == 0, killed.stdout[-4000:]
    assert "rank 1 (pid" in killed.stdout and "killed by SIGKILL" in killed.stdout
    assert "generation 1: members [0], cover {1: 0}" in killed.stdout
    want, got = mds.losses(free.stdout), mds.losses(killed.stdout)
    assert sorted(got) == sorted(want) == list(range(1, 11))
    for it in want:
        assert got[it] == pytest.approx(want[it], rel=1e-5, abs=1e-6), it
    assert mds.consumed(killed.stdout)[10] == 10 * 4  # every step consumed the whole global batch
    mds.check_whole_and_identical(tmp_path / "killed", dp=2, k=2, iters=10)


_EXACT_FLAGS = ["--attention-dropout", "0", "--hidden-dropout", "0", "--mecefo", "--no-mecefo-skip-attention",
                "--no-mecefo-lowrank-ffn", "--mecefo-recompute-ffn", "never", "--mecefo-log-param-hash"]


def _exact_3_replicas(root, data, tmp_path, shared_run):
    """The fault-free exact run on 3 replicas, 12 iterations (replicated state, no overlap): shared."""
    args = mds.args(data, tmp_path / "ds-exact3.json", dp=3, iters=12, extra=_EXACT_FLAGS)
    return shared_run("mds-exact-dp3", args, lambda: mds.mecefo_launch(root, 3, args))


@pytest.mark.fault
def test_overlapped_reduction_from_ds_config(mds_checkout, tmp_path, shared_run):
    """ds_config "zero_optimization": {"overlap_comm": true, "reduce_bucket_size": 20000} with 3
    replicas: the runtime's all-reduce runs in buckets during the last micro-batch's backward (all
    of them launched there in a healthy step), rank 1 SIGKILLed as it launches its first bucket of
    step 4, and the losses stay those of the reduction after the backward."""
    root, data = mds_checkout
    plain = _exact_3_replicas(root, data, tmp_path, shared_run)
    assert plain.returncode == 0, plain.stdout[-4000:]
    killed = mds.mecefo_launch(root, 3, mds.args(data, tmp_path / "ds1.json", dp=3, iters=12, overlap_bucket=20000,
                                                 extra=_EXACT_FLAGS + ["--mecefo-log-dir", str(tmp_path / "logs"),
                                                                       "--mecefo-inject", "kill:1:4:allreduce"]))
    assert killed.returncode == 0, killed.stdout[-4000:]
    assert "generation 1: members [0, 2], cover {1: 2}" in killed.stdout
    want, got = mds.losses(plain.stdout), mds.losses(killed.stdout)
    assert sorted(got) == sorted(want) == list(range(1, 13))
    for it in want:
        assert got[it] == pytest.approx(want[it], rel=1e-5, abs=1e-6), it
    records = [json.loads(line) for line in (tmp_path / "logs" / "steps_rank0.jsonl").read_text().splitlines()]
    assert records[0]["overlapped_buckets"] >= 3
    assert all(r["overlapped_buckets"] == records[0]["overlapped_buckets"] for r in records)


@pytest.mark.fault
def test_sharded_optimizer_state_through_a_kill_after_the_commit(mds_checkout, tmp_path, shared_run):
    """ds_config "zero_optimization.stage": 1 with 3 replicas: the optimizer state is sharded over
    them, each shard also on its covering neighbour. Rank 1 is SIGKILLed after step 4's commit
    (the others' parameter gather fails; its shard's update lives on in rank 2's copy), restarted,
    and rejoins after step 8 (it receives its shard and copy in the re-shard). With the
    approximations off the losses are the replicated fault-free run's and the replicas stay
    bit-identical; the checkpoint of iteration 10 holds the state in DeepSpeed's ZeRO file beside
    upstream's files: `--load` resumes it on 2 replicas, and upstream's unpatched script (plain ZeRO-1,
    one rank) leaves MeCeFO with it, both with the fault-free run's losses. With cover "spread" rank 1's
    two micro-batches go one to each survivor (its shard's copy stays on the ring neighbour)."""
    root, data = mds_checkout
    exact = _EXACT_FLAGS
    free = _exact_3_replicas(root, data, tmp_path, shared_run)
    assert free.returncode == 0, free.stdout[-4000:]
    ckpt = tmp_path / "ckpt"
    sharded = mds.mecefo_launch(root, 3, mds.args(data, tmp_path / "ds1.json", dp=3, iters=12, zero_stage=1, extra=exact + [
        "--mecefo-log-dir", str(tmp_path / "logs"), "--mecefo-inject", "kill:1:4:optimizer", "--mecefo-inject",
        "hold:1:8", "--save", str(ckpt), "--save-interval", "10", "--mecefo-cover", "spread"]), restart_after=1, timeout=300)
    assert sharded.returncode == 0, sharded.stdout[-4000:]
    assert "generation 1: members [0, 2], cover {1: [0, 2]}" in sharded.stdout
    ran = {r: rec["micro_batches"] for r in (0, 2) for rec in mds.step_records(tmp_path / "logs")[6] if rec["rank"] == r}
    assert ran == {0: [[0, 0, False], [0, 1, False], [1, 1, False]], 2: [[2, 0, False], [2, 1, False], [1, 0, False]]}
    events = [json.loads(line) for line in (tmp_path / "logs" / "events_rank1.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "rejoined"] == [9]
    want, got = mds.losses(free.stdout), mds.losses(sharded.stdout)
    assert sorted(got) == sorted(want) == list(range(1, 13))
    for it in want:
        assert got[it] == pytest.approx(want[it], rel=1e-5, abs=1e-6), it
    mds.check_whole_and_identical(tmp_path / "logs", dp=3, k=2, iters=12)
    files = sorted(p.name for p in (ckpt / "global_step10").glob("*optim*.pt"))
    assert files == ["zero_pp_rank_0_mp_rank_00_optim_states.pt"], files  # the shards gathered into DeepSpeed's file
    (ckpt / "latest").write_text("global_step10")  # resume from iteration 10 (the run also saved its end)
    resumed = mds.mecefo_launch(root, 2, mds.args(data, tmp_path / "ds2.json", dp=2, micro_batches=3, iters=12,
                                                  zero_stage=1, extra=exact + ["--load", str(ckpt)]))
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    # every line after the load is the fault-free run's; with ZeRO-1 upstream's line also prints
    # DeepSpeed's loss scale (1.0 outside fp16), which the replicated reference (stage 0) has not
    lines = {it: dict(line, **{"loss scale": "1.0"}) for it, line in mds.resumed_lines(
        mds.log_lines(free.stdout), 10, first_line_keeps_sums=False).items()}
    mds.assert_lines(resumed.stdout, lines, loss_rel=1e-5)
    # leaving MeCeFO: upstream's unpatched script, plain DeepSpeed ZeRO-1 on one rank, resumes it
    left = mds.torchrun(root, 1, mds.args(data, tmp_path / "up.json", dp=1, micro_batches=6, iters=12, zero_stage=1,
                                          extra=exact[:4] + ["--load", str(ckpt)]), script="pretrain_gpt_upstream.py")
    assert left.returncode == 0, left.stdout[-4000:]
    mds.assert_lines(left.stdout, lines, loss_rel=1e-5)


@pytest.mark.fault
def test_kill_and_rejoin_with_approximations(mds_checkout, tmp_path):
    """3 replicas; rank 1 is SIGKILLed at step 4 and restarted by mecefo-launch a second later: its
    neighbour covers with the MeCeFO backward, the restarted rank receives the live state (module,
    optimizer, scheduler, iteration and sample counters) and the group grows back; every step ran
    the whole global batch and all replicas hold identical parameters at every step."""
    root, data = mds_checkout
    iters = 40  # the job holds at step 20 until rank 1 is back (however long its start takes)
    log_dir = tmp_path / "log"
    out = mds.mecefo_launch(root, 3, mds.args(data, tmp_path / "ds.json", dp=3, iters=iters, extra=[
        "--eval-interval", "1000", "--log-interval", "10", "--save", str(tmp_path / "ckpt"), "--save-interval", "1000",
        "--mecefo", "--mecefo-rank", "16", "--mecefo-log-dir", str(log_dir), "--mecefo-log-param-hash",
        "--mecefo-inject", "kill:1:4", "--mecefo-inject", "hold:1:20"]), restart_after=1, timeout=300)
    launcher = "\n".join(line for line in out.stdout.splitlines() if "[mecefo-launch]" in line or "Error" in line)
    assert out.returncode == 0, launcher + "\n" + out.stdout[-6000:]
    events = [json.loads(line) for line in (log_dir / "events_rank1.jsonl").read_text().splitlines()]
    rejoined = [e for e in events if e["event"] == "rejoined"]
    assert [e["step"] for e in rejoined] == [21], f"rank 1 did not rejoin after step 20:\n{out.stdout[-6000:]}"
    assert "generation 1: members [0, 2], cover {1: 2}" in out.stdout
    mds.check_whole_and_identical(log_dir, dp=3, k=2, iters=iters)
    assert mds.consumed(out.stdout)[iters] == iters * 6
    losses = mds.losses(out.stdout)
    assert [losses[i] for i in (10, 20, 30, 40)] == sorted(losses[i] for i in (10, 20, 30, 40))[::-1], losses
    assert losses[iters] < losses[10] - 0.1, losses  # it learns through the failure
    # one replica wrote upstream's final checkpoint
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == str(iters)


@pytest.mark.fault
def test_tensor_parallel_replica_retires_and_is_covered(mds_checkout, tmp_path):
    """TP=2 x DP=2: rank 3 (replica 1, tp rank 1) is SIGKILLed; its tensor-parallel mate leaves too
    (exit 4) and replica 0 runs replica 1's micro-batches with the MeCeFO backward on both of its
    tensor-parallel ranks to the end, projecting each FFN shard's low-rank gradient on the directions
    of that shard's last aggregated gradient (basis "gradient"). (A rejoin after a restart is the
    3-replica test's; with tensor parallelism it is tested on examples/pretrain_gpt, whose runtime this is.)"""
    root, data = mds_checkout
    iters = 20
    log_dir = tmp_path / "log"
    out = mds.mecefo_launch(root, 4, mds.args(data, tmp_path / "ds.json", dp=2, tp=2, iters=iters, extra=[
        "--eval-interval", "10", "--mecefo", "--mecefo-rank", "16", "--mecefo-log-dir", str(log_dir),
        "--mecefo-log-param-hash", "--mecefo-basis", "gradient", "--mecefo-inject", "kill:3:4"]), timeout=300)
    assert out.returncode == 0, out.stdout[-6000:]
    assert "rank 2 (pid" in out.stdout and "exit code 4" in out.stdout
    assert "generation 1: members [0, 1], cover {1: 0}" in out.stdout
    mds.check_whole_and_identical(log_dir, dp=2, k=2, iters=iters, tp=2)
    assert all(s["step"] < 4 or s["rank"] in (0, 1) for r in mds.step_records(log_dir).values() for s in r)
    assert mds.consumed(out.stdout)[iters] == iters * 4
    assert sorted(mds.val_losses(out.stdout)) == [10, 20]
    for rank in (0, 1):  # every FFN linear of the covering replica's shards followed its gradient from step 0
        events = [json.loads(line) for line in (log_dir / f"events_rank{rank}.jsonl").read_text().splitlines()]
        assert [(e["step"], e["weights"]) for e in events if e["event"] == "gradient_basis"] == [(0, 4)], rank


@pytest.mark.fault
def test_give_up_writes_upstream_checkpoint_and_load_resumes(mds_checkout, tmp_path):
    """3 replicas, no restarts: rank 1 dies at step 3 (rank 2 covers it), rank 2 at step 6, and
    rank 0 cannot cover both: the job gives up (exit 3) after rank 0 wrote upstream's checkpoint of
    the last committed step. `--load` then resumes there on the one replica left (the same global
    batch in 6 micro-batches per step instead of 2): iteration, consumed samples, the scheduler."""
    root, data = mds_checkout
    ckpt = tmp_path / "ckpt"
    common = ["--save", str(ckpt), "--save-interval", "1000", "--mecefo", "--mecefo-rank", "16"]
    out = mds.mecefo_launch(root, 3, mds.args(data, tmp_path / "ds.json", dp=3, iters=10, extra=common + [
        "--mecefo-inject", "kill:1:3", "--mecefo-inject", "kill:2:6"]))
    assert out.returncode == 3, out.stdout[-6000:]
    assert "cannot continue" in out.stdout and "checkpoint of the last committed step written to" in out.stdout
    assert (ckpt / "latest").read_text().strip() == "global_step6", out.stdout[-6000:]
    before = mds.losses(out.stdout)
    assert sorted(before) == list(range(1, 7))
    resumed = mds.mecefo_launch(root, 1, mds.args(data, tmp_path / "ds.json", dp=1, micro_batches=6, iters=10,
                                                  extra=common + ["--load", str(ckpt)]))
    assert resumed.returncode == 0, resumed.stdout[-6000:]
    after = mds.losses(resumed.stdout)
    assert sorted(after) == list(range(7, 11))  # upstream's iteration came back from the checkpoint
    assert mds.consumed(resumed.stdout)[7] == 7 * 6  # so did the consumed-sample counter
    assert "successfully loaded checkpoint from" in resumed.stdout and "at iteration 6" in resumed.stdout
    lr = {int(m.group(1)): float(m.group(2)) for m in re.finditer(
        r"iteration\s+(\d+)/.*?learning rate: ([0-9.E+-]+)", out.stdout + resumed.stdout)}
    assert lr[7] < lr[6] < lr[3]  # the scheduler went on decaying (a fresh one would warm up from 5e-4)


def test_refused_setups_end_before_training(mds_checkout, tmp_path):
    """What MeCeFO cannot run ends with exit 2 and a message naming the flag, before training:
    a virtual pipeline, and ZeRO stage 2 (which shards the gradients too)."""
    root, data = mds_checkout
    args = mds.args(data, tmp_path / "ds.json", dp=1, extra=["--mecefo"])
    virtual = [a for a in mds.resize(args, layers=3, hidden=64, seq=64) if a != "--no-pipeline-parallel"]
    pipe = mds.mecefo_launch(root, 3, virtual + ["--pipeline-model-parallel-size", "3",
                                                 "--num-layers-per-virtual-pipeline-stage", "1"], timeout=120)
    assert pipe.returncode == 2, pipe.stdout[-3000:]
    assert "error: --mecefo does not support a virtual pipeline" in pipe.stdout
    config = json.loads((tmp_path / "ds.json").read_text())
    config["zero_optimization"]["stage"] = 2
    (tmp_path / "ds.json").write_text(json.dumps(config))
    zero = mds.mecefo_launch(root, 1, args, timeout=120)
    assert zero.returncode == 2, zero.stdout[-3000:]
    assert 'error: ds_config "zero_optimization.stage"=2 is not supported with MeCeFO' in zero.stdout
    assert "iteration        1/" not in pipe.stdout + zero.stdout


@pytest.mark.fault
@pytest.mark.parametrize("phase", ["forward", "backward", "allreduce", "optimizer"])
def test_the_record_survives_the_lead(mds_checkout, tmp_path, phase):
    """2 replicas; rank 0, the lead (its replica prints, evaluates and saves for the job), is
    SIGKILLed at step 4 in `phase` and not restarted. In "optimizer" it dies after step 4 was
    committed and before it printed iteration 5 and its evaluation: the next lead prints them.
    Every iteration is logged once and every evaluation once, as in a run without a failure."""
    root, data = mds_checkout
    extra = ["--mecefo", "--mecefo-rank", "16"]
    out = mds.mecefo_launch(root, 2, mds.args(data, tmp_path / "ds.json", dp=2, iters=8,
                                              extra=extra + ["--mecefo-inject", f"kill:0:4:{phase}"]))
    mds.assert_recorded_once(out, killed="rank 0: kill at step 4", iters=8, evaluations={5: 1, 8: 2})


def _pipeline_engine_args(data, tmp_path, extra, zero_stage=0):
    """DeepSpeed's pipeline engine at P = 2 x D = 2, 12 iterations."""
    flags = mds.args(data, tmp_path / "ds.json", dp=2, iters=12, extra=extra, zero_stage=zero_stage)
    return [a for a in flags if a != "--no-pipeline-parallel"] + ["--pipeline-model-parallel-size", "2"]


_NO_DROPOUT = ["--attention-dropout", "0", "--hidden-dropout", "0"]


def _upstream_pipeline_run(root, data, tmp_path, shared_run):
    """The unpatched script's fault-free run of that pipeline (ZeRO stage 0): shared."""
    args = _pipeline_engine_args(data, tmp_path, _NO_DROPOUT)
    return shared_run("mds-upstream-pipeline", args, lambda: mds.upstream_reference(root, 4, args))


_EXACT = _NO_DROPOUT + ["--mecefo", "--no-mecefo-skip-attention", "--no-mecefo-lowrank-ffn",
                        "--mecefo-recompute-ffn", "never", "--mecefo-log-param-hash"]


@pytest.mark.fault
def test_pipeline_engine_runs_a_rebalanced_plan(mds_checkout, tmp_path, shared_run):
    """P = 2 x D = 2 in DeepSpeed's pipeline engine, the last stage of replica 1 (rank 3) six times
    as slow from step 2 (six: see test_megatron_lm.py's slow-replica test): both stages of both
    replicas take the same deal (replica 1 one micro-batch, replica 0 three) and the log lines are
    the unpatched run's."""
    root, data = mds_checkout
    upstream = _upstream_pipeline_run(root, data, tmp_path, shared_run)
    log_dir = tmp_path / "log"
    slow = mds.mecefo_launch(root, 4, _pipeline_engine_args(data, tmp_path, _EXACT + [
        "--mecefo-log-dir", str(log_dir), "--mecefo-rebalance", "--mecefo-rebalance-window", "3",
        "--mecefo-inject", "slow:3:6:2"]))
    mds.assert_same_run(upstream, upstream, slow, iters=12, evals=(5, 10))
    mds.check_whole_and_identical(log_dir, dp=2, k=2, iters=12, pp=2)
    ran = {rec["rank"]: len(rec["micro_batches"]) for rec in mds.step_records(log_dir)[11]}
    assert ran == {0: 3, 1: 1, 2: 3, 3: 1}, ran


@pytest.mark.fault
@pytest.mark.timeout(600)  # four 4-rank jobs in a row, each bounded by its own launcher timeout
def test_pipeline_engine_absorbs_a_kill_a_rejoin_and_a_hung_lead(mds_checkout, tmp_path, shared_run):
    """DeepSpeed's pipeline engine (GPTModelPipe, tied embeddings), P = 2 x D = 2: a replica is its
    two stages, and the engine's own schedule runs the plan's micro-batches inside it. With no
    failure the losses and validation losses are the unpatched run's (to 1e-5). The
    last stage of replica 1 is SIGKILLed in the backward of step 4: its first stage leaves (exit 4),
    replica 0 runs both replicas' micro-batches through its pipeline, and the restarted replica
    rejoins after step 8. The lead's last stage (the rank that prints the losses) hangs in step 4:
    its replica leaves and the other one prints every line once. With the approximations off the
    losses are the fault-free ones throughout."""
    root, data = mds_checkout
    upstream = _upstream_pipeline_run(root, data, tmp_path, shared_run)
    free = mds.mecefo_launch(root, 4, _pipeline_engine_args(data, tmp_path, _EXACT))
    mds.assert_same_run(upstream, upstream, free, iters=12, evals=(5, 10))
    mds.check_pipeline_faults(lambda a, **kw: mds.mecefo_launch(root, 4, a, **kw),
                              lambda extra: _pipeline_engine_args(data, tmp_path, _EXACT + extra),
                              mds.log_lines(upstream.stdout), tmp_path / "log")


@pytest.mark.fault
def test_pipeline_engine_zero1_state_through_a_kill_after_the_commit(mds_checkout, tmp_path, shared_run):
    """The same pipeline with ds_config stage 1 (the optimizer state sharded over the replicas per
    stage) and cover "spread" (with D = 2 the one survivor runs everything, as the paper's rule):
    the last stage of replica 1 killed after step 4's commit; the losses are the unpatched run's,
    and every step's records hold the whole global batch on identical stages."""
    root, data = mds_checkout
    upstream = _upstream_pipeline_run(root, data, tmp_path, shared_run)
    sharded = mds.mecefo_launch(root, 4, _pipeline_engine_args(
        data, tmp_path, _EXACT + ["--mecefo-log-dir", str(tmp_path / "sharded"), "--mecefo-inject", "kill:3:4:optimizer",
                                  "--mecefo-cover", "spread"],
        zero_stage=1))
    # with ZeRO-1 upstream's line also prints DeepSpeed's loss scale (1.0 outside fp16)
    mds.assert_losses(sharded, {it: dict(line, **{"loss scale": "1.0"})
                                for it, line in mds.log_lines(upstream.stdout).items()}, 12)
    assert "generation 1: members [0, 2], cover {1: 0}" in sharded.stdout
    mds.check_whole_and_identical(tmp_path / "sharded", dp=2, k=2, iters=12, pp=2)


@pytest.mark.fault
def test_pipeline_engine_last_replica_hung_gives_up_in_time(mds_checkout, tmp_path):
    """P = 2 x D = 2, no restarts: replica 0 is lost at step 3, then the last stage of replica 1 (the
    only one left) hangs in its backward. Its first stage waits on it in DeepSpeed's pipeline
    send/receive and fails within the collective timeout (not the start-up timeout of the default
    group): the job gives up cleanly (exit 3) in seconds. Found by the chaos harness (seed 2006)."""
    root, data = mds_checkout
    flags = mds.args(data, tmp_path / "ds.json", dp=2, iters=12, extra=[
        "--mecefo", "--mecefo-rank", "16", "--mecefo-collective-timeout-s", "5", "--mecefo-heartbeat-timeout-s", "2",
        "--mecefo-agree-timeout-s", "20", "--mecefo-inject", "kill:0:3", "--mecefo-inject", "hang:3:6:backward"])
    flags = [a for a in flags if a != "--no-pipeline-parallel"] + ["--pipeline-model-parallel-size", "2"]
    out = mds.mecefo_launch(root, 4, flags, timeout=240)  # the join timeout (600 s) would outlast it
    assert out.returncode == 3, out.stdout[-4000:]
    assert "rank 1 (pid" in out.stdout and "ended: exit code 4" in out.stdout
    assert "the job gave up: no rank of the job is left running" in out.stdout


def _upstream_zero1_saving_at_6(root, data, tmp_path, shared_run):
    """Upstream's unpatched script with ds_config ZeRO stage 1 on one rank, 12 iterations, saving at
    6: (the run, its checkpoint of iteration 6). Shared by the tests that enter from it."""
    ckpt = Path(tempfile.mkdtemp(prefix="up-zero1-"))
    args = mds.args(data, tmp_path / "up.json", dp=1, micro_batches=6, iters=12, zero_stage=1, extra=[
        "--attention-dropout", "0", "--hidden-dropout", "0", "--save", str(ckpt), "--save-interval", "6"])
    run = shared_run("mds-upstream-zero1-saving-at-6", args, lambda: mds.upstream_reference(root, 1, args, timeout=300))
    assert run.returncode == 0, run.stdout[-4000:]
    ckpt = Path(run.args[run.args.index("--save") + 1])  # the first run's, when shared
    assert (ckpt / "global_step6" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").exists()
    (ckpt / "latest").write_text("global_step6")
    (ckpt / "latest_checkpointed_iteration.txt").write_text("6")
    return run, ckpt


@pytest.mark.fault
def test_entering_mecefo_from_upstreams_zero1_checkpoint(mds_checkout, tmp_path, shared_run):
    """A run in progress enters MeCeFO: upstream's unpatched script with ds_config ZeRO stage 1 on
    one rank saves at iteration 6; the patched script with --mecefo on 3 replicas loads it (model,
    scheduler, counters by DeepSpeed; the moments and step counts from DeepSpeed's ZeRO partition
    file into MeCeFO's shards) and goes on to 12 through a kill in the first iteration after the
    load. Every logged line is upstream's uninterrupted run's (exact mode): loss, grad norm, consumed
    samples and tokens, learning rate, skipped and nan counts (Megatron-DeepSpeed's first line after
    a load is an ordinary one), and memory is reported once after the load, as upstream's resume
    does. A ZeRO checkpoint of another model ends with exit 2 and a message, before training."""
    root, data = mds_checkout
    upstream, ckpt = _upstream_zero1_saving_at_6(root, data, tmp_path, shared_run)
    entered = mds.mecefo_launch(root, 3, mds.args(data, tmp_path / "ds1.json", dp=3, iters=12, zero_stage=1, extra=_EXACT_FLAGS + [
        "--load", str(ckpt), "--mecefo-inject", "kill:1:6:backward"]), timeout=300)
    assert entered.returncode == 0, entered.stdout[-4000:]
    assert "generation 1: members [0, 2]" in entered.stdout
    mds.assert_lines(entered.stdout, mds.resumed_lines(mds.log_lines(upstream.stdout), 6, first_line_keeps_sums=False))
    assert mds.memory_reports(entered.stdout) == [7]
    other = mds.mecefo_launch(root, 3, mds.args(data, tmp_path / "ds3.json", dp=3, iters=12, zero_stage=1, extra=_EXACT_FLAGS + [
        "--ffn-hidden-size", "96", "--load", str(ckpt)]), timeout=120)
    assert other.returncode == 2, other.stdout[-3000:]
    assert f"error: --load {ckpt}: the checkpoint is of another model" in other.stdout
    assert "Traceback" not in other.stdout and "iteration        7/" not in other.stdout


@pytest.mark.fault
def test_a_lead_killed_after_the_load_rejoins_and_logs_upstreams_lines(mds_checkout, tmp_path, shared_run):
    """The lead replica (rank 0) is SIGKILLed in the first iteration after entering from upstream's
    ZeRO-1 checkpoint; replica 1 prints its lines; rank 0 is restarted, rejoins and leads again.
    With --log-interval 2 each line is the mean of two iterations: the restarted rank receives the
    others' sums and memory flag with the state (the record's Carry), so its lines are upstream's
    and memory is reported once."""
    root, data = mds_checkout
    upstream, ckpt = _upstream_zero1_saving_at_6(root, data, tmp_path, shared_run)
    log_dir = tmp_path / "log"
    entered = mds.mecefo_launch(root, 3, mds.args(data, tmp_path / "ds.json", dp=3, iters=12, zero_stage=1, extra=_EXACT_FLAGS + [
        "--load", str(ckpt), "--log-interval", "2", "--mecefo-log-dir", str(log_dir),
        "--mecefo-inject", "kill:0:6:forward", "--mecefo-inject", "hold:0:8"]), restart_after=1, timeout=300)
    assert entered.returncode == 0, entered.stdout[-6000:]
    assert "generation 1: members [1, 2]" in entered.stdout
    events = [json.loads(line) for line in (log_dir / "events_rank0.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "rejoined"] == [9]
    mds.assert_lines(entered.stdout, mds.resumed_lines(mds.log_lines(upstream.stdout), 6, log_interval=2,
                                                       first_line_keeps_sums=False))
    assert mds.memory_reports(entered.stdout) == [8]
