"""mecefo-launch ends the job when it is told to, and its ranks never outlive it."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_mecefo.testing.chaos_runs import EXACT
from megatron_mecefo.testing.chaos_runs import TOY_SCRIPT

pytestmark = [pytest.mark.dist, pytest.mark.fault]

ROOT = Path(__file__).resolve().parents[2]


def _start(tmp_path, *launcher_args):
    cmd = [sys.executable, "-m", "megatron_mecefo.elastic.launch", "--nproc-per-node", "3", "--master-port", "0",
           "--restart-failed-after", "0.2", *launcher_args, str(TOY_SCRIPT),
           "--out", str(tmp_path), "--steps", "1000", "--step-sleep", "0.05", *EXACT]
    err = open(tmp_path / "launcher.err", "w")
    # spawned ranks under a launcher of its own (not one forked from the session's zygote server)
    env = dict(os.environ, **({"MECEFO_LAUNCHER_SERVER": "0"} if "--no-preload" in launcher_args else {}))
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # training is under way on every rank
        if all((tmp_path / f"steps_rank{r}.jsonl").exists() for r in range(3)):
            break
        time.sleep(0.2)
    else:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError((tmp_path / "launcher.err").read_text())
    pids = [int(p) for p in re.findall(r"started \(pid (\d+)", (tmp_path / "launcher.err").read_text())]
    assert len(pids) == 3
    return proc, pids


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_cancelled_job_ends_every_rank_without_restarts(tmp_path, signum):
    proc, pids = _start(tmp_path)
    os.kill(proc.pid, signum)
    try:
        code = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    err = (tmp_path / "launcher.err").read_text()
    assert code == 128 + signum, err
    assert not any(_alive(p) for p in pids)
    assert "will restart" not in err and err.count("started (pid") == 3, err


# forked from the preloaded parent (the tests' default: MECEFO_PRELOAD=1) or spawned by a launcher
# process of its own (the plain path a user runs)
STARTS = pytest.mark.parametrize("start", [[], ["--no-preload"]], ids=["forked", "spawned"])


@STARTS
def test_a_cancelled_job_with_a_hung_rank_ends(tmp_path, start):
    proc, pids = _start(tmp_path, *start)
    os.kill(pids[1], signal.SIGSTOP)  # a hung rank does not act on SIGTERM
    time.sleep(0.5)
    os.kill(proc.pid, signal.SIGTERM)
    try:
        code = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert code == 128 + signal.SIGTERM
    assert not any(_alive(p) for p in pids)


@STARTS
def test_ranks_die_with_a_killed_launcher(tmp_path, start):
    proc, pids = _start(tmp_path, *start)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = [p for p in pids if _alive(p)]
    for p in alive:
        os.kill(p, signal.SIGKILL)
    assert not alive, "ranks outlived their launcher"
