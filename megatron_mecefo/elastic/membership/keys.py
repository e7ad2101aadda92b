"""The control plane's store keys, in one place (all under the job's namespace, store.py).

Keyed by generation where a value belongs to one, so stale keys of an earlier generation never
mislead a later one. What each key costs the store is in docs/design.md ("The control plane").
"""

from __future__ import annotations

import json
from typing import Dict, List, Optional, Tuple

# A heartbeat below 0: the launcher saw the rank's process end abnormally (dead at once, not after
# heartbeat_timeout_s). The mark keeps the counter's magnitude and a restarted incarnation goes on
# above it (Heartbeat.start), so an observer never sees an old value again and takes it for a stall.

JOB_FAILED = "job/failed"
"""The reason a rank gave up: every waiting rank and the launcher read it and end."""
JOB_FINISHED = "job/finished"
PROGRESS = "job/progress"
"""The last committed step + 1 (one rank writes it per step; a trace-restarted rank reads it)."""
JOIN_LOG = "join/log"
"""Ranks that asked to join, appended once per request (one read lists them)."""
JOIN_COUNT = "join/count"
"""How many join requests there were: unchanged means no new joiner (one call per step, one rank)."""
STALE = "hb/stale"
"""The ranks whose heartbeat the watcher (the generation's lowest member) saw stalled, as JSON
{rank: [counter, seconds stalled]}; written when that set changes. A publisher trusts an entry only
while the counter still holds that value."""


def hb(rank: int) -> str:
    """A counter the rank's heartbeat thread bumps; 0: not started yet; below 0: its process ended."""
    return f"hb/{rank}"


def exited(rank: int) -> str:
    return f"exited/{rank}"


def join(rank: int) -> str:
    """"waiting" while a restarted rank waits to be admitted, then "admitted"."""
    return f"join/{rank}"


def rejoining(rank: int, incarnation: int) -> str:
    """Set once that incarnation of a restarted rank has asked to join (what a "hold" waits for)."""
    return f"rejoining/{rank}/{incarnation}"


def joinee(rank: int) -> str:
    """The generation a waiting rank is admitted to ("" until one is named)."""
    return f"joinee/{rank}"


def checkins(generation: int) -> str:
    """The check-ins of an agreement, appended: one JSON line [rank, step, info] per member."""
    return f"gen{generation}/in"


def agreed(generation: int) -> str:
    return f"gen{generation}/agreed"


def arrivals(generation: int) -> str:
    """Counts the check-ins of an agreement: the first to check in publishes."""
    return f"gen{generation}/arrivals"


def publisher(generation: int) -> str:
    """The rank that publishes the agreement (the first to check in; a waiter takes over from a dead one)."""
    return f"gen{generation}/publisher"


def candidates(generation: int) -> str:
    """The candidates of a generation a commit admitted joiners to."""
    return f"gen{generation}/candidates"


def ready(generation: int) -> str:
    """Counts the members whose group of the generation is built."""
    return f"gen{generation}/ready"


def formed(generation: int) -> str:
    """"yes" once every member's group is built, "no" once a member saw it fail."""
    return f"gen{generation}/formed"


def decision(generation: int, step: int) -> str:
    return f"gen{generation}/step{step}/decision"


def oks(generation: int, step: int) -> str:
    """Counts the members whose reduction of the step succeeded."""
    return f"gen{generation}/step{step}/oks"


def admit(generation: int, step: int) -> str:
    """The restarted ranks a replicated commit of this step admits (the lowest member writes them)."""
    return f"gen{generation}/step{step}/admit"


def mark_exited(store, rank: int, incarnation: Optional[int] = None) -> None:
    """What a launcher writes when a rank's process ends abnormally (after it ended: nothing beats)."""
    store.set(hb(rank), str(-(abs(int(store.add(hb(rank), 0))) + 1)))
    store.set(exited(rank), "1")
    if incarnation is not None:  # a replica's rendezvous reads it (replica.py); never cleared
        store.set(f"exited/{rank}/{incarnation}", "1")


def failure(reason: str, rank: int, **fields) -> str:
    """The value of JOB_FAILED."""
    return json.dumps({"reason": reason, "rank": rank, **fields})


def checkin_line(rank: int, step: int, info: Optional[str], reduced: bool = False) -> str:
    return json.dumps([rank, step, info, reduced]) + "\n"


def parse_checkins(raw: bytes) -> Tuple[Dict[int, int], Dict[int, str], set]:
    """(rank -> step, rank -> info, the ranks holding their step's reduced gradients) of an appended
    check-in log (the first check-in of a rank counts)."""
    steps: Dict[int, int] = {}
    info: Dict[int, str] = {}
    reduced = set()
    for line in raw.decode().splitlines():
        rank, step, posted, held = json.loads(line)
        if rank not in steps:
            steps[rank] = step
            if posted is not None:
                info[rank] = posted
            if held:
                reduced.add(rank)
    return steps, info, reduced


def parse_join_log(raw: bytes) -> List[int]:
    return sorted({int(r) for r in raw.decode().split(",") if r})


def encode_ranks(ranks) -> list:
    """Sorted ranks as [first, last] runs: a generation of 16,384 ranks with a few lost is a few
    numbers, read by every member."""
    runs: list = []
    for r in sorted(ranks):
        if runs and runs[-1][1] == r - 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return runs


def decode_ranks(runs) -> List[int]:
    """The ranks of `encode_ranks` (a plain list of ranks passes through)."""
    return [r for run in runs for r in (range(run[0], run[1] + 1) if isinstance(run, list) else (run,))]


def read_agreement(raw: bytes) -> dict:
    """A published agreement, its rank lists decoded."""
    agreed = json.loads(raw)
    for field in ("members", "joiners", "voters", "rolled"):
        if field in agreed:
            agreed[field] = decode_ranks(agreed[field])
    return agreed
