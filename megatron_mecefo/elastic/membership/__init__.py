"""The control plane: liveness, agreement on the members of each generation, the per-step commit,
and the admission of restarted ranks. Everything goes through one key-value store (a
`torch.distributed.TCPStore` hosted by the launcher or a daemon, so any training rank may die);
keys.py is its schema. It knows nothing of models or gradients.

Budgeted by N, the number of ranks, because one store serves the whole job (docs/design.md, "The
control plane"; measured by benchmarks/control_plane.py):

* liveness.py   heartbeats (one call per rank per interval), scanned once by one rank per wait
                and by the generation's lowest member once per interval (the stall report);
                `await_key`, the server-side wait every other wait is built on
* agreement.py  a generation's members: one check-in per candidate, one publisher, O(N) in all
* commit.py     the per-step vote and a generation's formed/not-formed: O(1) per member
* admission.py  restarted ranks: the request, the joiners a commit names (one counter read per
                step), the orphan check

`Membership` is one rank's handle on these parts, holding what they share (the store, the rank,
the timeouts, the liveness view): liveness and the job's outcome itself, the generations
(`.generations`, agreement.py), the per-step vote (`.votes`, commit.py) and the joins (`.joins`,
admission.py).
"""

from __future__ import annotations

from typing import Callable, Iterable, List, Optional, Sequence

import torch.distributed as dist

from megatron_mecefo.elastic.membership import keys
from megatron_mecefo.elastic.membership.admission import Joins, OrphanWatch, check_job
from megatron_mecefo.elastic.membership.agreement import Agreement, Generations
from megatron_mecefo.elastic.membership.commit import Decision, StepVotes
from megatron_mecefo.elastic.membership.liveness import Heartbeat, Liveness, StallReport

__all__ = ["Membership", "Decision", "Agreement", "OrphanWatch"]


class Membership:
    """One rank's control plane. Call `start()` once, `stop()` at exit.

    Args:
        store: this rank's store client in the job's namespace (used from the training thread).
        connect: opens another such connection, for the heartbeat thread.
        rank: this rank's global rank (stable across generations and restarts).
        heartbeat_interval_s, heartbeat_timeout_s, agree_timeout_s: see MeCeFOConfig.
        whole: ranks -> the ranks among them whose replica is complete (Grid.whole). Generations and
            admissions take whole replicas only; the default (tp = pp = 1) takes every rank.
    """

    def __init__(self, store: dist.Store, connect: Callable[[], dist.Store], rank: int, *,
                 heartbeat_interval_s: float, heartbeat_timeout_s: float, agree_timeout_s: float,
                 whole: Optional[Callable[[Iterable[int]], List[int]]] = None) -> None:
        self.store = store
        self.whole = whole or (lambda ranks: sorted(ranks))
        self.rank = rank
        self.hb_interval = heartbeat_interval_s
        self.hb_timeout = heartbeat_timeout_s
        self.agree_timeout = agree_timeout_s
        self.liveness = Liveness(store, rank, heartbeat_timeout_s)
        self.joins = Joins(store, rank, self.whole, self.liveness)
        self.heartbeat = Heartbeat(store, connect, rank, interval_s=heartbeat_interval_s,
                                   timeout_s=heartbeat_timeout_s, on_beat=self._on_beat)
        self.generations = Generations(store, self.liveness, self.heartbeat, timeout_s=agree_timeout_s,
                                       interval_s=heartbeat_interval_s, hb_timeout_s=heartbeat_timeout_s,
                                       whole=self.whole, check_job=self.check_job, asking=self.joins.asking)
        """Agreeing on a generation's members, and whether it formed (agreement.py)."""
        self.votes = StepVotes(store, self.heartbeat, timeout_s=agree_timeout_s, hb_timeout_s=heartbeat_timeout_s,
                               check_job=self.check_job, joiners=self.joins.pending)
        """The per-step vote and the step's failure mark (commit.py)."""
        self._stall_report: Optional[StallReport] = None
        self._watch: Optional[int] = None
        self._on_excluded: Optional[Callable[[int, list], None]] = None

    # -- liveness ----------------------------------------------------------------------------------

    def start(self) -> None:
        self.heartbeat.start()

    def stop(self) -> None:
        self.heartbeat.stop()

    def alive(self, ranks: Iterable[int]) -> List[int]:
        """The ranks among `ranks` presumed alive (one store call; see liveness.py)."""
        return self.liveness.scan(list(ranks))

    def watch_liveness(self, members: Sequence[int]) -> None:
        """Call when a generation forms: its lowest member's heartbeat thread then scans every member
        once per beat and reports the stalled ones (liveness.StallReport)."""
        lowest = min(members, default=None) == self.rank
        self._stall_report = StallReport(members, self.rank, self.hb_timeout) if lowest else None

    def _on_beat(self, store: dist.Store) -> None:
        self._check_excluded(store)
        report = self._stall_report
        if report is not None:
            report(store)

    def watch_exclusion(self, generation: Optional[int], on_excluded: Optional[Callable[[int, list], None]] = None) -> None:
        """From the heartbeat thread, call `on_excluded(generation, members)` once a generation after
        `generation` is agreed without this rank (None: stop watching). A rank stuck where no error
        reaches it (a pipeline peer of a replica already retired) learns it this way."""
        if on_excluded is not None:
            self._on_excluded = on_excluded
        self._watch = generation

    def _check_excluded(self, store: dist.Store) -> None:
        g = self._watch
        while g is not None and store.check([keys.agreed(g + 1)]):
            members = keys.read_agreement(store.get(keys.agreed(g + 1)))["members"]
            if self.rank not in members:
                self._watch = None
                if self._on_excluded is not None:
                    self._on_excluded(g + 1, members)
                return
            g += 1

    # -- job-wide outcome ---------------------------------------------------------------------------

    def check_job(self) -> None:
        """Raise if the job has ended: JobAborted when a rank gave up, JobFinished when it is done."""
        check_job(self.store, self.rank)

    def mark_failed(self, reason: str, **fields) -> None:
        """Tell every rank (and the launcher) that the job gave up; the first reason stays."""
        self.store.compare_set(keys.JOB_FAILED, "", keys.failure(reason, self.rank, **fields))

    # -- joins --------------------------------------------------------------------------------------

    def request_join(self, deadline: float, announced: Optional[Callable[[], None]] = None) -> int:
        """Announce this restarted rank; return the generation it is admitted to.

        Raises:
            JobFinished: training ended first.
            JobAborted: the job gave up meanwhile.
            StateLost: no live rank of the newest generation holds the state (nobody can admit this
                rank or send it the state); the job is marked failed.
            JoinTimeout: not admitted by `deadline` (time.monotonic(); the rank's start + join_timeout_s).
        """
        return self.joins.request(deadline, announced)

    def progress(self) -> int:
        """The job's last committed step + 1 (keys.PROGRESS; 0 before the first commit)."""
        return int(self.store.add(keys.PROGRESS, 0))

    def mark_rejoining(self, incarnation: int) -> None:
        """This restarted rank's request to join is counted (what "hold" rules wait for)."""
        self.store.set(keys.rejoining(self.rank, incarnation), "1")

    def asked_to_rejoin(self, rank: int, incarnation: int) -> bool:
        """Whether that incarnation of `rank` has asked to join (`mark_rejoining`)."""
        return self.store.check([keys.rejoining(rank, incarnation)])

    def orphan_watch(self) -> OrphanWatch:
        """A check for a rank waiting outside the job (admission.OrphanWatch)."""
        return OrphanWatch(self.store, self.rank, self.hb_timeout)
