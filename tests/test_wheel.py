"""The package as a cluster installs it: a wheel built from the tracked files, installed with
--no-deps into a fresh virtual environment that reuses the pinned stack (a .pth line to this
environment's site-packages), run from a directory outside the checkout. The commands, the
version, and mecefo-patch finding its patches in the wheel's own data files, applying the
Megatron-DeepSpeed patch to the upstream snapshot and refusing an unknown version."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

import megatron_mecefo
from megatron_mecefo.testing import mds
from tests.helpers import ROOT

pytestmark = pytest.mark.dist


def _tracked_copy(dest: Path) -> Path:
    """The files a clean clone holds (git ls-files), not the working tree's build leftovers."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    for name in filter(None, (f.decode() for f in files)):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    base = tmp_path_factory.mktemp("wheel")
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout to know the tracked files")
    src = _tracked_copy(base / "src")
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                          str(base / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    (wheel,) = (base / "dist").glob("megatron_mecefo-*.whl")
    env_dir = base / "env"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    out = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q",
                          str(wheel)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "pinned_stack.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")  # torch & co., not this package
    work = base / "elsewhere"  # not the checkout: nothing is found by accident in the current directory
    work.mkdir()
    return wheel, env_dir, work


def _run(env_dir: Path, work: Path, *cmd: str) -> subprocess.CompletedProcess:
    exe = cmd[0] if cmd[0].startswith("/") else str(env_dir / "bin" / cmd[0])
    return subprocess.run([exe, *cmd[1:]], cwd=work, capture_output=True, text=True, timeout=120,
                          env={"PATH": f"{env_dir / 'bin'}:/usr/bin:/bin", "HOME": str(work)})


def test_the_wheel_holds_the_version_license_and_patches(installed):
    wheel, env_dir, work = installed
    assert wheel.name == f"megatron_mecefo-{megatron_mecefo.__version__}-py3-none-any.whl"
    import zipfile

    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.endswith("licenses/LICENSE") for n in names) and any(n.endswith("licenses/NOTICE") for n in names)
    assert sum(n.startswith(f"megatron_mecefo-{megatron_mecefo.__version__}.data/data/share/megatron-mecefo/patches/")
               for n in names) == 4, [n for n in names if ".data/" in n]


def test_the_installed_commands_run_outside_the_checkout(installed):
    _, env_dir, work = installed
    version = megatron_mecefo.__version__
    out = _run(env_dir, work, "python", "-c", "import megatron_mecefo; print(megatron_mecefo.__version__, megatron_mecefo.__file__)")
    assert out.returncode == 0, out.stderr[-2000:]
    got, where = out.stdout.split()
    assert got == version and Path(where).is_relative_to(env_dir), "the wheel's copy, not the checkout's"
    for cmd in ("mecefo-launch", "mecefo-store", "mecefo-patch"):
        out = _run(env_dir, work, cmd, "--version")
        assert out.returncode == 0 and out.stdout.strip() == f"{cmd} {version}", (cmd, out.stdout, out.stderr[-2000:])
        out = _run(env_dir, work, cmd, "--help")
        assert out.returncode == 0 and "usage:" in out.stdout, (cmd, out.stderr[-2000:])


def test_mecefo_patch_uses_the_wheels_patches(installed, tmp_path):
    _, env_dir, work = installed
    out = _run(env_dir, work, "python", "-c", "from megatron_mecefo import patch; print(*patch.patch_folders())")
    assert out.stdout.split() == [str(env_dir / "share" / "megatron-mecefo" / "patches")], out.stdout + out.stderr
    checkout = mds.extract(mds.SNAPSHOT_GLOB, tmp_path / "Megatron-DeepSpeed")
    out = _run(env_dir, work, "mecefo-patch", "apply", str(checkout))
    assert out.returncode == 0 and "patched pretrain_gpt.py" in out.stdout and "4efb479" in out.stdout, out.stderr
    assert "import megatron_mecefo.integrations.megatron_deepspeed as mecefo\n" in (checkout / "pretrain_gpt.py").read_text()
    out = _run(env_dir, work, "mecefo-patch", "check", str(checkout))
    assert out.returncode == 0 and ", patched" in out.stdout
    # bad input, from the wheel too: an unknown version is refused with the supported ones, nothing changed
    other = mds.extract(mds.SNAPSHOT_GLOB, tmp_path / "other")
    hooked = other / "megatron" / "training.py"
    hooked.write_text(hooked.read_text().replace("def train_step(", "def train_step_renamed(", 1))
    before = (other / "pretrain_gpt.py").read_bytes()
    out = _run(env_dir, work, "mecefo-patch", "apply", str(other))
    assert out.returncode == 2 and "unknown version (megatron/training.py differs from 4efb479)" in out.stderr, out.stderr
    assert (other / "pretrain_gpt.py").read_bytes() == before
    out = _run(env_dir, work, "mecefo-patch", "apply", str(tmp_path))
    assert out.returncode == 2 and "Megatron-DeepSpeed 4efb479" in out.stderr and "core_v0.16.1" in out.stderr, out.stderr
