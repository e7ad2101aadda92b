"""examples/pretrain_gpt under the user's own launcher (deepspeed, torchrun, by hand) with --mecefo:
each rank's keeper survives a real crash of its training process (SIGKILL from outside, not an
injected exit), records it, restarts the process, and the rank rejoins."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import megatron_mecefo
from megatron_mecefo.testing import mds
from tests.data.pretrain import SMALL, valid_loss
from tests.helpers import ROOT, free_port

pytestmark = [pytest.mark.dist, pytest.mark.fault]

STEPS, HOLD = 16, 10


def _args(log_dir, world, *, rejoin=True, steps=STEPS, ds_config=None):
    """pretrain_gpt with --mecefo; with `rejoin`, keepers restart a crashed rank after 1 s (a flag, or
    the ds_config block when `ds_config` is given) and the job holds at step HOLD until rank 1's
    second incarnation asks to rejoin (whenever the kill lands)."""
    drop = {"--global-batch-size"} | ({"--mecefo-rank"} if ds_config else set())
    small = [a for i, a in enumerate(SMALL) if a not in drop and (i == 0 or SMALL[i - 1] not in drop)]
    args = [str(ROOT / "examples/pretrain_gpt/pretrain_gpt.py"), *small, "--global-batch-size", str(4 * world),
            "--train-iters", str(steps), "--eval-interval", str(steps), "--mecefo", "--mecefo-log-param-hash"]
    if ds_config is not None:
        return args + ["--deepspeed_config", str(ds_config)] + (["--mecefo-inject", f"hold:1:{HOLD}"] if rejoin else [])
    args += ["--mecefo-log-dir", str(log_dir)]
    return args + (["--mecefo-restart-failed-after", "1", "--mecefo-inject", f"hold:1:{HOLD}"] if rejoin else [])


def _child_pid(err: Path, rank: int, deadline: float) -> int:
    """The pid of `rank`'s training process, from its keeper's log line."""
    marker = f"[mecefo-keeper rank {rank}] rank {rank} started (pid "
    while time.monotonic() < deadline:
        for line in err.read_text(errors="replace").splitlines():
            if marker in line and "incarnation 0" in line:
                return int(line.split(marker)[1].split(",")[0])
        time.sleep(0.1)
    raise AssertionError(f"no keeper of rank {rank} started a training process:\n{err.read_text()[-3000:]}")


def run_and_kill(cmds, tmp_path, world, victim=1, env=None, timeout=300):
    """Start `cmds` (one per process group), SIGKILL `victim`'s training process once it has logged 3
    steps, and wait for every command. Returns [(returncode, stdout, stderr)]."""
    procs, outs = [], []
    for i, cmd in enumerate(cmds):
        out, err = tmp_path / f"out{i}.txt", tmp_path / f"err{i}.txt"
        outs.append((out, err))
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **(env[i] if env else {})},
                                      stdout=open(out, "w"), stderr=open(err, "w"), start_new_session=True))
    deadline = time.monotonic() + timeout
    try:
        pid = None
        while pid is None:
            for out, err in outs:
                try:
                    pid = _child_pid(err, victim, time.monotonic() + 0.2)
                    break
                except AssertionError:
                    pass
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "the job did not start"
        steps = tmp_path / "logs" / f"steps_rank{victim}.jsonl"
        while not steps.exists() or len(steps.read_text().splitlines()) < 3:
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "the job did not train"
            time.sleep(0.1)
        os.kill(pid, signal.SIGKILL)  # the training process only, from outside: a real crash
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    return [(p.returncode, out.read_text(), err.read_text()) for p, (out, err) in zip(procs, outs)]


def check_rejoined(tmp_path, results, world, victim=1, async_error_handling="2"):
    """The job finished, every step ran the whole global batch with identical replicas, and the
    killed rank came back (incarnation 1) and trained the steps after HOLD. Every training process
    ran with NCCL's recovery settings (nccl_env.py) from its start: its own environment, recorded
    in its "started" event (`async_error_handling`: the TORCH_NCCL_ASYNC_ERROR_HANDLING expected)."""
    for code, out, err in results:
        assert code == 0, out[-3000:] + err[-4000:]
    stdout = "".join(out for _, out, _ in results)
    stderr = "".join(err for _, _, err in results)
    assert f"validation loss at iteration {STEPS}" in stdout and len(valid_loss(stdout)) == 1
    assert f" mecefo {megatron_mecefo.__version__}: job " in stdout, "the banner names the version"
    assert f"[mecefo-keeper rank {victim}] rank {victim} (pid" in stderr and "killed by SIGKILL" in stderr
    assert f"rank {victim} started (pid" in stderr and "incarnation 1" in stderr
    mds.check_whole_and_identical(tmp_path / "logs", dp=world, k=2, iters=STEPS)
    events = [json.loads(l) for l in (tmp_path / "logs" / f"events_rank{victim}.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "rejoined"] == [HOLD + 1]
    for rank in range(world):
        started = [e for e in map(json.loads, (tmp_path / "logs" / f"events_rank{rank}.jsonl").read_text().splitlines())
                   if e["event"] == "started"]
        assert len(started) == (2 if rank == victim else 1), started
        for e in started:
            assert e["nccl_env"]["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == async_error_handling, e
            assert e["nccl_env"]["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0" and e["nccl_env"]["TORCH_NCCL_RETHROW_CUDA_ERRORS"] == "0"
            assert e["nccl_env"]["NCCL_NVLS_ENABLE"] == "0", e
            # set by the training process from its configuration: collective_timeout_s (the shipped 60)
            assert e["nccl_env"]["TORCH_NCCL_NONBLOCKING_TIMEOUT"] == "60", e


def test_deepspeed_launcher_survives_a_killed_rank_which_rejoins(tmp_path):
    """`deepspeed --num_gpus 3 pretrain_gpt.py --deepspeed_config ds_config.json --mecefo` with the
    shipped config, its "mecefo" block setting the rank, the log directory and
    "restart_failed_after": 1: rank 1's training process is SIGKILLed from outside mid-run.
    DeepSpeed's launcher would end every rank when one exits non-zero; the keeper does not exit, so
    nobody does: the job finishes with every step whole and rank 1 back."""
    cfg = json.loads((ROOT / "examples/pretrain_gpt/ds_config.json").read_text())
    assert cfg["mecefo"]["rank"] == 64
    cfg["mecefo"].update(rank=16, log_dir=str(tmp_path / "logs"), restart_failed_after=1)  # hidden 64 here: r < 64
    (tmp_path / "ds.json").write_text(json.dumps(cfg))
    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "3", "--master_port", str(free_port()),
           *_args(None, 3, ds_config=tmp_path / "ds.json")]
    check_rejoined(tmp_path, run_and_kill([cmd], tmp_path, 3), 3)


def test_torchrun_survives_a_killed_rank_which_rejoins(tmp_path):
    """`torchrun --nproc-per-node 3 pretrain_gpt.py --mecefo ...`: the job uses torchrun's agent store
    (no second store on MASTER_PORT); rank 1's training process is SIGKILLed and rejoins. torchrun's
    agent restarts every worker when one exits non-zero: the keeper does not. torchrun gives its
    workers TORCH_NCCL_ASYNC_ERROR_HANDLING=1 (a survivor torn down on an NCCL error): the keeper
    replaces it with 2."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3", *_args(tmp_path / "logs", 3)]
    results = run_and_kill([cmd], tmp_path, 3)
    check_rejoined(tmp_path, results, 3)
    assert "store on" in results[0][2] and "torchrun-" in results[0][2]


