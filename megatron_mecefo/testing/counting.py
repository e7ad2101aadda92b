"""A store client whose calls are counted per member: how tests and benchmarks/control_plane.py
measure the control plane's traffic without touching the code under test."""

from __future__ import annotations

import collections

from megatron_mecefo.elastic.comm.store import CountingStore

__all__ = ["Counted"]


def Counted(store, counts: "collections.Counter", key) -> CountingStore:  # noqa: N802 - reads as a class
    """`store` with each call counted in `counts[key]`."""
    return CountingStore(store, on_call=lambda: counts.update((key,)))
