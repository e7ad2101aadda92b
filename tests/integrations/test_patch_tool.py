"""mecefo-patch on fresh extracts of the upstream snapshots: apply, check, revert (byte for byte),
and the refusals (unknown checkout or version, a locally changed file) that change nothing."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_mecefo import patch
from megatron_mecefo.testing import mds


def _tree(root: Path) -> dict:
    return {str(p.relative_to(root)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mode)
            for p in sorted(root.rglob("*")) if p.is_file()}


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "megatron_mecefo.patch", *map(str, args)], capture_output=True,
                          text=True, cwd=mds.ROOT)


@pytest.fixture
def checkout(tmp_path):
    return mds.extract(mds.SNAPSHOT_GLOB, tmp_path / "Megatron-DeepSpeed")


ROUND_TRIPS = {
    "megatron-deepspeed": (mds.SNAPSHOT_GLOB, "Megatron-DeepSpeed", "4efb479", "megatron_deepspeed"),
    "megatron-lm": ("Megatron-LM-*.tar.gz", "Megatron-LM", "core_v0.16.1", "megatron_lm"),
}


@pytest.mark.parametrize("upstream", sorted(ROUND_TRIPS))
def test_apply_check_revert_round_trip(upstream, tmp_path):
    pattern, name, version, module = ROUND_TRIPS[upstream]
    checkout = mds.extract(pattern, tmp_path / name)
    pristine = _tree(checkout)
    r = _cli("check", checkout)
    assert r.returncode == 1 and "unpatched" in r.stdout and version in r.stdout
    r = _cli("apply", checkout)
    assert r.returncode == 0, r.stderr
    assert "patched pretrain_gpt.py" in r.stdout and version in r.stdout
    text = (checkout / "pretrain_gpt.py").read_text()
    assert f"import megatron_mecefo.integrations.{module} as mecefo\n" in text
    assert "    pretrain = mecefo.install(pretrain)\n" in text
    patched = _tree(checkout)
    changed = {k for k in pristine if patched[k] != pristine[k]}
    assert changed == {"pretrain_gpt.py"}  # one file, two lines
    r = _cli("check", checkout)
    assert r.returncode == 0 and ", patched" in r.stdout
    r = _cli("apply", checkout)  # a second apply changes nothing and says so
    assert r.returncode == 0 and "already patched" in r.stdout
    diff = _cli("diff", checkout).stdout
    assert "+    pretrain = mecefo.install(pretrain)" in diff
    assert len([line for line in diff.splitlines() if line.startswith("+") and not line.startswith("+++")]) == 2
    r = _cli("revert", checkout)
    assert r.returncode == 0 and "restored pretrain_gpt.py" in r.stdout
    assert _tree(checkout) == pristine  # byte for byte, modes included
    r = _cli("revert", checkout)
    assert r.returncode == 0 and "not patched" in r.stdout


def test_a_locally_changed_target_is_refused(checkout):
    target = checkout / "pretrain_gpt.py"
    target.write_text(target.read_text() + "# my change\n")
    before = _tree(checkout)
    for command in ("apply", "check", "revert"):
        r = _cli(command, checkout)
        assert r.returncode == 2, command
        assert "pretrain_gpt.py has local changes" in r.stderr and "nothing was changed" in r.stderr
    assert _tree(checkout) == before


def test_an_unknown_version_is_refused(checkout):
    hooked = checkout / "megatron" / "training.py"
    hooked.write_text(hooked.read_text().replace("def train_step(", "def train_step_renamed(", 1))
    before = _tree(checkout)
    r = _cli("apply", checkout)
    assert r.returncode == 2
    assert "unknown version (megatron/training.py differs from 4efb479)" in r.stderr
    assert _tree(checkout) == before


def test_not_a_known_checkout(tmp_path):
    r = _cli("apply", tmp_path)
    assert r.returncode == 2 and "not a checkout mecefo-patch knows" in r.stderr
    assert "Megatron-DeepSpeed 4efb479" in r.stderr
    r = _cli("check", tmp_path / "missing")
    assert r.returncode == 2 and "not a directory" in r.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_failed_write_leaves_every_file_as_it_was(tmp_path, monkeypatch):
    """All files or none: a two-file patch whose second write fails restores the first."""
    folder = tmp_path / "patches" / "two"
    folder.mkdir(parents=True)
    root = tmp_path / "checkout"
    root.mkdir()
    files = {}
    for name in ("a.py", "b.py"):
        (root / name).write_text("x = 1\n")
        (folder / f"{name}.patch").write_text(f"--- a/{name}\n+++ b/{name}\n@@ -1 +1,2 @@\n x = 1\n+import mecefo\n")
        files[name] = {"patch": f"{name}.patch", "original": hashlib.sha256(b"x = 1\n").hexdigest(),
                       "patched": hashlib.sha256(b"x = 1\nimport mecefo\n").hexdigest()}
    (folder / "manifest.json").write_text(json.dumps({"name": "Two", "repository": "x/two", "version": "1",
                                                      "markers": ["a.py"], "identify": {}, "files": files}))
    monkeypatch.setattr(patch, "patch_folders", lambda: [folder.parent])
    real_replace = os.replace

    def failing_replace(src, dst):
        if str(dst).endswith("b.py"):
            raise PermissionError(13, "Permission denied", str(dst))
        real_replace(src, dst)

    monkeypatch.setattr(patch.os, "replace", failing_replace)
    with pytest.raises(patch.PatchError, match="could not write .*b.py.*nothing was changed"):
        patch.apply(str(root))
    assert (root / "a.py").read_text() == (root / "b.py").read_text() == "x = 1\n"
    assert sorted(p.name for p in root.iterdir()) == ["a.py", "b.py"]
    monkeypatch.setattr(patch.os, "replace", real_replace)
    patch.apply(str(root))
    assert (root / "a.py").read_text() == (root / "b.py").read_text() == "x = 1\nimport mecefo\n"
    assert patch.status(str(root))[1] == patch.PATCHED