def test_ranks_started_by_hand_survive_a_killed_rank_which_rejoins(tmp_path):
    """Three `python pretrain_gpt.py` processes with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT
    set by hand (as a Slurm script would): rank 0's keeper starts the job's store. The user's own
    TORCH_NCCL_ASYNC_ERROR_HANDLING=3 is kept, and reported as unsafe for recovery."""
    port = str(free_port())
    env = [dict(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="3", MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                TORCH_NCCL_ASYNC_ERROR_HANDLING="3") for r in range(3)]
    cmd = [sys.executable, *_args(tmp_path / "logs", 3)]
    results = run_and_kill([cmd] * 3, tmp_path, 3, env=env)
    check_rejoined(tmp_path, results, 3, async_error_handling="3")
    for rank, (_, _, err) in enumerate(results):
        assert f"[mecefo-keeper rank {rank}] TORCH_NCCL_ASYNC_ERROR_HANDLING=3 is set: MeCeFO cannot recover" in err


def _node_launch(node_rank, world_info, port, args):
    """What DeepSpeed's multi-node runner starts on each node (over pdsh/ssh): its per-node launcher."""
    import base64

    info = base64.urlsafe_b64encode(json.dumps(world_info).encode()).decode()
    return [sys.executable, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={info}", f"--node_rank={node_rank}",
            "--master_addr=127.0.0.1", f"--master_port={port}", *args]


