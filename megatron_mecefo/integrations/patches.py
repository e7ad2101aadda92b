"""Upstream patches as data: each host lists every global it replaces in one table (its
patches.py): what is replaced, why, and when it is undone.

A `Patch` replaces a module global that upstream calls by name. `patched(table)` applies a table
for one training run and restores every original when the run ends, in reverse order, so a process
may run several hosts or runs one after another (the tests do). The rows with `scope` other than
"run" are documentation: patches applied and undone inside one call, or on the run's own objects.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
from typing import Any, Callable, Iterator, List, Sequence

__all__ = ["Patch", "patched", "markdown"]


@dataclasses.dataclass(frozen=True)
class Patch:
    module: str
    """The upstream module whose global is replaced (dotted)."""
    name: str
    """The global (an attribute of `module`)."""
    why: str
    """What MeCeFO needs from it, in a line."""
    wrap: Callable[[Any], Any] = None  # type: ignore[assignment]
    """original -> replacement, for scope "run"."""
    scope: str = "run"
    """"run": for the run, undone when it ends; "call": inside the named call, undone when it returns;
    "object": on an object the run owns (its optimizer, its DDP buckets), gone with it."""


@contextlib.contextmanager
def patched(table: Sequence[Patch]) -> Iterator[None]:
    """The table's "run" rows applied; every original restored at exit, the last applied first."""
    undo: List[tuple] = []
    try:
        for patch in table:
            if patch.scope != "run":
                continue
            module = importlib.import_module(patch.module)
            original = getattr(module, patch.name)
            setattr(module, patch.name, patch.wrap(original))
            undo.append((module, patch.name, original))
        yield
    finally:
        for module, name, original in reversed(undo):
            setattr(module, name, original)


def markdown(table: Sequence[Patch]) -> str:
    """The table as docs/design.md shows it."""
    undone = {"run": "when the run ends", "call": "when that call returns", "object": "with the object"}
    rows = ["| replaced | why | undone |", "|---|---|---|"]
    rows += [f"| `{p.module}.{p.name}` | {p.why} | {undone[p.scope]} |" for p in table]
    return "\n".join(rows)
