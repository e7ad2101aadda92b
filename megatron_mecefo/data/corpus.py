"""The default corpus: the Python standard library's own sources, which every machine has.

No download. The first call writes an indexed dataset into a cache directory
($MECEFO_CACHE, default ~/.cache/megatron_mecefo); later calls reuse it. A file lock makes
concurrent ranks build it once.
"""

from __future__ import annotations

import hashlib
import sys
import sysconfig
from pathlib import Path
from typing import List

from megatron_mecefo.data.preprocess import write_indexed_dataset
from megatron_mecefo.locks import file_lock

__all__ = ["stdlib_corpus"]


def _stdlib_files(max_bytes: int) -> List[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files, total = [], 0
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).parts
        if rel[0] in ("site-packages", "test", "idlelib", "lib2to3", "tkinter") or "tests" in rel:
            continue
        size = path.stat().st_size
        if size == 0:
            continue
        files.append(path)
        total += size
        if total >= max_bytes:
            break
    return files


def stdlib_corpus(cache_dir: str | None = None, max_bytes: int = 8 << 20) -> str:
    """Path prefix of an indexed dataset of stdlib sources (one document per file)."""
    from megatron_mecefo.config import cache_root

    root = Path(cache_dir or cache_root())
    key = hashlib.sha256(f"{sys.version}|{max_bytes}".encode()).hexdigest()[:12]
    prefix = root / f"stdlib-{key}" / "corpus"
    with file_lock(root / f"stdlib-{key}.lock"):
        if not (prefix.with_suffix(".idx").exists() and prefix.with_suffix(".bin").exists()):
            docs = (p.read_text(encoding="utf-8", errors="replace") for p in _stdlib_files(max_bytes))
            write_indexed_dataset(docs, str(prefix))
    return str(prefix)
