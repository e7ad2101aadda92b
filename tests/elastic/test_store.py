"""The job's store: it listens on MASTER_ADDR only, belongs to one job, and a rerun never reads an
earlier job's keys (examples/tiny_gpt started by hand, as under a foreign launcher)."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta

import pytest

from megatron_mecefo.elastic.comm import store as job_store
from megatron_mecefo.errors import JobConflict
from tests.helpers import ROOT, free_port, run_launcher
from megatron_mecefo.testing.chaos_runs import TOY_SCRIPT

pytestmark = pytest.mark.dist


def _listen_address(port: int) -> str:
    """The local address of the listening socket on `port`, from /proc/net/tcp (hex)."""
    for line in open("/proc/net/tcp").read().splitlines()[1:]:
        local, _, state = line.split()[1:4]
        if state == "0A" and int(local.split(":")[1], 16) == port:
            return local.split(":")[0]
    raise AssertionError(f"nothing listens on port {port}")


def test_store_listens_on_the_master_address_only():
    store = job_store.host_store("127.0.0.1", 0, "job-a")
    assert _listen_address(store.port) == "0100007F"  # 127.0.0.1, not 0.0.0.0
    client = job_store.client("127.0.0.1", store.port, timedelta(seconds=5))
    assert job_store.read_job(client, "here")["id"] == "job-a"


def test_a_rank_refuses_another_jobs_store_and_a_second_start():
    store = job_store.host_store("127.0.0.1", 0, "job-a")
    with pytest.raises(JobConflict, match="belongs to another job"):
        job_store.attach("127.0.0.1", store.port, rank=0, incarnation=0, job_id="job-b")
    ns, job = job_store.attach("127.0.0.1", store.port, rank=0, incarnation=0, job_id="job-a")
    ns.set("hb/0", "1")
    assert job == "job-a" and store.check(["mecefo/job-a/hb/0"]) and not store.check(["hb/0"])
    with pytest.raises(JobConflict, match="already started"):
        job_store.attach("127.0.0.1", store.port, rank=0, incarnation=0)
    job_store.attach("127.0.0.1", store.port, rank=0, incarnation=1, job_id="job-a")  # a restart is fine
    ns.set("job/finished", "1")
    with pytest.raises(JobConflict, match="already ended"):  # a first start under a foreign launcher
        job_store.attach("127.0.0.1", store.port, rank=1, incarnation=0)


def test_mecefo_launch_refuses_a_taken_port(tmp_path):
    held = job_store.host_store("127.0.0.1", 0, "old-job")
    cmd = [sys.executable, "-m", "megatron_mecefo.elastic.launch", "--nproc-per-node", "2", "--master-port",
           str(held.port), str(TOY_SCRIPT), "--out", str(tmp_path)]
    proc = run_launcher(cmd, timeout=60)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "held by the store of another MeCeFO job (id old-job" in proc.stderr
    assert "rank 0 started" not in proc.stderr


def test_store_daemon_ends_with_its_launcher():
    watched = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    port = free_port()
    daemon = subprocess.Popen([sys.executable, "-m", "megatron_mecefo.elastic.launch.store_daemon", "--port", str(port),
                               "--job-id", "j", "--watch-pid", str(watched.pid), "--grace", "0"],
                              stdout=subprocess.PIPE, text=True)
    assert daemon.stdout.readline().startswith("ready")
    time.sleep(1.5)
    assert daemon.poll() is None
    watched.kill()
    watched.wait()
    assert daemon.wait(timeout=10) == 0


def _tiny_gpt_by_hand(port, out, *extra, steps=200):
    """Two ranks of examples/tiny_gpt/train.py started without a launcher (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT set by hand): rank 0 hosts the store in a daemon."""
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port))
        for key in ("MECEFO_LAUNCHER", "MECEFO_JOB_ID", "MECEFO_INCARNATION", "MECEFO_MAX_RESTARTS"):
            env.pop(key, None)
        procs.append(subprocess.Popen(
            [sys.executable, str(ROOT / "examples/tiny_gpt/train.py"), "--out", str(out), "--steps", str(steps),
             "--mecefo-heartbeat-timeout-s", "2", *extra],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True))
    return procs


def _steps(out, rank):
    path = out / f"steps_rank{rank}.jsonl"
    return [json.loads(l) for l in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.fault
def test_rerun_on_the_port_of_a_killed_job_refuses_then_trains(tmp_path):
    """The issue's reproducer: both ranks SIGKILLed mid-run, the same command again on the same port.
    Before, the new ranks read the old job's keys and "committed" steps with 0 samples, exit 0."""
    port = free_port()
    first = _tiny_gpt_by_hand(port, tmp_path / "first", "--step-sleep", "0.05")
    deadline = time.monotonic() + 120
    while len(_steps(tmp_path / "first", 0)) < 5:
        assert time.monotonic() < deadline and all(p.poll() is None for p in first), "first run did not train"
        time.sleep(0.2)
    for p in first:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()

    again = _tiny_gpt_by_hand(port, tmp_path / "again", steps=6)
    results = [p.communicate(timeout=120) for p in again]
    assert [p.returncode for p in again] == [2, 2], results
    for _, err in results:
        assert f"port {port}" in err and "--stop" in err, err[-2000:]
    assert not _steps(tmp_path / "again", 0) and not _steps(tmp_path / "again", 1), "nothing trains on a foreign store"

    stop = subprocess.run([sys.executable, "-m", "megatron_mecefo.elastic.launch.store_daemon", "--stop", "--port", str(port)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert stop.returncode == 0, stop.stderr
    deadline = time.monotonic() + 30
    while True:  # the old daemon has let go of the port
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port))
            break
        except OSError:
            assert time.monotonic() < deadline, "the stopped daemon still holds the port"
            time.sleep(0.2)
    third = _tiny_gpt_by_hand(port, tmp_path / "third", steps=6)
    results = [p.communicate(timeout=180) for p in third]
    assert [p.returncode for p in third] == [0, 0], results
    for rank in range(2):
        steps = _steps(tmp_path / "third", rank)
        assert [s["step"] for s in steps] == list(range(6))
        assert all(s["samples"] == 8 and s["loss"] > 0 for s in steps)  # 2 ranks x 2 micro-batches x 2 samples
