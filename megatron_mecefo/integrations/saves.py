"""What a run saves and what a rejoining rank receives, in both Megatron codebases: upstream's
checkpoint written by one replica (every rank its optimizer shards), and the training loop's
counters kept on Megatron's `args`."""

from __future__ import annotations

import contextlib
from typing import Callable

__all__ = ["lead_only_save", "arg_counters"]


def lead_only_save(original: Callable, run) -> Callable:
    """Upstream's `save_checkpoint`: one replica (the lowest live) writes; every replica believes it
    is data-parallel rank 0, so more writers would write the same files. A sharded optimizer state
    is written by every rank, its own ranges (`run.save_shards`), which may return a context the
    lead's save runs in (Megatron-LM: the state gathered into upstream's format)."""

    def save_checkpoint(*a, **kw):
        around = None
        if run.active and run.save_shards is not None:  # every rank writes its optimizer shards
            around = run.save_shards(a[0] if a else kw["iteration"])  # the lead's: how it writes them
        if run.active and not run.lead():
            return None
        with around or contextlib.nullcontext():
            return original(*a, **kw)

    return save_checkpoint


def arg_counters(args, keys, record=None) -> tuple:
    """(get, set) of the training loop's counters kept on Megatron's `args` (what a rejoining rank
    receives with the state): plain values of the `keys` that `args` has, and the sums and flags of
    upstream's log (`record`'s Carry: a rejoining rank's log lines then are the others')."""

    def get():
        values = {key: getattr(args, key) for key in keys if hasattr(args, key)}
        if record is not None:
            values["log"] = record.carry.state()
        return values

    def set_(values):
        values = dict(values)
        if record is not None:
            record.carry.receive(values.pop("log", None))
        for key, value in values.items():
            setattr(args, key, value)

    return get, set_
