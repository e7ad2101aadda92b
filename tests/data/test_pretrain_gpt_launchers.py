"""examples/pretrain_gpt under the user's own launcher (deepspeed, torchrun, by hand) with --mecefo:
each rank's keeper survives a real crash of its training process (SIGKILL from outside, not an
injected exit), records it, restarts the process, and the rank rejoins."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_mecefo.testing import mds
from tests.data.pretrain import SMALL, valid_loss
from tests.helpers import ROOT

pytestmark = [pytest.mark.dist, pytest.mark.fault]

STEPS, HOLD = 16, 10


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _args(log_dir, world):
    drop = {"--global-batch-size"}
    small = [a for i, a in enumerate(SMALL) if a not in drop and (i == 0 or SMALL[i - 1] not in drop)]
    return [str(ROOT / "examples/pretrain_gpt/pretrain_gpt.py"), *small, "--global-batch-size", str(4 * world),
            "--train-iters", str(STEPS), "--eval-interval", str(STEPS), "--mecefo", "--mecefo-log-dir", str(log_dir),
            "--mecefo-log-param-hash", "--mecefo-restart-failed-after", "1", "--mecefo-inject", f"hold:1:{HOLD}"]


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


def check_rejoined(tmp_path, results, world, victim=1):
    """The job finished, every step ran the whole global batch with identical replicas, and the
    killed rank came back (incarnation 1) and trained the steps after HOLD."""
    for code, out, err in results:
        assert code == 0, out[-3000:] + err[-4000:]
    stdout = "".join(out for _, out, _ in results)
    stderr = "".join(err for _, _, err in results)
    assert f"validation loss at iteration {STEPS}" in stdout and len(valid_loss(stdout)) == 1
    assert f"[mecefo-keeper rank {victim}] rank {victim} (pid" in stderr and "killed by SIGKILL" in stderr
    assert f"rank {victim} started (pid" in stderr and "incarnation 1" in stderr
    mds.check_whole_and_identical(tmp_path / "logs", dp=world, k=2, iters=STEPS)
    events = [json.loads(l) for l in (tmp_path / "logs" / f"events_rank{victim}.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "rejoined"] == [HOLD + 1]


def test_deepspeed_launcher_survives_a_killed_rank_which_rejoins(tmp_path):
    """`deepspeed --num_gpus 3 pretrain_gpt.py --mecefo --mecefo-restart-failed-after 1`: rank 1's
    training process is SIGKILLed from outside mid-run. DeepSpeed's launcher would end every rank
    when one exits non-zero; the keeper does not exit, so nobody does."""
    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "3", "--master_port", str(_free_port()),
           *_args(tmp_path / "logs", 3)]
    check_rejoined(tmp_path, run_and_kill([cmd], tmp_path, 3), 3)


def test_torchrun_survives_a_killed_rank_which_rejoins(tmp_path):
    """`torchrun --nproc-per-node 3 pretrain_gpt.py --mecefo ...`: the job uses torchrun's agent store
    (no second store on MASTER_PORT); rank 1's training process is SIGKILLed and rejoins. torchrun's
    agent restarts every worker when one exits non-zero: the keeper does not."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3", *_args(tmp_path / "logs", 3)]
    results = run_and_kill([cmd], tmp_path, 3)
    check_rejoined(tmp_path, results, 3)
    assert "store on" in results[0][2] and "torchrun-" in results[0][2]


def test_ranks_started_by_hand_survive_a_killed_rank_which_rejoins(tmp_path):
    """Three `python pretrain_gpt.py` processes with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT
    set by hand (as a Slurm script would): rank 0's keeper starts the job's store."""
    port = str(_free_port())
    env = [dict(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="3", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
           for r in range(3)]
    cmd = [sys.executable, *_args(tmp_path / "logs", 3)]
    check_rejoined(tmp_path, run_and_kill([cmd] * 3, tmp_path, 3, env=env), 3)
