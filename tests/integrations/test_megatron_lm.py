"""Megatron-LM's own pretrain_gpt.py (core_v0.16.1), patched by mecefo-patch, on CPU: the user's flags
plus --mecefo, started by mecefo-launch; ranks really SIGKILLed. Upstream's training loop needs CUDA:
a test-only shim (fake_cuda/) runs its "cuda" tensors on the CPU. Upstream's log lines are the record."""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path

import pytest
import torch

import megatron_mecefo
from megatron_mecefo.testing import mds, mlm

pytestmark = [pytest.mark.dist]

EXACT = ["--attention-dropout", "0", "--hidden-dropout", "0", "--mecefo", "--no-mecefo-skip-attention",
         "--no-mecefo-lowrank-ffn", "--mecefo-recompute-ffn", "never", "--mecefo-log-param-hash"]
NO_DROPOUT = ["--attention-dropout", "0", "--hidden-dropout", "0"]

BF16_LOSS_REL = 5e-5
"""How far a sharded bf16 run's loss may lie from the replicated run's (relative). Where the two
paths part is the gradient norm: upstream's replicated optimizer takes the norm of each whole
tensor's norm, the sharded state sums the squares of its ranges per shard and all-reduces them, so
the clip coefficient differs in its last bits (about 1e-7). Every fp32 master then moves by a
last-bit amount too, and a master that lies that close to a bf16 rounding boundary gives a bf16
parameter one bf16 step (2^-8) away: from there the runs differ as two bf16 runs with different
roundings do, by an amount that depends on the CPU's kernels. Measured side by side on 2026-12-04
(12 iterations; docs/testing.md): the replicated run against itself with --clip-grad one float32
step above 1.0 (the same last-bit change, no sharding) parts at iteration 9 by up to 6.1e-6; the
replicated run with torch's AVX2 kernels against AVX-512 by up to 4.7e-6; sharded against
replicated by up to 7.0e-6 (AVX-512) and 8.6e-6 (AVX2), and 1.4e-5 on an AVX2-only EPYC. 5e-5 is
3.5x the largest; skipping the clip or rounding the masters to bf16 moves the loss by more than
1e-4 from iteration 4 on."""


def test_no_failure_matches_the_unpatched_run(mlm_checkout, tmp_path):
    """Without --mecefo the patched script is upstream's (same losses, bit for bit, under torchrun);
    with --mecefo and no failure, under mecefo-launch, the loss curve, the consumed samples and the
    validation losses are upstream's (up to float summation order)."""
    args = mlm.args(dp=2)
    orig = mlm.torchrun(mlm_checkout, 2, args, script="pretrain_gpt_upstream.py")
    patched = mlm.torchrun(mlm_checkout, 2, args)
    mecefo = mlm.mecefo_launch(mlm_checkout, 2, args + ["--mecefo", "--mecefo-rank", "16"])
    mds.assert_same_run(orig, patched, mecefo)
    assert f"mecefo {megatron_mecefo.__version__}: job" in mecefo.stdout  # the banner names the version


