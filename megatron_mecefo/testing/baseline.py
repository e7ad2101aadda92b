"""An earlier commit of this project, side by side with the working tree: benchmarks run the same
job from both, interleaved, so the machine's noise hits both alike."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Dict, Iterator

from megatron_mecefo.testing.launch import ROOT

__all__ = ["checkout", "env_for"]


@contextlib.contextmanager
def checkout(commit: str) -> Iterator[Path]:
    """The files of `commit` (git archive) in a temporary directory, removed afterwards."""
    with tempfile.TemporaryDirectory(prefix=f"mecefo-{commit}-") as d:
        archive = Path(d) / "tree.tar"
        subprocess.run(["git", "archive", "--format=tar", "-o", str(archive), commit], cwd=ROOT, check=True)
        tree = Path(d) / "tree"
        with tarfile.open(archive) as tar:
            tar.extractall(tree, filter="data")
        archive.unlink()
        found = subprocess.run([sys.executable, "-c", "import megatron_mecefo; print(megatron_mecefo.__file__)"],
                               cwd=tree, env=env_for(tree), capture_output=True, text=True, check=True).stdout.strip()
        if not Path(found).resolve().is_relative_to(tree.resolve()):
            raise RuntimeError(f"the baseline imports {found}, not its own tree {tree}")
        yield tree


def env_for(tree: Path) -> Dict[str, str]:
    """The environment in which processes import the project from `tree` (ahead of the installed one);
    run them with cwd=tree (`python -m` puts the working directory first)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tree), *filter(None, [env.get("PYTHONPATH")])])
    return env
