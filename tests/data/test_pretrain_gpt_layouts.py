"""examples/pretrain_gpt with tensor and pipeline parallelism: a failed rank retires its replica, the
neighbour replica covers on every stage, the replica rejoins whole. Real processes, SIGKILL/SIGSTOP."""

import json
import re
import sys

import pytest

from megatron_mecefo.testing import chaos
from megatron_mecefo.testing.chaos import Fault, Schedule
from tests.data.pretrain import spawn_if_refused
from tests.helpers import ROOT, free_port, run_launcher, two_nodes_lose_one

pytestmark = [pytest.mark.dist, pytest.mark.fault]

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "2", "--lr", "1e-3", "--eval-iters", "2", "--normalization", "RMSNorm", "--swiglu",
         "--position-embedding-type", "rope", "--mecefo-rank", "8", "--mecefo-collective-timeout-s", "5",
         "--mecefo-heartbeat-timeout-s", "2", "--mecefo-agree-timeout-s", "20"]
EXACT = ["--no-mecefo-skip-attention", "--no-mecefo-lowrank-ffn", "--mecefo-recompute-ffn", "never"]


def launch(tmp_path, nproc, layout, *args, launcher=(), expect=0, timeout=420):
    cmd = [sys.executable, "-m", "megatron_mecefo.elastic.launch", "--nproc-per-node", str(nproc), "--master-port", "0",
           *launcher, *spawn_if_refused(expect), str(ROOT / "examples/pretrain_gpt/pretrain_gpt.py"),
           "--deepspeed_config", str(ROOT / "examples/pretrain_gpt/ds_config.json"), *MODEL, *layout, *args]
    proc = run_launcher(cmd, timeout)
    assert proc.returncode == expect, proc.stdout[-3000:] + proc.stderr[-4000:]
    return proc


def valid_loss(out):
    return [float(x) for x in re.findall(r"validation loss at iteration \d+ \| lm loss value: (\S+) \|", out)]


def chaos_run(tmp_path, schedule, layout, gbs, *extra, restart_after=None, eval_interval=None):
    """Run `schedule` with MeCeFO on `layout`; the chaos invariants hold per (tp, pp) position: every
    step committed once, on the whole global batch, with bit-identical shards across replicas."""
    launcher = ["--restart-failed-after", str(restart_after)] if restart_after is not None else []
    proc = launch(tmp_path, schedule.world, layout, "--mecefo", "--global-batch-size", str(gbs),
                  "--train-iters", str(schedule.steps), "--eval-interval", str(eval_interval or schedule.steps),
                  "--log-interval", "5", "--mecefo-log-dir", str(tmp_path), "--mecefo-log-param-hash", *extra,
                  *schedule.flags(), launcher=launcher)
    k = gbs // (2 * schedule.grid.dp)
    outcome, bad = chaos.check_run(chaos.RunResult(proc.returncode, 0.0, proc.stdout, proc.stderr), tmp_path, schedule,
                                   k=k, bound_s=1e9)
    assert not bad and outcome == "finished", "\n".join(bad) + proc.stderr[-4000:]
    assert f"validation loss at iteration {schedule.steps}" in proc.stdout
    return proc


def regroups(tmp_path, world):
    return chaos.events(tmp_path, world, "regroup")


