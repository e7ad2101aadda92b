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
the timeouts, the liveness view).
"""

from __future__ import annotations

import json
from typing import Callable, Dict, Iterable, List, Optional, Sequence

import torch.distributed as dist

from megatron_mecefo.elastic.membership import keys
from megatron_mecefo.elastic.membership.admission import Joins, OrphanWatch
from megatron_mecefo.elastic.membership.agreement import Agreement, agree
from megatron_mecefo.elastic.membership.commit import Decision, abort_step, decide, formed, not_formed
from megatron_mecefo.elastic.membership.liveness import Heartbeat, Liveness, StallReport
from megatron_mecefo.errors import JobAborted, JobFinished

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

    def watch_step(self, generation: int, step: int) -> None:
        """The heartbeat thread watches this step's decision from now on (`step_aborted`)."""
        self.heartbeat.watch_abort(keys.decision(generation, step))

    def step_aborted(self, generation: int, step: int) -> bool:
        """Whether a member declared the step failed, as the heartbeat thread last saw it (no store
        call: polled while waiting on a collective)."""
        return self.heartbeat.aborted(keys.decision(generation, step))

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
        if self.store.check([keys.JOB_FAILED]):
            info = json.loads(self.store.get(keys.JOB_FAILED))
            raise JobAborted(f"[rank {self.rank}] the job gave up: {info['reason']}")
        if self.store.check([keys.JOB_FINISHED]):
            raise JobFinished(f"[rank {self.rank}] the job finished")

    def mark_failed(self, reason: str, **fields) -> None:
        """Tell every rank (and the launcher) that the job gave up; the first reason stays."""
        self.store.compare_set(keys.JOB_FAILED, "", keys.failure(reason, self.rank, **fields))

    # -- agreement ----------------------------------------------------------------------------------

    def agree(self, generation: int, candidates: Sequence[int], step: Optional[int], info: Optional[str] = None,
              summarize: Optional[Callable[[Dict[int, str]], str]] = None, reduced: bool = False) -> Agreement:
        """Agree with the other live candidates on the members of `generation` (agreement.py).

        Call on every survivor (and admitted joiner) with the same `candidates`. `step` is the step
        this rank holds the training state of, or None for a rank without state (a restarted or
        late rank). The agreement names the members holding the state of the newest step (one of them
        sends it) and the joiners, who must receive it before the generation trains: a rank without
        state never trains or votes. `info` (a string, e.g. this rank's measured costs) is posted
        with the check-in; the agreement carries the members' posts, or `summarize(posts)` of the
        publisher (one string for any N), so every member reads the same. `reduced`: this rank
        also holds the reduced gradients of step `step` (its commit was not confirmed); if a member
        committed that step, the agreement names it `rolled`: it commits the step too.

        Returns:
            The agreed Agreement; its members contain this rank.

        Candidates that have not checked in by agree_timeout_s are left out (a late starter then
        rejoins like a restarted rank); the publisher then publishes at once.

        Raises:
            AgreementTimeout: still no agreement 2 x heartbeat_timeout_s after agree_timeout_s (every rank
                that could publish it died meanwhile).
            StateLost: every live candidate is without state and no other can bring it.
            NoCoverAvailable: every replica lost a rank.
            JobAborted: another rank gave up meanwhile.
            NotAMember: the agreed list leaves this rank out (it was presumed failed).
        """
        return agree(self.store, self.liveness, self.heartbeat, generation, candidates, step, timeout_s=self.agree_timeout,
                     interval_s=self.hb_interval, whole=self.whole, check_job=self.check_job,
                     asking_to_join=self.joins.asking, info=info, summarize=summarize, reduced=reduced)

    # -- commit -------------------------------------------------------------------------------------

    def decide(self, generation: int, step: int, members: Sequence[int], ok: bool, world: int) -> Decision:
        """Vote ok/abort for this step and return the one decision all members follow (commit.py).

        Call on every member once per step, after the gradient reduction and before the optimizer.
        A decision that does not come within agree_timeout_s is replaced by abort (compare-and-set:
        if a commit got there first, it stands).
        """
        return decide(self.store, self.heartbeat, generation, step, members, ok, timeout_s=self.agree_timeout,
                      hb_timeout_s=self.hb_timeout, check_job=self.check_job,
                      joiners=lambda members: self.joins.pending(members, generation))

    def abort_step(self, generation: int, step: int) -> None:
        """Decide abort for (generation, step) unless decided, and mark the generation not formed
        (commit.abort_step): a rank leaving a generation that did not form for it."""
        abort_step(self.store, generation, step)

    def not_formed(self, generation: int) -> bool:
        """Whether a member already decided that `generation` will not form (or the job ended)."""
        return not_formed(self.store, generation)

    def formed(self, generation: int, members: Sequence[int]) -> bool:
        """Report that this member's data-parallel group of `generation` is built (and its joiners
        hold the state); return whether the whole generation formed. One outcome for all members
        (compare-and-set): with tensor or pipeline parallelism each position forms its own group,
        and a position whose group failed must not leave the others training without it."""
        return formed(self.store, self.heartbeat, generation, members, timeout_s=self.agree_timeout,
                      hb_timeout_s=self.hb_timeout, check_job=self.check_job)

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
        return self.joins.request(self.liveness, self.check_job, deadline, announced)

    def orphan_watch(self) -> OrphanWatch:
        """A check for a rank waiting outside the job (admission.OrphanWatch)."""
        return OrphanWatch(self.store, self.liveness, self.check_job)
