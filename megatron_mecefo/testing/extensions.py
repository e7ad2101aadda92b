"""The suite's own directory for torch's JIT-built extensions: DeepSpeed's CPU shared-memory op,
which every upstream DeepSpeed process on CPU loads at start (MeCeFO's runs skip it).

torch serialises a JIT build with a lock *file* (torch.utils.file_baton.FileBaton) and takes it on
every load, since it re-runs ninja each time. A process killed while it holds the file (a test's
timeout, an ended session) leaves it behind, and every later load waits for it forever: in the
shared ~/.cache/torch_extensions that hangs every upstream Megatron-DeepSpeed run on the machine,
other checkouts' included. So the suite keeps its own directory in the checkout, removes a lock
left there before any test starts (no process of this checkout's suite runs then; two suites in
one checkout at once are not supported), and builds the op once before the workers start, so no
test pays a build of a minute or more within its own timeout."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import List, Optional

__all__ = ["prepare"]

OP = "deepspeed_shm_comm"
BUILD = "from deepspeed.comm.torch import build_shm_op; build_shm_op()"


def prepare(root: Path, *, build_timeout_s: float = 900.0) -> Optional[Path]:
    """Point TORCH_EXTENSIONS_DIR (for this process and the ones it starts) at `root`/.torch-extensions,
    remove the locks a killed process left there, and build DeepSpeed's op if it is not built.
    A directory the user chose is left alone (it may be shared): None then."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return None
    where = Path(root) / ".torch-extensions"
    os.environ["TORCH_EXTENSIONS_DIR"] = str(where)
    for lock in stale_locks(where):
        print(f"[tests] removing {lock}, left by a process killed while it held it", file=sys.stderr)
        lock.unlink(missing_ok=True)
    if not (where / OP / f"{OP}.so").exists():
        build(where, build_timeout_s)
    return where


def stale_locks(where: Path) -> List[Path]:
    """The lock files under `where` (called when no process may hold one)."""
    return sorted(where.glob("*/lock"))


def build(where: Path, timeout_s: float) -> bool:
    """Build DeepSpeed's CPU op in a child process; if that fails (no compiler, no DeepSpeed) the
    upstream runs that need it build it themselves, or fail with their own message."""
    print(f"[tests] building DeepSpeed's {OP} op once for the upstream runs", file=sys.stderr)
    try:
        proc = subprocess.run([sys.executable, "-c", BUILD], env=dict(os.environ, DS_ACCELERATOR="cpu"),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:  # the child was killed, holding the lock
        (where / OP / "lock").unlink(missing_ok=True)
        print(f"[tests] building {OP} took over {timeout_s:.0f} s; the tests that need it will build it",
              file=sys.stderr)
        return False
    if proc.returncode != 0:
        print(f"[tests] building {OP} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}", file=sys.stderr)
    return proc.returncode == 0