@pytest.mark.parametrize("layout, victim, mate, phase", [
    (["--tensor-model-parallel-size", "2"], 2, 3, "forward"),     # replica 1 = ranks 2, 3 (tp 0, 1)
    (["--pipeline-model-parallel-size", "2"], 3, 1, "backward"),  # replica 1 = ranks 1 (stage 0), 3 (stage 1)
    (["--pipeline-model-parallel-size", "2", "--share-embeddings-and-output-weights"], 3, 1, "backward"),
], ids=["tp2", "pp2", "pp2-tied"])
def test_a_killed_rank_retires_its_replica_which_rejoins_whole(tmp_path, layout, victim, mate, phase):
    """D=2: one rank of replica 1 is SIGKILLed mid-step. Its replica mate leaves, replica 0 covers
    replica 1's micro-batches on every stage, both ranks are restarted and replica 1 is admitted
    whole, each rank with the state of its own position. Every step is whole and the shards are
    bit-identical per position before the failure, while covering, and after the rejoin. With every
    approximation off, the fold is exact through the loss, the covering and the rejoin: the
    validation losses are those of plain DeepSpeed + Megatron-Core on the same layout; and so are
    those of --mecefo without a failure (approximations on: no healthy micro-batch runs covered).
    Tied embeddings with P = 2: the first stage's embedding and the last stage's output layer are
    still equal in the checkpoint at the end (their gradients summed inside the replica each step)."""
    grid_args = dict(tp=2) if "--tensor-model-parallel-size" in layout else dict(pp=2)
    tied = "--share-embeddings-and-output-weights" in layout
    common = ["--global-batch-size", "8", "--train-iters", "20", "--eval-interval", "10", "--log-interval", "10"]
    plain = valid_loss(launch(tmp_path / "plain", 4, layout, *common).stdout)
    mecefo = valid_loss(launch(tmp_path / "mecefo", 4, layout, *common, "--mecefo").stdout)
    assert len(plain) == 2 and plain[1] < plain[0]
    assert mecefo == pytest.approx(plain, rel=1e-5)
    # the job holds at step 14 until both ranks of replica 1 are back (whatever a restart takes)
    faults = (Fault("kill", victim, 8, phase), Fault("hold", victim, 14, "forward", 1), Fault("hold", mate, 14, "forward", 1))
    schedule = Schedule(0, 4, 20, faults, 1.0, **grid_args)
    save = ["--save", str(tmp_path / "ckpt")] if tied else []
    # cover "spread": with D = 2 the one survivor runs all of replica 1's micro-batches, as the paper's
    proc = chaos_run(tmp_path, schedule, layout, 8, *EXACT, *save, "--mecefo-cover", "spread", restart_after=1,
                     eval_interval=10)
    assert valid_loss(proc.stdout) == pytest.approx(plain, rel=1e-5)
    if tied:
        import torch

        stages = [torch.load(tmp_path / "ckpt" / "global_step20" / f"mp_rank_0{s}_model_states.pt",
                             weights_only=False)["module"] for s in (0, 1)]
        assert torch.equal(stages[0]["embedding.word_embeddings.weight"], stages[1]["output_layer.weight"])
    assert "cover 1->0" in proc.stdout
    assert f"rank {mate} (pid" in proc.stderr and "incarnation 1" in proc.stderr
    groups = regroups(tmp_path, 4)
    admitted = [e for e in groups if e["joiners"]]
    assert admitted and sorted(admitted[-1]["joiners"]) == sorted([victim, mate]), "replica 1 rejoins whole"
    assert sorted(admitted[-1]["members"]) == [0, 1, 2, 3]
    # while replica 1 was out, only whole replica 0 trained; afterwards all four ranks logged every step
    steps0 = [json.loads(l) for l in (tmp_path / "steps_rank0.jsonl").read_text().splitlines()]
    covering = [s for s in steps0 if s["degraded"]]
    assert covering and all(s["live"] == [0, 1] if grid_args.get("tp") else s["live"] == [0, 2] for s in covering)
    rejoin = admitted[-1]["step"]
    after = [json.loads(l) for l in (tmp_path / f"steps_rank{victim}.jsonl").read_text().splitlines()]
    assert rejoin == 15, "admitted by step 14's commit"
    assert [s["step"] for s in after if s["step"] >= rejoin] == list(range(rejoin, 20))


def test_a_hung_tensor_parallel_rank_retires_its_replica_in_time(tmp_path):
    """D=3 x T=2: rank 2 (replica 1, tp 0) is SIGSTOPped. Its tensor-parallel mate's collective
    times out within collective_timeout_s and it leaves; nobody hangs; with cover "spread" replica
    1's two micro-batches go one to each surviving replica, both ranks of each in the same modes (the
    plan from the costs agreed with the generation), and the two surviving replicas hold
    bit-identical shards per position at every step."""
    schedule = Schedule(0, 6, 30, (Fault("hang", 2, 6, "forward"),), None, tp=2)
    proc = chaos_run(tmp_path, schedule, ["--tensor-model-parallel-size", "2"], 12, "--mecefo-cover", "spread")
    assert "cover 1->0+2" in proc.stdout
    spread = {r: rec["micro_batches"] for r in range(6) for rec in chaos.step_records(tmp_path, 6)[10] if rec["rank"] == r}
    # each survivor approximates its adopted and one own micro-batch (default costs: 2.1 < the paper's 2.2)
    assert spread == {r: [[d, 0, False], [d, 1, True], [1, j, True]]
                      for r, d, j in ((0, 0, 1), (1, 0, 1), (4, 2, 0), (5, 2, 0))}
    assert "rank 2 is stopped (hung) and all others ended: killing it" in proc.stderr
    hung = [e for e in chaos.events(tmp_path, 6, "inject") if e["rank"] == 2][0]
    lost = [e for e in chaos.events(tmp_path, 6, "replica_lost") if e["rank"] == 3]
    assert lost and lost[0]["step"] == 6
    assert lost[0]["time"] - hung["time"] < 5 + 3, "the mate learns within collective_timeout_s"
    later = regroups(tmp_path, 6)
    assert {tuple(e["members"]) for e in later if e["generation"] == 1} == {(0, 1, 4, 5)}


