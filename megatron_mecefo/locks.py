"""An exclusive file lock between the processes of one machine (fcntl; plain Python, no Megatron).

Under MeCeFO every replica is a world of its own, so each replica's rank 0 believes it alone builds
a shared cache (a dataset's index files): they take turns under this lock, and the later ones find
the files built.
"""

from __future__ import annotations

import contextlib
import fcntl
from pathlib import Path
from typing import Iterator

__all__ = ["file_lock"]


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
