"""What upstream's DeepSpeed processes leave on the machine, cleared by the suite: a torch-extension
build lock a killed process left (it would hang every later upstream run; testing/extensions.py)
and DeepSpeed's CPU all-reduce buffers in /dev/shm (testing/mds.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_mecefo.testing import extensions

pytestmark = pytest.mark.unit


def test_torchs_lock_file_outlives_its_holder(tmp_path):
    """Why the suite cleans up: torch's build lock is a plain file, not a lock the kernel drops when
    its holder dies, so a second loader cannot take it and would wait for it forever."""
    from torch.utils.file_baton import FileBaton

    lock = tmp_path / "lock"
    subprocess.run([sys.executable, "-c", f"import os; os.open({str(lock)!r}, os.O_CREAT | os.O_EXCL); os._exit(9)"],
                   check=False)
    assert lock.exists()
    assert not FileBaton(str(lock)).try_acquire()


def test_a_left_lock_is_removed_and_a_built_op_is_not_built_again(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    op = tmp_path / ".torch-extensions" / extensions.OP
    op.mkdir(parents=True)
    (op / f"{extensions.OP}.so").write_bytes(b"built")
    (op / "lock").touch()
    (tmp_path / ".torch-extensions" / "other_op").mkdir()
    (tmp_path / ".torch-extensions" / "other_op" / "lock").touch()
    monkeypatch.setattr(extensions, "build", lambda *a: pytest.fail("built again"))

    assert extensions.prepare(tmp_path) == tmp_path / ".torch-extensions"
    assert extensions.os.environ["TORCH_EXTENSIONS_DIR"] == str(tmp_path / ".torch-extensions")
    assert not (op / "lock").exists() and not (tmp_path / ".torch-extensions" / "other_op" / "lock").exists()
    assert (op / f"{extensions.OP}.so").read_bytes() == b"built"


def test_an_unbuilt_op_is_built_once_and_a_killed_build_leaves_no_lock(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    calls = []

    def run(cmd, env, timeout, **kw):
        calls.append((cmd[-1], env["TORCH_EXTENSIONS_DIR"], env["DS_ACCELERATOR"]))
        (tmp_path / ".torch-extensions" / extensions.OP).mkdir(parents=True, exist_ok=True)
        (tmp_path / ".torch-extensions" / extensions.OP / "lock").touch()  # the child holds it, then is killed
        raise subprocess.TimeoutExpired(cmd, timeout)

    monkeypatch.setattr(extensions.subprocess, "run", run)
    extensions.prepare(tmp_path)
    assert calls == [(extensions.BUILD, str(tmp_path / ".torch-extensions"), "cpu")]
    assert not (tmp_path / ".torch-extensions" / extensions.OP / "lock").exists()


def test_a_directory_the_user_chose_is_left_alone(tmp_path, monkeypatch):
    mine = tmp_path / "mine"
    (mine / extensions.OP).mkdir(parents=True)
    (mine / extensions.OP / "lock").touch()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(mine))
    monkeypatch.setattr(extensions, "build", lambda *a: pytest.fail("built in the user's directory"))
    assert extensions.prepare(tmp_path) is None
    assert (mine / extensions.OP / "lock").exists()


def test_an_upstream_runs_shared_memory_buffers_are_removed_and_no_others(tmp_path):
    from megatron_mecefo.testing import mds

    uid = os.getuid()
    mine = [Path(f"/dev/shm/deepspeed_allreduce_buffer_{uid}_127.0.0.1_{port}_{rank}") for port, rank in
            ((1, 0), (1, 1))]
    others = [Path(f"/dev/shm/deepspeed_allreduce_buffer_{uid}_127.0.0.1_{port}_0") for port in (11, 21)]
    try:
        for f in mine + others:
            f.write_bytes(b"workspace")
        mds.remove_shm_buffers(1)
        assert [f.exists() for f in mine + others] == [False, False, True, True]
    finally:
        for f in mine + others:
            f.unlink(missing_ok=True)