def test_giving_up_writes_every_shard_and_resumes(tmp_path):
    """D=3 x T=2: replica 1 is lost at step 4 (replica 2 covers it), replica 2 at step 8: replica 0
    alone cannot cover two. Both of its ranks write their shard of the step-8 checkpoint, every rank
    ends with exit 3, and --load resumes on what is left: T=2 on one replica (D=3 -> 1), the same
    global batch in 6 micro-batches per step instead of 2."""
    save = tmp_path / "ckpt"
    schedule = Schedule(0, 6, 20, (Fault("kill", 2, 4, "forward"), Fault("kill", 4, 8, "backward")), None, tp=2)
    proc = launch(tmp_path, 6, ["--tensor-model-parallel-size", "2"], "--mecefo", "--global-batch-size", "12",
                  "--train-iters", "20", "--eval-interval", "20", "--mecefo-log-dir", str(tmp_path / "logs"),
                  "--mecefo-log-param-hash", "--save", str(save), *schedule.flags(), expect=3)
    outcome, bad = chaos.check_run(chaos.RunResult(3, 0.0, proc.stdout, proc.stderr), tmp_path / "logs", schedule,
                                   k=2, bound_s=1e9)
    assert not bad and outcome == "gave_up", "\n".join(bad)
    assert "has no healthy neighbour left" in proc.stderr and f"checkpoint of step 8 at {save / 'global_step8'}" in proc.stderr
    assert sorted(f.name for f in (save / "global_step8").glob("mp_rank_*_model_states.pt")) == \
        ["mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"]
    resumed = launch(tmp_path / "resume", 2, ["--tensor-model-parallel-size", "2"], "--mecefo", "--global-batch-size",
                     "12", "--train-iters", "10", "--eval-interval", "10", "--log-interval", "1", "--load", str(save))
    assert " starting at iteration 8" in resumed.stdout and "iteration       10/      10" in resumed.stdout


def test_a_slow_pipeline_stage_makes_its_replica_shed_micro_batches(tmp_path):
    """D = 2 x P = 2: stage 1 of replica 1 (rank 3) six times as slow from step 2 (six, not three: on
    a loaded CPU the sleeping rank is scheduled first, and an injected 3 read near the 1.1 at which a
    rebalanced replica counts as healthy again; docs/testing.md). Every rank of
    both replicas learns the replica's speed (its slowest stage's) and takes the same deal at the
    same step: replica 1 one micro-batch, replica 0 three; the validation loss is the plain run's."""
    args = ["--global-batch-size", "8", "--train-iters", "10", "--eval-interval", "10", "--log-interval", "1"]
    plain = launch(tmp_path / "plain", 4, ["--pipeline-model-parallel-size", "2"], "--mecefo", *args)
    slow = launch(tmp_path, 4, ["--pipeline-model-parallel-size", "2"], "--mecefo", *args, "--mecefo-rebalance",
                  "--mecefo-rebalance-window", "3", "--mecefo-inject", "slow:3:6:2", "--mecefo-log-dir", str(tmp_path))
    assert valid_loss(slow.stdout) == pytest.approx(valid_loss(plain.stdout), rel=1e-5) and valid_loss(plain.stdout)
    plans = [[(e["step"], e["micro_batches"], sorted(e["factors"])) for e in chaos.events(tmp_path, 4, "rebalance")
              if e["rank"] == r] for r in range(4)]
    assert all(p == plans[0] for p in plans), plans
    # A factor is the median of the window's 3 ratios: installed from step 4 once 2 of them are the
    # slow steps 2 and 3 (step 5 if step 1 read below the threshold; on a loaded machine it may not).
    step, deal, slow_replicas = plans[0][-1]
    assert deal == {"0": 3, "1": 1} and slow_replicas == ["1"] and step >= 4, plans[0]


