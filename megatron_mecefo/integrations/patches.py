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

__all__ = ["Patch", "patched", "markdown", "loop_rows"]


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


def loop_rows(run, hooks, *, initialize: str, training: str, helpers_dir: Callable[[], str], record) -> List[Patch]:
    """The rows both Megatron codebases share: their `pretrain()` calls these globals of its
    `initialize` and `training` modules by the same names. `hooks`: the host's training.py."""
    from megatron_mecefo.integrations.data import one_replica_at_a_time
    from megatron_mecefo.integrations.saves import lead_only_save

    return [
        Patch(initialize, "_initialize_distributed", "torch.distributed over the rank's replica on the job's store "
              "first; upstream's groups then span the replica", lambda f: hooks.wrap_initialize_distributed(f, run)),
        Patch(initialize, "_compile_dependencies", "every replica's rank 0 is a rank 0: they compile the dataset "
              "helpers in turn", lambda f: one_replica_at_a_time(f, lambda: run.active, helpers_dir)),
        Patch(training, "setup_model_and_optimizer", "after upstream's model, optimizer and --load, the rank joins "
              "the job (a restarted rank receives the live state)", lambda f: hooks.wrap_setup_model_and_optimizer(f, run)),
        Patch(training, "build_train_valid_test_datasets", "keeps the training set: a covering rank draws a failed "
              "replica's micro-batches", lambda f: hooks.wrap_datasets(f, run)),
        Patch(training, "train_step", "the plan's micro-batches, the reduction and commit before the optimizer "
              "step, a failed step redone", lambda f: hooks.wrap_train_step(f, run)),
        Patch(training, "save_checkpoint", "one replica writes upstream's files, every rank its optimizer shards",
              lambda f: lead_only_save(f, run)),
        Patch(training, "training_log", "printed once, by whichever replica leads (record.py)",
              lambda f: record.wrap(f, carries=True)),
        Patch(training, "evaluate_and_print_results", "printed once, by whichever replica leads (record.py)",
              record.wrap),
        Patch(training, "get_tensorboard_writer", "a recorder while a log call runs (record.py)", scope="call"),
    ]
