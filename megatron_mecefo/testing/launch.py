"""Run a launcher command (mecefo-launch, torchrun, deepspeed) in its own session, as tests and
benchmarks do: on timeout the whole process group is killed, so no rank outlives the run."""

from __future__ import annotations

import subprocess
from pathlib import Path

__all__ = ["run_launcher", "free_port", "ROOT"]

ROOT = Path(__file__).resolve().parents[2]
"""The project's source checkout (examples/, the upstream snapshots' default place next to it)."""


def run_launcher(cmd, timeout, *, cwd=ROOT, env=None, merge_output=False) -> subprocess.CompletedProcess:
    """Run a launcher command in its own session; on timeout kill the whole process group.
    `merge_output`: stderr goes into stdout, in order."""
    import os
    import signal

    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT if merge_output else subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"timed out after {timeout} s:\n{out[-4000:]}\n{(err or '')[-4000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def free_port() -> int:
    """A free TCP port for a launcher or store that binds it later (torchrun's and deepspeed's
    --master_port cannot be 0). Drawn below the kernel's ephemeral range: a port the OS hands out
    (port 0) lies inside it, so a parallel test's gloo connection cannot take it between this probe
    and the bind (a port probed with bind(0) could be, and was)."""
    import random
    import socket

    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(20000, max(low, 20001))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # everything below the range is taken: fall back to the OS's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