@pytest.mark.fault
def test_kill_is_absorbed_exactly_with_approximations_off(mlm_checkout, tmp_path):
    """Rank 1 is SIGKILLed in the backward of step 4 and not restarted: rank 0 runs both replicas'
    micro-batches from then on (a 2k-micro-batch schedule). With every approximation off and no
    dropout the losses are the fault-free run's."""
    free = mlm.mecefo_launch(mlm_checkout, 2, mlm.args(dp=2, extra=EXACT + ["--mecefo-log-dir", str(tmp_path / "free")]))
    assert free.returncode == 0, free.stdout[-4000:]
    killed = mlm.mecefo_launch(mlm_checkout, 2, mlm.args(dp=2, extra=EXACT + [
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
    assert all(len(r["micro_batches"]) == 4 for s in mds.step_records(tmp_path / "killed").values() for r in s if r["step"] >= 4)


def _exact_3_replicas(mlm_checkout, shared_run):
    """The fault-free exact run on 3 replicas, 12 iterations (replicated state, no overlap): shared."""
    args = mlm.args(dp=3, iters=12, extra=EXACT)
    return shared_run("mlm-exact-dp3", args, lambda: mlm.mecefo_launch(mlm_checkout, 3, args))


@pytest.mark.fault
def test_distributed_optimizer_is_sharded_through_a_kill_a_rejoin_and_a_hang(mlm_checkout, tmp_path, shared_run):
    """`--use-distributed-optimizer` with 3 replicas: the optimizer state is sharded over them, each
    shard also on its covering neighbour. Rank 1 is SIGKILLed after step 4's commit (the others'
    parameter gather fails; its shard's update lives on in rank 2's copy) and restarted: it rejoins
    after step 8 and receives its shard and copy in the re-shard. With the approximations off the
    losses are the replicated fault-free run's and the replicas stay bit-identical. The checkpoint
    of iteration 10 holds the state in upstream's DistributedOptimizer layout; `--load` resumes it on 2 replicas
    with the fault-free run's losses, and refuses it (exit 2) without the flag. The kill runs with
    cover "spread": rank 1's two micro-batches go one to each survivor. A rank hung in the
    gradient reduction (the reduce-scatter) of step 4 is covered with the same losses."""
    free = _exact_3_replicas(mlm_checkout, shared_run)
    assert free.returncode == 0, free.stdout[-4000:]
    ckpt, log_dir = tmp_path / "ckpt", tmp_path / "log"
    sharded = _sharded_kill_and_rejoin(mlm_checkout, EXACT + ["--mecefo-cover", "spread"], ckpt, log_dir)
    ran = {r: rec["micro_batches"] for r in (0, 2) for rec in mds.step_records(log_dir)[6] if rec["rank"] == r}
    assert ran == {0: [[0, 0, False], [0, 1, False], [1, 1, False]], 2: [[2, 0, False], [2, 1, False], [1, 0, False]]}
    assert "optimizer state sharded over 3 replicas (shard_redundancy=neighbour)" in sharded.stdout
    want, got = mds.losses(free.stdout), mds.losses(sharded.stdout)
    assert sorted(got) == sorted(want) == list(range(1, 13))
    for it in want:
        assert got[it] == pytest.approx(want[it], rel=1e-5, abs=1e-6), it
    mds.check_whole_and_identical(log_dir, dp=3, k=2, iters=12)
    assert not list((ckpt / "iter_0000010").glob("mecefo_optim_*"))  # gathered into upstream's layout
    common = torch.load(ckpt / "iter_0000010" / "common.pt", weights_only=False)
    assert common["content_metadata"]["distrib_optim_sharding_type"] == "fully_reshardable"
    (ckpt / "latest_checkpointed_iteration.txt").write_text("10")  # the run also saved its end
    resumed = mlm.mecefo_launch(mlm_checkout, 2, mlm.args(dp=2, micro_batches=3, iters=12, extra=EXACT + [
        "--use-distributed-optimizer", "--load", str(ckpt)]))
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    # every line is what upstream prints after a load (the first does not reset its sums:
    # iteration 12 prints the mean of 11 and 12), from the fault-free run's lines
    mds.assert_lines(resumed.stdout, mds.resumed_lines(mds.log_lines(free.stdout), 10), loss_rel=1e-5)
    refused = mlm.mecefo_launch(mlm_checkout, 1, mlm.args(dp=1, iters=12, extra=["--mecefo", "--load", str(ckpt)]),
                                timeout=120)
    assert refused.returncode == 2, refused.stdout[-3000:]
    assert "was written by Megatron's DistributedOptimizer: resume it with --use-distributed-optimizer" in refused.stdout
    assert "iteration       11/" not in refused.stdout
    hung = mlm.mecefo_launch(mlm_checkout, 3, mlm.args(dp=3, iters=12, extra=EXACT + [
        "--use-distributed-optimizer", "--mecefo-inject", "hang:1:4:allreduce", "--mecefo-collective-timeout-s", "5",
        "--mecefo-agree-timeout-s", "20"]))
    assert hung.returncode == 0, hung.stdout[-4000:]
    assert "generation 1: members [0, 2], cover {1: 2}" in hung.stdout and "rank 1 is stopped (hung)" in hung.stdout
    got = mds.losses(hung.stdout)
    for it in want:
        assert got[it] == pytest.approx(want[it], rel=1e-5, abs=1e-6), it


@pytest.mark.fault
def test_a_slow_replica_sheds_micro_batches_in_upstreams_schedule(mlm_checkout, tmp_path, shared_run):
    """`--mecefo-rebalance` with 3 replicas, rank 1 six times as slow from step 2: after a window
    of 3 steps it runs 1 micro-batch and another replica 3 in upstream's schedule (whose
    micro-batch count follows the plan); the losses are the fault-free run's.

    Six, not three: a step computes for about 10 ms here, and on a CPU shared with another test's
    ranks the slowed rank, asleep most of the step, is scheduled first while the others wait for
    a core. Its factor over the median of 3 replicas read 1.7-2 for an injected 3 (measured with 4
    busy loops beside it), and one preempted neighbour step below the 1.2 threshold restarts the
    window: the CI run of 2026-12-07 ended without a rebalance."""
    free = _exact_3_replicas(mlm_checkout, shared_run)
    assert free.returncode == 0, free.stdout[-4000:]
    log_dir = tmp_path / "log"
    slow = mlm.mecefo_launch(mlm_checkout, 3, mlm.args(dp=3, iters=12, extra=EXACT + [
        "--mecefo-log-dir", str(log_dir), "--mecefo-rebalance", "--mecefo-rebalance-window", "3",
        "--mecefo-inject", "slow:1:6:2"]))
    assert slow.returncode == 0, slow.stdout[-4000:]
    want, got = mds.losses(free.stdout), mds.losses(slow.stdout)
    assert sorted(got) == sorted(want) == list(range(1, 13))
    for it in want:
        assert got[it] == pytest.approx(want[it], rel=1e-5, abs=1e-6), it
    mds.check_whole_and_identical(log_dir, dp=3, k=2, iters=12)
    ran = {rec["rank"]: len(rec["micro_batches"]) for rec in mds.step_records(log_dir)[11]}
    assert ran[1] == 1 and sorted(ran.values()) == [1, 2, 3], ran
    assert "replicas [1] slow (x" in slow.stdout


def _sharded_kill_and_rejoin(checkout, flags, ckpt, log_dir):
    """3 replicas with --use-distributed-optimizer: rank 1 SIGKILLed after step 4's commit,
    restarted, rejoined after step 8; the checkpoint of iteration 10 saved."""
    out = mlm.mecefo_launch(checkout, 3, mlm.args(dp=3, iters=12, extra=flags + [
        "--use-distributed-optimizer", "--mecefo-log-dir", str(log_dir), "--mecefo-inject", "kill:1:4:optimizer",
        "--mecefo-inject", "hold:1:8", "--save", str(ckpt), "--save-interval", "10"]), restart_after=1, timeout=300)
    assert out.returncode == 0, out.stdout[-6000:]
    cover = "{1: [0, 2]}" if "spread" in flags else "{1: 2}"
    assert f"generation 1: members [0, 2], cover {cover}" in out.stdout
    events = [json.loads(line) for line in (log_dir / "events_rank1.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "rejoined"] == [9]
    return out


@pytest.mark.fault
def test_bf16_distributed_optimizer_keeps_the_fp32_masters_only_in_the_shards(mlm_checkout, tmp_path):
    """`--bf16 --use-distributed-optimizer` with 3 replicas: upstream's optimizer holds no fp32 copies
    (the masters live in the held ranges: 2/3 of the replicated 12 bytes per parameter on each
    rank). Its losses are the replicated mixed-precision run's within bf16's rounding of a last-bit
    difference in the gradient norm (BF16_LOSS_REL). A kill after step 4's commit and a rejoin after step 8 give
    the sharded fault-free losses; the checkpoint carries the masters as upstream's fp32 "param", and `--load`
    on 2 replicas continues with them."""
    bf16 = EXACT + ["--bf16"]
    replicated = mlm.mecefo_launch(mlm_checkout, 3, mlm.args(dp=3, iters=12, extra=bf16))
    assert replicated.returncode == 0, replicated.stdout[-4000:]
    free = mlm.mecefo_launch(mlm_checkout, 3, mlm.args(dp=3, iters=12, extra=bf16 + ["--use-distributed-optimizer"]))
    assert free.returncode == 0, free.stdout[-4000:]
    line = re.search(r"sharded over 3 replicas \(shard_redundancy=neighbour\): ([0-9.]+) MiB on this rank, "
                     r"replicated ([0-9.]+) MiB", free.stdout)
    assert line, free.stdout[-4000:]
    assert float(line.group(1)) == pytest.approx(float(line.group(2)) * 2 / 3, rel=0.02)
    params = int(re.search(r"number of parameters on \(tensor, pipeline\) model parallel rank \(0, 0\): (\d+)",
                           free.stdout).group(1))
    assert float(line.group(2)) == pytest.approx(params * 12 / 2**20, abs=0.01)  # masters in the state: 4 + 8 bytes
    want, got = mds.losses(replicated.stdout), mds.losses(free.stdout)
    assert sorted(got) == sorted(want) == list(range(1, 13))
    assert got[1] == want[1]  # before any update: the same bf16 model, the same forward
    for it in want:
        assert got[it] == pytest.approx(want[it], rel=BF16_LOSS_REL), it
    ckpt, log_dir = tmp_path / "ckpt", tmp_path / "log"
    killed = _sharded_kill_and_rejoin(mlm_checkout, bf16, ckpt, log_dir)
    sharded_free, after_kill = got, mds.losses(killed.stdout)
    for it in sharded_free:  # re-sharded over 2 replicas, then 3: other per-shard sums of the norm
        assert after_kill[it] == pytest.approx(sharded_free[it], rel=BF16_LOSS_REL), it
    mds.check_whole_and_identical(log_dir, dp=3, k=2, iters=12)
    from torch.distributed.checkpoint import FileSystemReader

    assert not list((ckpt / "iter_0000010").glob("mecefo_optim_*"))
    stored = FileSystemReader(str(ckpt / "iter_0000010")).read_metadata().state_dict_metadata
    masters = [k for k in stored if k.startswith("optimizer.state.param.")]  # upstream's fp32 main parameters
    assert masters and all(stored[k].properties.dtype == torch.float32 for k in masters)
    assert stored["decoder.final_layernorm.weight"].properties.dtype == torch.bfloat16
    (ckpt / "latest_checkpointed_iteration.txt").write_text("10")
    resumed = mlm.mecefo_launch(mlm_checkout, 2, mlm.args(dp=2, micro_batches=3, iters=12, extra=bf16 + [
        "--use-distributed-optimizer", "--load", str(ckpt)]))
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    assert mds.losses(resumed.stdout)[11] == pytest.approx(sharded_free[11], rel=BF16_LOSS_REL)


@pytest.mark.fault
def test_pipeline_replicas_absorb_a_kill_a_rejoin_and_a_hung_lead(mlm_checkout, tmp_path):
    """P = 2 x D = 2: a replica is its two stages, running upstream's 1F1B schedule inside it. With
    no failure the losses and validation losses are the unpatched run's (to 1e-5).
    The last stage of replica 1 is SIGKILLed in the backward of step 4: its first stage leaves
    (exit 4: its replica's pipeline broke), replica 0 runs both replicas' micro-batches through its
    pipeline, and the restarted replica rejoins after step 8. The lead replica's last stage (the
    rank that prints the losses) hung in step 4: its replica leaves and the other one prints every
    line once. With the approximations off the losses are the fault-free ones throughout."""
    pipeline = ["--pipeline-model-parallel-size", "2"]
    upstream = mlm.upstream_reference(mlm_checkout, 4, mlm.args(dp=2, iters=12, extra=pipeline + [
        "--attention-dropout", "0", "--hidden-dropout", "0"]))
    assert upstream.returncode == 0, upstream.stdout[-4000:]
    free = mlm.mecefo_launch(mlm_checkout, 4, mlm.args(dp=2, iters=12, extra=EXACT + pipeline))
    want = mds.log_lines(upstream.stdout)
    mds.assert_same_run(upstream, upstream, free, iters=12, evals=(5, 10))
    mds.check_pipeline_faults(lambda a, **kw: mlm.mecefo_launch(mlm_checkout, 4, a, **kw),
                              lambda extra: mlm.args(dp=2, iters=12, extra=EXACT + pipeline + extra), want,
                              tmp_path / "log")


@pytest.mark.fault
def test_virtual_pipeline_stages_fold_exactly(mlm_checkout, tmp_path):
    """Upstream's interleaved schedule (P = 3, two virtual stages per rank) × D = 2: every model
    chunk runs the plan's micro-batches in order, each with its own data iterator as upstream's
    train() gives it. The last stage of replica 1 is SIGKILLed in step 4; replica 0 runs 2k
    micro-batches through its interleaved pipeline (cover "spread": with D = 2 the one survivor runs
    everything, as the paper's rule), and the losses stay the unpatched run's.
    (P = 3 with `--no-overlap-p2p-communication`: at P = 2 upstream's interleaved schedule overlaps
    several sends between the same two ranks, which gloo does not keep apart: NaN on CPU without
    MeCeFO too.)"""
    virtual = ["--pipeline-model-parallel-size", "3", "--num-layers", "6", "--num-layers-per-virtual-pipeline-stage",
               "1", "--no-overlap-p2p-communication", "--global-batch-size", "6"]
    upstream = mlm.upstream_reference(mlm_checkout, 6, mlm.args(dp=2, iters=8, extra=[
        "--attention-dropout", "0", "--hidden-dropout", "0"] + virtual))
    assert upstream.returncode == 0, upstream.stdout[-4000:]
    killed = mlm.mecefo_launch(mlm_checkout, 6, mlm.args(dp=2, iters=8, extra=EXACT + virtual + [
        "--mecefo-log-dir", str(tmp_path / "log"), "--mecefo-inject", "kill:5:4", "--mecefo-cover", "spread"]))
    assert killed.returncode == 0, killed.stdout[-6000:]
    assert "generation 1: members [0, 2, 4], cover {1: 0}" in killed.stdout
    want, got = mds.losses(upstream.stdout), mds.losses(killed.stdout)
    assert sorted(got) == sorted(want) == list(range(1, 9))
    for it in want:
        assert got[it] == pytest.approx(want[it], rel=1e-5, abs=1e-6), it
    mds.check_whole_and_identical(tmp_path / "log", dp=2, k=3, iters=8, pp=3)


@pytest.mark.fault
def test_overlapped_reduction_in_upstreams_buckets(mlm_checkout, tmp_path, shared_run):
    """`--overlap-grad-reduce` with small buckets (`--ddp-bucket-size`): upstream's DDP hooks decide
    when a bucket is complete in the last micro-batch's backward, and the runtime's cross-replica
    all-reduce of that bucket starts then. 3 replicas, approximations off: the losses are those of
    the run without overlap, every bucket group of a healthy step after the first is launched
    during the backward; rank 1 SIGKILLed as it launches its first bucket of step 4 fails the step
    like any reduction, and the survivors' losses stay the same, with its micro-batches spread over
    both (cover "spread"; a hang in flight:
    tests/data/test_pretrain_gpt_overlap.py). With the approximations on (3 replicas, rank 2 covering rank 1), the covering rank's
    buckets holding attention weights (whose gradients never arrive) are launched at the end of the
    backward, in the same order as rank 0's, and the run equals the same kill without overlap."""
    overlap = ["--overlap-grad-reduce", "--ddp-bucket-size", "20000"]
    plain = _exact_3_replicas(mlm_checkout, shared_run)
    assert plain.returncode == 0, plain.stdout[-4000:]
    want = mds.losses(plain.stdout)
    log_dir = tmp_path / "log"
    killed = mlm.mecefo_launch(mlm_checkout, 3, mlm.args(dp=3, iters=12, extra=EXACT + overlap + [
        "--mecefo-log-dir", str(log_dir), "--mecefo-inject", "kill:1:4:allreduce", "--mecefo-cover", "spread"]))
    assert killed.returncode == 0, killed.stdout[-6000:]
    assert "generation 1: members [0, 2], cover {1: [0, 2]}" in killed.stdout
    got = mds.losses(killed.stdout)
    assert sorted(got) == list(range(1, 13))
    for it in want:
        assert got[it] == pytest.approx(want[it], rel=1e-5, abs=1e-6), it
    early = {r["step"]: r["overlapped_buckets"] for r in _steps_of(log_dir)}
    assert early[0] == 0 and early[1] >= 2 and all(early[s] == early[1] for s in range(1, 12))
    mds.check_whole_and_identical(log_dir, dp=3, k=2, iters=12)
    approx = ["--mecefo", "--mecefo-rank", "16", "--mecefo-inject", "kill:1:4"]
    folded = mlm.mecefo_launch(mlm_checkout, 3, mlm.args(dp=3, iters=8, extra=approx))
    overlapped = mlm.mecefo_launch(mlm_checkout, 3, mlm.args(dp=3, iters=8, extra=approx + overlap + [
        "--mecefo-log-dir", str(tmp_path / "approx")]))
    assert folded.returncode == 0 and overlapped.returncode == 0, overlapped.stdout[-4000:]
    want, got = mds.losses(folded.stdout), mds.losses(overlapped.stdout)
    assert sorted(got) == sorted(want) == list(range(1, 9))
    for it in want:
        assert got[it] == pytest.approx(want[it], rel=1e-5, abs=1e-6), it
    exact, covering = ({r["step"]: r for r in _steps_of(tmp_path / "approx", rank)} for rank in (0, 2))
    assert all(m[2] for m in covering[5]["micro_batches"][2:])  # rank 2 covers rank 1: approximated
    # on the covering rank the buckets holding attention weights wait for the backward's end, and
    # the later ones with them (every member launches in one order); rank 0 launches all early
    assert exact[5]["overlapped_buckets"] == exact[1]["overlapped_buckets"]
    assert covering[5]["overlapped_buckets"] < covering[1]["overlapped_buckets"]


def _steps_of(log_dir, rank=0):
    return [json.loads(line) for line in (log_dir / f"steps_rank{rank}.jsonl").read_text().splitlines()]


@pytest.mark.fault
def test_torchrun_survives_a_killed_rank_which_rejoins(mlm_checkout, tmp_path):
    """The user's own `torchrun --nproc-per-node 3 pretrain_gpt.py ... --mecefo
    --mecefo-restart-failed-after 1`: rank 1's training process is SIGKILLed at step 4 (under a
    keeper an injected kill is a real SIGKILL). torchrun's agent would restart every worker; the
    keeper records the crash, restarts the process and rank 1 rejoins; every step ran the whole
    global batch and the replicas stayed identical."""
    iters, log_dir = 20, tmp_path / "log"
    out = mlm.torchrun(mlm_checkout, 3, mlm.args(dp=3, iters=iters, extra=[
        "--eval-interval", "1000", "--log-interval", "5", "--mecefo", "--mecefo-rank", "16", "--mecefo-log-dir",
        str(log_dir), "--mecefo-log-param-hash", "--mecefo-restart-failed-after", "1",
        "--mecefo-inject", "kill:1:4", "--mecefo-inject", "hold:1:10"]), timeout=300)
    assert out.returncode == 0, out.stdout[-6000:]
    assert "[mecefo-keeper rank 1] rank 1 (pid" in out.stdout and "killed by SIGKILL" in out.stdout
    assert "rank 1 started (pid" in out.stdout and "incarnation 1" in out.stdout
    events = [json.loads(line) for line in (log_dir / "events_rank1.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "rejoined"] == [11]
    # both incarnations of the patched checkout ran with NCCL's recovery settings, torchrun's 1 replaced
    started = [e["nccl_env"] for e in events if e["event"] == "started"]
    assert len(started) == 2 and all(e["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2" and e["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0"
                                     for e in started), started
    mds.check_whole_and_identical(log_dir, dp=3, k=2, iters=iters)
    assert mds.consumed(out.stdout)[iters] == iters * 6


@pytest.mark.fault
def test_kill_and_rejoin_with_approximations(mlm_checkout, tmp_path):
    """3 replicas; rank 1 is SIGKILLed at step 4 and restarted a second later: its neighbour covers
    with the MeCeFO backward, the restarted rank receives the live state (model, optimizer,
    scheduler, RNG, iteration and sample counters) and the group grows back; every step ran the
    whole global batch, all replicas hold identical parameters at every step, and one replica
    writes upstream's final (torch_dist) checkpoint."""
    iters = 40  # the job holds at step 20 until rank 1 is back (however long its start takes)
    log_dir = tmp_path / "log"
    out = mlm.mecefo_launch(mlm_checkout, 3, mlm.args(dp=3, iters=iters, extra=[
        "--eval-interval", "1000", "--log-interval", "10", "--save", str(tmp_path / "ckpt"), "--save-interval", "1000",
        "--mecefo", "--mecefo-rank", "16", "--mecefo-log-dir", str(log_dir), "--mecefo-log-param-hash",
        "--mecefo-inject", "kill:1:4", "--mecefo-inject", "hold:1:20"]), restart_after=1, timeout=300)
    launcher = "\n".join(line for line in out.stdout.splitlines() if "[mecefo-launch]" in line or "Error" in line)
    assert out.returncode == 0, launcher + "\n" + out.stdout[-6000:]
    events = [json.loads(line) for line in (log_dir / "events_rank1.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "rejoined"] == [21], f"rank 1 did not rejoin:\n{launcher}"
    assert "generation 1: members [0, 2], cover {1: 2}" in out.stdout
    mds.check_whole_and_identical(log_dir, dp=3, k=2, iters=iters)
    assert mds.consumed(out.stdout)[iters] == iters * 6
    losses = mds.losses(out.stdout)
    assert [losses[i] for i in (10, 20, 30, 40)] == sorted(losses[i] for i in (10, 20, 30, 40))[::-1], losses
    assert losses[iters] < losses[10] - 0.1, losses  # it learns through the failure
    tracker = tmp_path / "ckpt" / "latest_checkpointed_iteration.txt"
    assert tracker.read_text().strip() == str(iters)


@pytest.mark.fault
def test_tensor_parallel_replica_retires_and_is_covered(mlm_checkout, tmp_path):
    """TP=2 x DP=2: rank 3 (replica 1, tp rank 1) is SIGKILLed; its tensor-parallel mate leaves too
    (exit 4) and replica 0 runs replica 1's micro-batches with the MeCeFO backward on both of its
    tensor-parallel ranks to the end, projecting each FFN shard's low-rank gradient on the directions
    of that shard's last aggregated gradient (basis "gradient")."""
    iters = 20
    log_dir = tmp_path / "log"
    out = mlm.mecefo_launch(mlm_checkout, 4, mlm.args(dp=2, tp=2, iters=iters, extra=[
        "--eval-interval", "10", "--mecefo", "--mecefo-rank", "16", "--mecefo-log-dir", str(log_dir),
        "--mecefo-log-param-hash", "--mecefo-basis", "gradient", "--mecefo-inject", "kill:3:4", "--mecefo-collective-timeout-s", "20"]), timeout=300)
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
@pytest.mark.parametrize("sharded", [False, True])
def test_give_up_writes_upstream_checkpoint_and_load_resumes(mlm_checkout, tmp_path, sharded):
    """3 replicas, no restarts: rank 1 dies at step 3 (rank 2 covers it), rank 2 at step 6, and
    rank 0 cannot cover both: the job gives up (exit 3) after rank 0 wrote upstream's checkpoint of
    the last committed step. `--load` then resumes there on the one replica left (the same global
    batch in 6 micro-batches per step instead of 2): iteration, consumed samples, the LR. With
    --use-distributed-optimizer rank 0 holds every shard and writes them in upstream's
    DistributedOptimizer layout."""
    ckpt = tmp_path / "ckpt"
    common = ["--save", str(ckpt), "--save-interval", "1000", "--mecefo", "--mecefo-rank", "16"]
    common += ["--use-distributed-optimizer"] if sharded else []
    out = mlm.mecefo_launch(mlm_checkout, 3, mlm.args(dp=3, extra=common + [
        "--mecefo-inject", "kill:1:3", "--mecefo-inject", "kill:2:6"]))
    assert out.returncode == 3, out.stdout[-6000:]
    assert "cannot continue" in out.stdout and "checkpoint of the last committed step written to" in out.stdout
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "6", out.stdout[-6000:]
    if sharded:
        assert not list((ckpt / "iter_0000006").glob("mecefo_optim_*"))
        common_sd = torch.load(ckpt / "iter_0000006" / "common.pt", weights_only=False)
        assert common_sd["content_metadata"]["distrib_optim_sharding_type"] == "fully_reshardable"
    assert sorted(mds.losses(out.stdout)) == list(range(1, 7))
    resumed = mlm.mecefo_launch(mlm_checkout, 1, mlm.args(dp=1, micro_batches=6, extra=common + ["--load", str(ckpt)]))
    assert resumed.returncode == 0, resumed.stdout[-6000:]
    assert sorted(mds.losses(resumed.stdout)) == list(range(7, 11))  # upstream's iteration came back
    assert mds.consumed(resumed.stdout)[7] == 7 * 6  # so did the consumed-sample counter
    lr = {int(m.group(1)): float(m.group(2)) for m in re.finditer(
        r"iteration\s+(\d+)/.*?learning rate: ([0-9.E+-]+)", out.stdout + resumed.stdout)}
    assert lr[7] < lr[6] < lr[3]  # the scheduler went on decaying


def test_refused_setups_end_before_training(mlm_checkout, tmp_path):
    """What MeCeFO cannot run ends with exit 2 and a message naming the flag, before training; so
    does `--load` of a checkpoint upstream's DistributedOptimizer wrote into a job without
    --use-distributed-optimizer (its replicated optimizer cannot take that state), of one of another
    model (upstream's own load error, as a message), and of a mixed-precision checkpoint's fp32
    masters into a sharded --bf16 job (they would be read as the optimizer's own state)."""
    distributed = mlm.upstream_reference(mlm_checkout, 1, mlm.args(dp=1, iters=3, extra=[
        "--use-distributed-optimizer", "--save", str(tmp_path / "ckpt"), "--save-interval", "3"]))
    assert distributed.returncode == 0, distributed.stdout[-3000:]
    mixed = mlm.upstream_reference(mlm_checkout, 1, mlm.args(dp=1, iters=3, extra=[
        "--bf16", "--save", str(tmp_path / "bf16"), "--save-interval", "3"]))
    assert mixed.returncode == 0, mixed.stdout[-3000:]
    base = mlm.args(dp=1, extra=["--mecefo"])
    cases = {
        "--load": ("the checkpoint in " + str(tmp_path / "ckpt") + " was written by Megatron's DistributedOptimizer: "
                   "resume it with --use-distributed-optimizer", base + ["--mecefo-rank", "16", "--load", str(tmp_path / "ckpt")]),
        "--load another model": (f"--load {tmp_path / 'ckpt'}: the checkpoint does not fit this job", base + [
            "--mecefo-rank", "16", "--use-distributed-optimizer", "--ffn-hidden-size", "96", "--load", str(tmp_path / "ckpt")]),
        "--bf16 --load": ("the checkpoint in " + str(tmp_path / "bf16") + " keeps its fp32 master parameters in "
                          "Megatron's mixed-precision optimizer", base + [
            "--mecefo-rank", "16", "--bf16", "--use-distributed-optimizer", "--load", str(tmp_path / "bf16")]),
        "--mecefo-basis gradient": ('mecefo "basis": "gradient" needs every weight\'s aggregated gradient on every rank',
                                    base + ["--mecefo-rank", "16", "--use-distributed-optimizer", "--mecefo-basis", "gradient"]),
        "--overlap-param-gather": ("--mecefo does not support --overlap-param-gather", base + [
            "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]),
        "transformer_engine": ("--mecefo needs --transformer-impl local (got transformer_engine)",
                               [a if a != "local" else "transformer_engine" for a in base]),
    }
    for flag, (message, args) in cases.items():
        out = mlm.mecefo_launch(mlm_checkout, 1, args, timeout=120)
        assert out.returncode == 2, (flag, out.stdout[-3000:])
        assert f"error: {message}" in out.stdout, flag
        assert "iteration        1/" not in out.stdout


@pytest.mark.gpu
def test_gpu_smoke(mlm_checkout, tmp_path):
    """On a machine with CUDA: the patched script with --mecefo on one GPU (NCCL, bf16) for a few
    steps under mecefo-launch, no shim. Skipped without CUDA."""
    import os
    import sys

    import torch

    from tests.helpers import free_port, run_launcher

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    args = [a for a in mlm.args(dp=1, iters=5) if a not in ("--distributed-backend", "gloo")]
    cmd = [sys.executable, "-m", "megatron_mecefo.elastic.launch", "--nproc-per-node", "1", "--master-port",
           str(free_port()), "pretrain_gpt.py", *args, "--bf16", "--mecefo", "--mecefo-rank", "16",
           "--mecefo-log-dir", str(tmp_path / "log")]
    env = dict(mlm.env(), MECEFO_TEST_FAKE_CUDA="0")
    env["PYTHONPATH"] = os.pathsep.join(p for p in env["PYTHONPATH"].split(os.pathsep) if p != str(mlm.FAKE_CUDA))
    out = run_launcher(cmd, 600, cwd=mlm_checkout, env=env, merge_output=True)
    assert out.returncode == 0, out.stdout[-6000:]
    assert sorted(mds.losses(out.stdout)) == list(range(1, 6))
    assert len((Path(tmp_path / "log") / "steps_rank0.jsonl").read_text().splitlines()) == 5


@pytest.mark.fault
@pytest.mark.parametrize("phase", ["forward", "backward", "allreduce", "optimizer"])
def test_the_record_survives_the_lead(mlm_checkout, tmp_path, phase):
    """Megatron-DeepSpeed's scenario on Megatron-LM: the lead (rank 0 of 2 replicas) is killed at
    step 4 in `phase`; the other replica prints what it had not: every iteration and evaluation once."""
    out = mlm.mecefo_launch(mlm_checkout, 2, mlm.args(dp=2, iters=8, extra=[
        "--mecefo", "--mecefo-rank", "16", "--mecefo-inject", f"kill:0:4:{phase}"]))
    mds.assert_recorded_once(out, killed="rank 0: kill at step 4", iters=8, evaluations={5: 1, 8: 2})


def _upstream_saving_at_6(mlm_checkout, shared_run, layout):
    """Upstream's unpatched script on one rank, 12 iterations, saving at 6 (torch_dist; the optimizer
    "replicated", or --use-distributed-optimizer in its "dp_reshardable" or "fully_reshardable"
    layout): (the run, its checkpoint of iteration 6). Shared by the tests that enter from it."""
    flags = {"replicated": [], "dp_reshardable": ["--use-distributed-optimizer"],
             "fully_reshardable": ["--use-distributed-optimizer", "--dist-ckpt-optim-fully-reshardable"]}[layout]
    ckpt = Path(tempfile.mkdtemp(prefix=f"up-{layout}-"))
    args = mlm.args(dp=1, micro_batches=6, iters=12, extra=NO_DROPOUT + flags + [
        "--save", str(ckpt), "--save-interval", "6"])
    run = shared_run(f"mlm-upstream-{layout}-saving-at-6", args, lambda: mlm.upstream_reference(
        mlm_checkout, 1, args, timeout=300))
    assert run.returncode == 0, run.stdout[-4000:]
    ckpt = Path(run.args[run.args.index("--save") + 1])  # the first run's, when shared
    if layout != "replicated":
        assert f"distributed optimizer sharded state of type {layout}" in run.stdout
    (ckpt / "latest_checkpointed_iteration.txt").write_text("6")
    return run, ckpt


@pytest.mark.fault
@pytest.mark.parametrize("layout,faults", [
    ("dp_reshardable", []),
    ("dp_reshardable", ["kill:2:7:backward"]),  # iteration 8: the line that holds two iterations' sum
    ("fully_reshardable", ["kill:1:9"]),  # several iterations later
    ("replicated", ["kill:1:7", "hold:1:8"]),  # restarted: rejoins (after loading --load) for iteration 10
], ids=["dp_reshardable-no-kill", "dp_reshardable-kill-at-8", "fully_reshardable-kill-at-10", "replicated-rejoin"])
def test_entering_mecefo_from_upstreams_checkpoint_logs_upstreams_lines(mlm_checkout, tmp_path, shared_run, layout,
                                                                        faults):
    """A run in progress enters MeCeFO: upstream's unpatched script on one rank saves at iteration 6
    (the optimizer replicated, or --use-distributed-optimizer in either layout); the patched script
    with --mecefo on 3 replicas loads it (model, scheduler, RNG and counters by upstream; a
    distributed optimizer's moments, step counts and fp32 parameters from upstream's layout into
    MeCeFO's shards) and goes on to 12, without a failure or through a kill (with the replicated
    optimizer the killed rank is restarted: it loads --load as upstream does, then takes the live
    state, its scheduler's count included, and rejoins). Every logged line is
    the one upstream logs after the same load (exact mode): loss, grad norm, consumed samples,
    learning rate, skipped and nan counts, and the memory report after the first two iterations.
    Upstream's own lines after a load are its uninterrupted run's except that the first line does
    not reset its sums (iteration 8 prints the mean of 7 and 8): its resume of the replicated
    checkpoint shows it (a resume of its distributed optimizer needs Apex or Transformer Engine)."""
    sharded = layout != "replicated"
    upstream, ckpt = _upstream_saving_at_6(mlm_checkout, shared_run, layout)
    want = mds.resumed_lines(mds.log_lines(upstream.stdout), 6)
    if not sharded:  # upstream's own resume prints exactly these lines
        resumed = mlm.torchrun(mlm_checkout, 1, mlm.args(dp=1, micro_batches=6, iters=12, extra=NO_DROPOUT + [
            "--load", str(ckpt), "--exit-interval", "8"]), script="pretrain_gpt_upstream.py", timeout=300)
        assert resumed.returncode == 0, resumed.stdout[-4000:]
        assert mds.log_lines(resumed.stdout) == {it: want[it] for it in (7, 8)}
        assert mds.memory_reports(resumed.stdout) == [7, 8]
    inject = [a for f in faults for a in ("--mecefo-inject", f)]
    log_dir = tmp_path / "log"
    rejoins = any(f.startswith("hold:") for f in faults)
    entered = mlm.mecefo_launch(mlm_checkout, 3, mlm.args(dp=3, iters=12, extra=EXACT + inject + [
        "--load", str(ckpt), "--mecefo-log-dir", str(log_dir)] + (["--use-distributed-optimizer"] if sharded else [])),
        timeout=300, restart_after=1 if rejoins else None)
    assert entered.returncode == 0, entered.stdout[-4000:]
    if faults:
        victim = int(faults[0].split(":")[1])
        assert f"generation 1: members {sorted({0, 1, 2} - {victim})}" in entered.stdout
    if rejoins:
        events = [json.loads(line) for line in (log_dir / f"events_rank{victim}.jsonl").read_text().splitlines()]
        assert [e["step"] for e in events if e["event"] == "rejoined"] == [9]
    mds.assert_lines(entered.stdout, want)
    assert mds.memory_reports(entered.stdout) == [7, 8]
    mds.check_whole_and_identical(log_dir, dp=3, k=2, iters=12, first=6)  # replicas bit-identical at every step


@pytest.mark.fault
def test_a_lead_killed_after_the_load_rejoins_and_logs_upstreams_lines(mlm_checkout, tmp_path, shared_run):
    """The lead replica (rank 0) is SIGKILLed in the first iteration after entering from upstream's
    distributed-optimizer checkpoint; replica 1 prints its lines; rank 0 is restarted, rejoins and
    leads again. With --log-interval 2 each line is the mean of two iterations, and a restarted
    rank's `train()` starts its sums and flags afresh: it receives the others' with the state (the
    record's Carry), so its lines are upstream's (no line at iteration 9 or a lone iteration's loss
    at 10, no second memory report)."""
    upstream, ckpt = _upstream_saving_at_6(mlm_checkout, shared_run, "fully_reshardable")
    log_dir = tmp_path / "log"
    entered = mlm.mecefo_launch(mlm_checkout, 3, mlm.args(dp=3, iters=12, extra=EXACT + [
        "--use-distributed-optimizer", "--load", str(ckpt), "--log-interval", "2", "--mecefo-log-dir", str(log_dir),
        "--mecefo-inject", "kill:0:6:forward", "--mecefo-inject", "hold:0:8"]), restart_after=1, timeout=300)
    assert entered.returncode == 0, entered.stdout[-6000:]
    assert "generation 1: members [1, 2]" in entered.stdout
    events = [json.loads(line) for line in (log_dir / "events_rank0.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "rejoined"] == [9]
    mds.assert_lines(entered.stdout, mds.resumed_lines(mds.log_lines(upstream.stdout), 6, log_interval=2))
    assert mds.memory_reports(entered.stdout) == [7, 8]


@pytest.mark.fault
def test_leaving_mecefo_writes_upstreams_distributed_optimizer_checkpoint(mlm_checkout, tmp_path):
    """A MeCeFO run with --use-distributed-optimizer on 3 replicas, rank 1 SIGKILLed at step 4,
    saves at iteration 6: the lead replica gathers the shards into upstream's DistributedOptimizer
    layout ("fully_reshardable", in the same torch_dist checkpoint as the model). It holds the keys,
    shapes, step counts and content metadata of upstream's own checkpoint of the same iteration
    (unpatched script, one rank, --dist-ckpt-optim-fully-reshardable), with the same values (exact
    mode), and no MeCeFO file; MeCeFO resumes it on 2 replicas with upstream's losses. (Upstream's
    own resume of a distributed-optimizer checkpoint needs Apex or Transformer Engine: a GPU run
    must confirm it.)"""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    no_dropout = ["--attention-dropout", "0", "--hidden-dropout", "0"]
    up, ours = tmp_path / "upstream", tmp_path / "mecefo"
    upstream = mlm.upstream_reference(mlm_checkout, 1, mlm.args(dp=1, micro_batches=6, iters=12, extra=no_dropout + [
        "--use-distributed-optimizer", "--dist-ckpt-optim-fully-reshardable", "--save", str(up), "--save-interval", "6"]),
        timeout=300)
    assert upstream.returncode == 0, upstream.stdout[-4000:]
    mecefo = mlm.mecefo_launch(mlm_checkout, 3, mlm.args(dp=3, iters=12, extra=EXACT + [
        "--use-distributed-optimizer", "--mecefo-inject", "kill:1:4", "--save", str(ours), "--save-interval", "6"]),
        timeout=300)
    assert mecefo.returncode == 0, mecefo.stdout[-4000:]
    assert "generation 1: members [0, 2]" in mecefo.stdout
    assert not list((ours / "iter_0000006").glob("mecefo_optim_*"))
    state = {}
    for name, ckpt in (("upstream", up), ("mecefo", ours)):
        dcp_to_torch_save(ckpt / "iter_0000006", tmp_path / f"{name}.pt")
        common = torch.load(ckpt / "iter_0000006" / "common.pt", weights_only=False)
        state[name] = (torch.load(tmp_path / f"{name}.pt", weights_only=False), common)
    (want, want_common), (got, got_common) = state["upstream"], state["mecefo"]
    keys = sorted(k for k in want if k.startswith("optimizer."))
    assert keys and keys == sorted(k for k in got if k.startswith("optimizer."))
    assert {k.split(".")[2] for k in keys} == {"param", "exp_avg", "exp_avg_sq"}
    for k in keys:
        assert got[k].shape == want[k].shape and got[k].dtype == want[k].dtype, k
        # float summation order (3 replicas vs 1 rank): near-zero moments move by ~1e-6 of the learning rate
        assert (got[k] - want[k]).norm() <= 1e-3 * want[k].norm(), (k, (got[k] - want[k]).norm() / want[k].norm())
    assert got_common["content_metadata"]["distrib_optim_sharding_type"] == "fully_reshardable"
    assert got_common["optimizer"]["param_state_sharding_type"] == "fully_reshardable"
    groups = [[g["step"], g["wd_mult"]] for g in got_common["optimizer"]["optimizer"]["param_groups"]]
    assert groups == [[g["step"], g["wd_mult"]] for g in want_common["optimizer"]["optimizer"]["param_groups"]]
    assert groups[0][0] == 6
    (ours / "latest_checkpointed_iteration.txt").write_text("6")
    resumed = mlm.mecefo_launch(mlm_checkout, 2, mlm.args(dp=2, micro_batches=3, iters=12, extra=EXACT + [
        "--use-distributed-optimizer", "--load", str(ours)]), timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    mds.assert_lines(resumed.stdout, mds.resumed_lines(mds.log_lines(upstream.stdout), 6))
    assert mds.memory_reports(resumed.stdout) == [7, 8]
