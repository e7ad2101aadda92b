"""Logging helpers: a `[gen G rank R step S]` prefix and JSONL event files.

Library modules only create loggers (`logging.getLogger(__name__)`); handlers are configured by
entry points (examples, launcher). `EventLog` writes one JSON object per line with a wall-clock
time; `span()` adds the duration of a block, for the detect / agree / regroup phases.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Union

__all__ = ["RankPrefix", "EventLog", "read_jsonl"]


class RankPrefix(logging.LoggerAdapter):
    """Prefixes messages with `[gen G rank R step S]` read from a callable at log time."""

    def __init__(self, logger: logging.Logger, context: Callable[[], Dict[str, Any]]):
        super().__init__(logger, {})
        self._context = context

    def process(self, msg, kwargs):
        c = self._context()
        return f"[gen {c.get('generation')} rank {c.get('rank')} step {c.get('step')}] {msg}", kwargs


class EventLog:
    """Appends JSON lines to `path` (no-op when path is None). Not thread-safe; one per process."""

    def __init__(self, path: Optional[str], **static: Any) -> None:
        self.path = path
        self.static = static
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def write(self, event: str, **fields: Any) -> Dict[str, Any]:
        record = {"event": event, "time": time.time(), **self.static, **fields}
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(record, default=str) + "\n")
        return record

    @contextlib.contextmanager
    def span(self, event: str, **fields: Any) -> Iterator[Dict[str, Any]]:
        """Times the block; the yielded dict may be filled with more fields before the write."""
        extra: Dict[str, Any] = {}
        start = time.monotonic()
        try:
            yield extra
        finally:
            self.write(event, duration_s=time.monotonic() - start, **fields, **extra)


def read_jsonl(path: Union[str, "os.PathLike[str]"]) -> List[Dict[str, Any]]:
    """The records of an EventLog file ([] when it does not exist). A rank killed mid-write leaves a
    torn last line: it is skipped."""
    if not os.path.exists(path):
        return []
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return out
