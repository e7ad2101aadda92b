"""Run a launcher command (mecefo-launch, torchrun, deepspeed) in its own session, as tests and
benchmarks do: on timeout the whole process group is killed, so no rank outlives the run."""

from __future__ import annotations

import subprocess
from pathlib import Path

__all__ = ["run_launcher", "ROOT"]

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
