"""A store client whose calls are counted: what tests and benchmarks/control_plane.py measure the
control plane's traffic with (per member, without touching the code under test)."""

from __future__ import annotations

import collections

__all__ = ["Counted", "STORE_CALLS"]

STORE_CALLS = frozenset({"set", "get", "add", "check", "compare_set", "wait", "multi_get", "multi_set", "append",
                         "delete_key", "num_keys"})


class Counted:
    """`store` with each call of STORE_CALLS counted in `counts[key]` (a collections.Counter)."""

    def __init__(self, store, counts: "collections.Counter", key) -> None:
        self._store, self._counts, self._key = store, counts, key

    def __getattr__(self, name):
        attr = getattr(self._store, name)
        if name not in STORE_CALLS:
            return attr

        def call(*args, **kwargs):
            self._counts[self._key] += 1
            return attr(*args, **kwargs)

        return call