@pytest.mark.parametrize("nproc, extra, message", [
    (4, ["--tensor-model-parallel-size", "3"], "the world of 4 ranks is not divisible by --tensor-model-parallel-size (3)"),
    (2, ["--pipeline-model-parallel-size", "2", "--num-layers", "3"], "--num-layers 3 is not divisible by --pipeline-model-parallel-size 2"),
    (2, ["--tensor-model-parallel-size", "2", "--num-attention-heads", "3"], "--num-attention-heads 3 is not divisible by --tensor-model-parallel-size 2"),
    (2, ["--tensor-model-parallel-size", "2", "--hidden-size", "128", "--ffn-hidden-size", "128", "--mecefo-rank", "100"],
     "mecefo.rank=100 is out of range for FFN weight"),
], ids=["world", "layers", "heads", "rank"])
def test_bad_layouts_stop_before_training(tmp_path, nproc, extra, message):
    proc = launch(tmp_path, nproc, [], "--mecefo", "--global-batch-size", "8", "--train-iters", "4", *extra, expect=2)
    assert message in proc.stderr
    assert "iteration" not in proc.stdout


def test_tensor_parallel_under_the_deepspeed_launcher(tmp_path):
    """`deepspeed --num_gpus 4 pretrain_gpt.py --tensor-model-parallel-size 2 --mecefo`: rank 2 killed
    at step 3 (a real SIGKILL: its keeper absorbs it; its mate leaves with the replica, exit 4, and
    its keeper too): replica 0 finishes every step on the whole global batch and every process
    the launcher started exits 0."""
    from pathlib import Path

    port = free_port()
    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "4", "--master_port", str(port),
           str(ROOT / "examples/pretrain_gpt/pretrain_gpt.py"), "--deepspeed_config",
           str(ROOT / "examples/pretrain_gpt/ds_config.json"), *MODEL, "--tensor-model-parallel-size", "2",
           "--global-batch-size", "8", "--train-iters", "8", "--eval-interval", "8", "--log-interval", "1",
           "--mecefo", "--mecefo-inject", "kill:2:3", "--mecefo-log-dir", str(tmp_path)]
    proc = run_launcher(cmd, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "cover 1->0" in proc.stdout and len(valid_loss(proc.stdout)) == 1
    steps = [json.loads(l) for l in (tmp_path / "steps_rank1.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == list(range(8)) and all(s["samples"] == 8 for s in steps)
    assert all(s["degraded"] for s in steps[3:]) and not any(s["degraded"] for s in steps[:3])


def test_two_launchers_lose_a_node_holding_a_whole_replica(tmp_path):
    """A head-node store (`mecefo-store`) and two launchers over loopback, T=2: node 0 holds replica 0
    (ranks 0, 1: the lowest rank, which decides commits, and the lead that prints), node 1 replica 1
    (ranks 2, 3). Node 0's launcher is SIGKILLed mid-run: its ranks die with it (PR_SET_PDEATHSIG),
    the store lives on, and replica 1 covers replica 0, finishes every step on the whole global batch
    and prints the rest of the record. (The job cannot end before it notices: every step's reduction
    needs replica 0 until it is presumed lost.)"""
    steps = 40
    store, node1 = two_nodes_lose_one(
        tmp_path, [ROOT / "examples/pretrain_gpt/pretrain_gpt.py", "--deepspeed_config",
                   ROOT / "examples/pretrain_gpt/ds_config.json", *MODEL, "--tensor-model-parallel-size", "2",
                   "--global-batch-size", "8", "--train-iters", steps, "--eval-interval", steps, "--log-interval", "10",
                   "--mecefo", "--mecefo-log-dir", tmp_path, "--mecefo-log-param-hash"], victim_node=0, start_s=180,
        finish_s=240)
    out, err = node1.stdout, node1.stderr
    assert node1.returncode == 0, out[-2000:] + err[-3000:]
    schedule = Schedule(0, 4, steps, (), None, tp=2)
    outcome, bad = chaos.check_run(chaos.RunResult(0, 0.0, out, err), tmp_path, schedule, k=2, bound_s=1e9)
    assert not bad and outcome == "finished", "\n".join(bad)
    assert "cover 0->1" in out and f"validation loss at iteration {steps}" in out
    assert store.wait(timeout=30) == 0, "the store ends with its job"