def test_two_nodes_with_an_external_store_lose_node_0(tmp_path):
    """A `mecefo-store` on a head node and two DeepSpeed node launches (2 ranks each) pointed at it
    with --mecefo-store. Node 0's launcher is SIGKILLed with its ranks and keepers once rank 2 has
    trained 3 steps: node 1 covers both lost replicas and finishes every step on the whole batch."""
    store_port, master_port = free_port(), free_port()
    store = subprocess.Popen([sys.executable, "-m", "megatron_mecefo.elastic.launch.store_daemon", "--host", "127.0.0.1",
                              "--port", str(store_port), "--grace", "1"], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert store.stdout.readline().startswith("ready: the store of job")
    args = _args(tmp_path / "logs", 4, rejoin=False, steps=40) + ["--mecefo-store", f"127.0.0.1:{store_port}"]
    world_info = {"node0": [0, 1], "node1": [0, 1]}
    nodes = [subprocess.Popen(_node_launch(i, world_info, master_port, args), cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, start_new_session=True) for i in (0, 1)]
    try:
        deadline = time.monotonic() + 240
        steps = tmp_path / "logs" / "steps_rank2.jsonl"
        while not steps.exists() or len(steps.read_text().splitlines()) < 3:
            assert time.monotonic() < deadline and all(n.poll() is None for n in nodes), "the job did not train"
            time.sleep(0.1)
        os.killpg(nodes[0].pid, signal.SIGKILL)  # node 0: its launcher, keepers and training processes
        out, err = nodes[1].communicate(timeout=240)
    finally:
        for n in nodes:
            if n.poll() is None:
                os.killpg(n.pid, signal.SIGKILL)
    assert nodes[1].returncode == 0, out[-3000:] + err[-4000:]
    assert "validation loss at iteration 40" in out
    records = mds.step_records(tmp_path / "logs")
    assert sorted(records) == list(range(40))
    last = records[39]
    assert sorted(r["rank"] for r in last) == [2, 3] and all(r["samples"] == 16 for r in last)
    assert store.wait(timeout=60) == 0, "the store ends with its job"


def _processes_mentioning(text: str):
    """pids of this machine's processes whose command line contains `text`."""
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if text in (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    found.append(int(d.name))
            except OSError:
                pass
    return found


@pytest.mark.parametrize("launcher", ["deepspeed", "torchrun"])
def test_sigterm_to_the_launcher_leaves_no_process_behind(tmp_path, launcher):
    """A scheduler cancelling the job: SIGTERM to the node's launcher mid-run (DeepSpeed's per-node
    launcher, which `deepspeed` runs on each node; torchrun's agent) ends every keeper, every
    training process and the job's store. (On one node the `deepspeed` runner itself does not
    forward SIGTERM to it: a DeepSpeed property; Ctrl-C and Slurm signal every process anyway.)"""
    port = free_port()
    if launcher == "deepspeed":
        cmd = _node_launch(0, {"localhost": [0, 1]}, port, _args(tmp_path / "logs", 2))
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port),
               *_args(tmp_path / "logs", 2)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "err.txt", "w"))
    mine = str(tmp_path / "logs")
    try:
        deadline = time.monotonic() + 240
        steps = tmp_path / "logs" / "steps_rank1.jsonl"
        while not steps.exists() or len(steps.read_text().splitlines()) < 2:
            assert time.monotonic() < deadline and proc.poll() is None, (tmp_path / "err.txt").read_text()[-3000:]
            time.sleep(0.1)
        assert len(_processes_mentioning(mine)) >= 4, "2 keepers + 2 training processes"
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    deadline = time.monotonic() + 60
    while _processes_mentioning(mine) or _processes_mentioning(f"--port {port} "):
        assert time.monotonic() < deadline, "processes outlived the cancelled job: " + str(
            _processes_mentioning(mine) + _processes_mentioning(f"--port {port} "))
        time.sleep(0.5)
