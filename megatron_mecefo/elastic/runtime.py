"""ElasticRuntime: one rank's step protocol (begin, plan, commit, recover), driven by the step
driver (step.py), never by a host directly. One step, as StepDriver runs it:

    rt.begin_step(step)          # a step boundary: admit the joiners a commit named (a new generation)
    plan = rt.plan()             # this rank's micro-batches (own, then adopted), covering flags, divisors
    ...the host's forward/backward of plan.micro_batches...
    Reduction(rt.latch).reduce(...)   # gradients across replicas; a failure is latched (latch.py)
    if rt.commit(**record):      # the one agreement point of the step
        host's optimizer step; rt.after_optimizer_step()
    else:                        # a peer failed: the survivors regrouped inside commit(); redo `step`

What the host does with a step that did not commit is the adapter's half: the own loop and
Megatron-DeepSpeed redo it inside `StepDriver.run` before `train_step` returns; Megatron-LM's
optimizer gate returns upstream's skipped update (no scheduler step) and the host's `run` redoes it.

Inside a step the first error is latched and later collectives become no-ops; `commit()` decides
for everybody: the step commits where its confirmation all-reduce completed (with a sharded
optimizer state: where the members' vote in the store says so), and a member whose confirmation
failed after the others' completed commits it late at the agreement, so every member takes the
optimizer step or none does and replicas stay bit-identical. A failed step is redone whole by the
new generation (`_recover`: agreement and formation, formation.py). Restarted ranks are admitted
at step boundaries and receive the training state from a member (`StateHooks`).

Tensor and pipeline parallelism: a replica is the T*P ranks of one data-parallel index (plan/topology.py).
Generations and admissions take whole replicas; there is one data-parallel group per (tp, pp)
position, over that position's ranks of the live replicas, and a joiner receives the state of its
own position. A rank whose replica lost a rank leaves the job (NotAMember); the launcher restarts it
and the replica rejoins once all its ranks are back. The commit decision is one for the whole job.
It knows ranks and micro-batches, not layers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from megatron_mecefo.config import LaunchEnv, MeCeFOConfig
from megatron_mecefo.elastic.comm import groups, nccl_env
from megatron_mecefo.elastic.comm import store as job_store
from megatron_mecefo.elastic.comm.replica import mark_started
from megatron_mecefo.elastic.comm.transfer import decode_state
from megatron_mecefo.elastic.faults import holds
from megatron_mecefo.elastic.faults.inject import FaultInjector
from megatron_mecefo.elastic.formation import Formation
from megatron_mecefo.elastic.give_up import GiveUpCheckpoint
from megatron_mecefo.elastic.latch import StepLatch
from megatron_mecefo.elastic.leaving import give_up, retire
from megatron_mecefo.elastic.membership import Membership, keys
from megatron_mecefo.elastic.plan.costs import CostMeter
from megatron_mecefo.elastic.plan.cover_plan import CoverPlan
from megatron_mecefo.elastic.plan.topology import CoverMap, Grid
from megatron_mecefo.errors import GaveUp, IncompleteStep, MeCeFOError, NotAMember, ReplicaLost, StoreLost
from megatron_mecefo.log import EventLog, RankPrefix

__all__ = ["ElasticRuntime", "StateHooks", "StepPlan"]

_STORE_ERRORS = (torch.distributed.DistNetworkError, torch.distributed.DistStoreError)
"""What a store call raises when the store is gone (a killed store resets its connections)."""

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """What this rank does in the current step."""

    step: int
    generation: int
    members: tuple
    cover: CoverMap
    micro_batches: tuple
    """This rank's MicroBatch list: own first, then adopted ones."""
    divisor: int
    divisor_mha: int

    @property
    def covering(self) -> bool:
        return any(m.replica != self.micro_batches[0].replica for m in self.micro_batches)

    @property
    def degraded(self) -> bool:
        return self.cover.degraded


@dataclasses.dataclass(frozen=True)
class StateHooks:
    """What the runtime reads and writes of the host's training state."""

    get: Optional[Callable[[], Any]] = None
    """() -> the training state a rejoining rank receives (model, optimizer, scheduler, counters;
    `step.training_state`); None: nothing but the step."""
    set: Optional[Callable[[Any], None]] = None
    """Loads what `get` returned, on the rejoining rank."""
    save_checkpoint: Optional[Callable[[], str]] = None
    """() -> path: writes a checkpoint of the last committed step when the job gives up (called on
    one rank that holds the state); None: no checkpoint."""
    save_shards: Optional[Callable[[], Any]] = None
    """Writes this rank's shards of a sharded optimizer state into the give-up checkpoint (every
    rank holding state calls it; `save_checkpoint` writes the rest)."""


class ElasticRuntime:
    """Fault-tolerant data-parallel step protocol for one rank (see the module docstring).

    Args:
        config: MeCeFOConfig (timeouts, approximation switches, injection, log_dir).
        job: this rank of the job (LaunchEnv, from `bootstrap.init_distributed`): its rank, the
            original world (T * P * D ranks), the store (hosted outside the training ranks), the
            job id (None: read from the store), the launcher's restarts and the incarnation (0 for
            the first start; > 0 for a restarted rank, which rejoins).
        tensor_parallel, pipeline_parallel: T and P; ranks in Megatron's order (topology.Grid).
        micro_batches: k, micro-batches per replica per step (gradient accumulation).
        state: the host's training state (StateHooks): what a rejoining rank receives, and the
            give-up checkpoint; None: nothing but the step.
        sharding: the sharded optimizer (zero.ShardedOptimizer) re-sharded at every new generation;
            None: the optimizer state is replicated.
        injector: this rank's FaultInjector (`FaultInjector.for_job`, which lays out config.trace
            over the job's length); None: config.inject's rules only (a trace then is refused).
        costs: this rank's micro-batch cost meter (costs.CostMeter; posted with each check-in, the
            generations plan with what the members posted); None: a new one.
        backend: "gloo" (tested) or "nccl" (untested here).

    Raises:
        ValueError: injection rules or a trace that cannot run as written (naming the rule or event).
    """

    def __init__(self, config: MeCeFOConfig, job: LaunchEnv, *, tensor_parallel: int = 1, pipeline_parallel: int = 1,
                 micro_batches: int = 1, state: Optional["StateHooks"] = None, sharding=None,
                 injector: Optional[FaultInjector] = None, costs: Optional[CostMeter] = None,
                 backend: str = "gloo") -> None:
        rank, world, incarnation = job.rank, job.world, job.incarnation
        self.cfg = config
        self.rank, self.world = rank, world
        if world % (tensor_parallel * pipeline_parallel):
            raise ValueError(f"a world of {world} ranks is not divisible by tensor_parallel ({tensor_parallel}) x "
                             f"pipeline_parallel ({pipeline_parallel})")
        # bad input fails before the store is touched
        injector = injector or FaultInjector.for_job(config, job, model_parallel=tensor_parallel * pipeline_parallel)
        self.max_restarts = job.max_restarts
        self.grid = Grid(tp=tensor_parallel, pp=pipeline_parallel, dp=world // (tensor_parallel * pipeline_parallel))
        if config.enable and config.basis == "gradient" and sharding is not None:
            raise ValueError('mecefo "basis": "gradient" needs every weight\'s aggregated gradient on every rank; '
                             "a sharded optimizer (ZeRO stage 1, --use-distributed-optimizer) reduces each rank's "
                             'range only: use "weight" or "activation" there')
        store_host, store_port = job.master_addr, job.master_port
        self.k = micro_batches
        self.incarnation = incarnation
        self.injector = injector
        timeout = timedelta(seconds=config.agree_timeout_s)
        store, self.job_id = job_store.attach(store_host, store_port, rank=rank, incarnation=incarnation,
                                              job_id=job.job_id, timeout=timeout)
        self.store = job_store.CountingStore(store)  # each step record says how many calls its step made
        hb_timeout = timedelta(seconds=max(10.0, config.heartbeat_timeout_s))
        self.membership = Membership(
            self.store, lambda: job_store.job_store(job_store.client(store_host, store_port, hb_timeout), self.job_id), rank,
            heartbeat_interval_s=config.heartbeat_interval_s,
            heartbeat_timeout_s=config.heartbeat_timeout_s,
            agree_timeout_s=config.agree_timeout_s,
            whole=self.grid.whole,
        )
        self.generation = -1
        self.members: List[int] = []
        self.group = None
        self.step = 0
        self._t_start = time.monotonic()
        self._detected_wall: Optional[float] = None
        self._pending: Optional[tuple] = None  # (generation, candidates) to regroup into
        self._cover: Optional[CoverMap] = None
        self._plan: Optional[CoverPlan] = None
        self._costs = costs or CostMeter()
        self._issued: tuple = ()  # the micro-batches plan() handed out for this step
        state = state or StateHooks()
        self._set_state = state.set
        self.sharding = sharding
        self._has_state = False
        """True once this rank holds the training state of self.step: every rank of generation 0,
        a joiner once it has received the state. A rank without it never trains or votes."""
        self.rejoined = False
        """True when this rank came in after generation 0 and received the live state from a peer."""
        self.log = RankPrefix(logger, lambda: {"generation": self.generation, "rank": self.rank, "step": self.step})
        self.store_health = job_store.StoreHealth(f"{job.master_addr}:{job.master_port}",
                                                  lambda: self.membership.heartbeat.lost_since, self.log)
        log_dir = config.log_dir
        self.events = EventLog(os.path.join(log_dir, f"events_rank{rank}.jsonl") if log_dir else None, rank=rank)
        self.steps_log = EventLog(os.path.join(log_dir, f"steps_rank{rank}.jsonl") if log_dir else None, rank=rank)
        self.injector.events = self.events
        self.latch = StepLatch(group=lambda: self.group, fold=lambda: self._plan.fold, fire=self.fire,
                               aborted=self.step_aborted, issued=self._micro_batches_run, costs=self._costs,
                               log=self.log)
        """The step in progress, as the step's reduction sees it (latch.py)."""
        self._formation = Formation(config, self.grid, rank, self.store, self.membership, injector, self.events,
                                    self.log, micro_batches=micro_batches, sharding=sharding, get_state=state.get,
                                    backend=backend, costs=self._costs)
        self._checkpoint = GiveUpCheckpoint(self.store, self.grid, rank, save=state.save_checkpoint,
                                            save_shards=state.save_shards, sharding=sharding, log=self.log,
                                            wait_s=config.collective_timeout_s, position_barrier=self._position_barrier)

    # -- life cycle -------------------------------------------------------------------------------

    def start(self, step: int = 0) -> int:
        """Join the job. Returns the step to train next.

        Args:
            step: the step whose state this rank holds (a first incarnation that loaded a checkpoint
                of step N passes N; a restarted rank's argument is ignored: it takes the live state).
                If the first incarnations disagree, the newest step wins and the others receive it.

        Raises:
            GaveUp: the job cannot go on (exit with GAVE_UP_EXIT_CODE).
            JobFinished: a restarted rank came back after training ended.
        """
        if self.incarnation == 0:
            self.step = step
        self.events.write("started", incarnation=self.incarnation, backend=self._formation.backend,
                          nccl_env=nccl_env.recorded())  # what this process's NCCL runs with (nccl_env.py)
        step = self._guarded(self._start)
        mark_started()
        return step

    def _start(self) -> int:
        self.store.add("mecefo/world", 0)
        self.store.compare_set("mecefo/world", "0", str(self.world))
        self.membership.start()
        if self.incarnation == 0:
            self._has_state = True  # every first incarnation starts from the same initial state
            try:
                self._regroup(0, list(range(self.world)))
                return self.step
            except NotAMember:  # started too late for generation 0: come in like a restarted rank
                self._has_state = False
                self.log.warning("not in the first generation; joining at the next step boundary")
        t0 = time.monotonic()
        generation, candidates = self._formation.request_join(self.incarnation, self._t_start + self.cfg.join_timeout_s)
        self._regroup(generation, candidates)
        self.rejoined = True
        self.events.write("rejoined", generation=self.generation, step=self.step, wait_s=time.monotonic() - t0)
        self.log.info("rejoined at step %d", self.step)
        return self.step

    def close(self, finished: bool = True) -> None:
        """Leave the job. `finished`: training is complete, so ranks still waiting to rejoin stop."""
        if finished:
            try:
                self.store.set("job/finished", "1")
            except Exception:
                pass
        self.membership.stop()
        try:
            groups.destroy_group(self.group, self.cfg.collective_timeout_s)
        except groups.AbortHung as e:  # leaving anyway
            self.log.warning("%s", e)
        self.group = None

    # -- the step protocol ------------------------------------------------------------------------

    def begin_step(self, step: int) -> None:
        """Start (or redo) `step`. Admits pending joiners first (a step boundary).

        Raises:
            GaveUp: the job cannot go on (exit with GAVE_UP_EXIT_CODE).
        """
        self.step = step
        if self._pending is not None:
            generation, candidates = self._pending
            self._pending = None
            self._guarded(self._regroup, generation, candidates)
        holds.wait_for_holds(self.injector.holds(self.step), self.step, self.store, self.membership,
                             self.cfg.join_timeout_s, self.events, self.log)
        self.latch.reset()
        self._issued = ()
        self._t_step, self._calls = time.monotonic(), self.store.calls
        self.membership.watch_step(self.generation, self.step)
        self._costs.begin()

    def plan(self) -> StepPlan:
        replica = self.grid.replica_of(self.rank)
        fold = self._plan.fold
        self._issued = mbs = fold.micro_batches(replica)
        return StepPlan(
            step=self.step, generation=self.generation, members=tuple(self.members), cover=self._cover,
            micro_batches=mbs, divisor=fold.divisor, divisor_mha=fold.divisor_mha,
        )

    def _micro_batches_run(self) -> tuple:
        """This step's micro-batches as plan() handed them out (the fold's, if it was not asked)."""
        return self._issued or self._plan.fold.micro_batches(self.grid.replica_of(self.rank))

    def leads(self) -> bool:
        """This rank's replica is the lowest live one: it saves (upstream's files) and logs."""
        return self.grid.replica_of(self.rank) == min(self.cover_map().live)

    def leads_among_whole(self) -> bool:
        """This rank's replica is the lowest live one whose ranks all still beat now (the lead may
        have died since the generation formed): who speaks for the lead at the end of training."""
        live = [r for r in sorted(self.cover_map().live)
                if set(self.grid.ranks_of_replica(r)) <= set(self.membership.alive(self.grid.ranks_of_replica(r)))]
        return bool(live) and live[0] == self.grid.replica_of(self.rank)

    def read_mark(self, name: str) -> Optional[str]:
        """A host's mark for this rank's (tp, pp) position in the job's store (None: never set)."""
        key = self._mark_key(name)
        return self.store.get(key).decode() if self.store.check([key]) else None

    def write_mark(self, name: str, value: str) -> None:
        self.store.set(self._mark_key(name), value)

    def _mark_key(self, name: str) -> str:
        tp, pp = self.grid.position(self.rank)
        return f"{name}/t{tp}p{pp}"

    def cover_map(self) -> CoverMap:
        """The current generation's cover map."""
        return self._cover

    def cover_plan(self) -> CoverPlan:
        """The current generation's plan: who runs which micro-batch (`.text()` for a log line)."""
        return self._plan

    @contextlib.contextmanager
    def replica_collectives(self, step: int):
        """Collectives inside this rank's replica (tensor/pipeline parallel) run in the block: one that
        fails means a rank of the replica crashed or hangs, and the replica leaves the job
        (ReplicaLost; it rejoins once its ranks are restarted). A no-op with T = P = 1."""
        try:
            yield
        except RuntimeError as e:
            if self.grid.tp * self.grid.pp == 1 or isinstance(e, MeCeFOError):
                raise
            first = str(e).splitlines()[0][-200:] if str(e) else type(e).__name__
            self.events.write("replica_lost", step=step, error=first)
            raise ReplicaLost(f"[rank {self.rank} step {step}] a collective of this rank's replica failed ({first}): "
                              "the replica leaves the job and rejoins when its ranks are restarted") from e

    def fire(self, phase: str) -> None:
        """An injection point of the current step."""
        self.injector.maybe_fire(self.step, phase)

    def _admission(self) -> bool:
        """On the lowest member (one store call: the join count; more only when it moved): the
        restarted ranks this step's commit admits, written under the step's key."""
        if self.sharding is not None or self.rank != min(self.members):
            return False  # a sharded state's commit is voted: its decider names the joiners
        try:
            joiners = self.membership.joins.pending(self.members, self.generation)
            if joiners:
                self.store.set(keys.admit(self.generation, self.step), ",".join(map(str, joiners)))
        except Exception as e:  # the store is gone: every member learns it in this confirmation
            self.store_health.failed(e)
            return False
        return bool(joiners)

    def step_aborted(self) -> bool:
        """A member declared this step failed (polled while waiting on a collective; no store call:
        the heartbeat thread watches the step's decision, membership.watch_step)."""
        return self.membership.step_aborted(self.generation, self.step)

    def commit(self, **record: Any) -> bool:
        """Agree on this step. True: every member takes the optimizer step. False: a peer failed,
        the survivors regrouped (a new generation), and the step must be redone.

        Raises:
            GaveUp: the failure cannot be absorbed; a checkpoint was written if possible (exit with
                GAVE_UP_EXIT_CODE).
        """
        return self._guarded(self._commit, record)

    def _commit(self, record: Dict[str, Any]) -> bool:
        ok = not self.latch.failed
        whole, ran = self.grid.dp * self.k, self.latch.ran  # summed over my position's data-parallel group
        if ok and ran is not None and ran != whole:
            raise IncompleteStep(
                f"[gen {self.generation} rank {self.rank} step {self.step}] the members ran {ran} of the "
                f"{whole} micro-batches of the global batch: the step is not committed (the training loop must run "
                "every micro-batch of plan().micro_batches)")
        if self.sharding is not None:  # every shard steps or none does: voted in the store
            return self._voted_commit(ok, record)
        step, ran = self.step, self._as_ran()
        confirmed, admit, store_lost = self._confirm(ok)
        if store_lost:  # every member learnt it in the same collectives: none commits this step
            raise StoreLost(self.store_health.message(step), writer=self.grid.replica_of(min(self.members)))
        if confirmed:
            self._committed(step, {**ran, **record}, admit=admit)
            return True
        if ok:  # reduced here; whether the others committed is known at the agreement
            self.log.warning("step %d reduced here but not confirmed by every member; holding its gradients "
                             "until the survivors agree", step)
        # peers still waiting in this step's collectives stop (their heartbeat thread sees the mark)
        self.membership.abort_step(self.generation, step)
        if self._recover(reduced=ok):  # the others committed it: take the same step with these gradients
            self._committed(step, {**ran, **record}, admit=False)
            return True
        return False

    def _confirm(self, reduced: bool) -> tuple:
        """The commit's collective: the MIN over the data-parallel group of "every rank of my
        replica reduced" (with T or P > 1: a MIN over the replica first, which every rank of the
        replica joins whatever its own reduction did, and once more after, so a replica commits
        alike). True: every member holds this step's reduced gradients and commits it. False: this
        rank does not commit now; if it `reduced`, it keeps its gradients, and the agreement that
        follows says whether a member committed the step (then it commits it too) or none did (then
        the step is redone). A replica that did not all reduce stays out of the data-parallel
        confirmation, which then completes nowhere.

        The same collectives carry, as -MAX, whether the lowest member named restarted ranks to
        admit at this step's end (`_admission`): every rank of every position learns it with no
        store call of its own, and, as -1, whether a rank found the store lost (then no member
        commits: `_commit` raises StoreLost everywhere). Returns (confirmed, admit, store_lost)."""
        flags = self._replica_min([1.0 if reduced else 0.0, -1.0 if reduced and self._admission() else 0.0,
                                   -1.0 if self.store_health.lost_since() is not None else 0.0])
        if flags[0] == 1.0:
            t = torch.tensor(flags, device=self._device())
            try:
                groups.allreduce_min_(self.group, t, should_abort=self.step_aborted)
                self.fire("commit")
                flags = t.tolist()
            except MeCeFOError:
                raise
            except Exception as e:  # gloo: connection closed / timed out; an injected error
                self.latch.report_error(e)
                flags = [0.0, 0.0, flags[2]]
        flags = self._replica_min(flags)
        return flags[0] == 1.0, flags[0] == 1.0 and flags[1] < 0, flags[2] < 0

    def _replica_min(self, flags: list) -> list:
        """The element-wise MIN of `flags` over this rank's replica (T x P ranks; as is with T = P = 1)."""
        if self.grid.tp * self.grid.pp == 1:
            return flags
        with self.replica_collectives(self.step):
            return groups.replica_min(flags)

    def _position_barrier(self) -> None:
        """Every live member of this rank's position (its data-parallel group) got here."""
        groups.allreduce_min_(self.group, torch.zeros(1, device=self._device()))

    def _device(self):
        return torch.device("cuda", torch.cuda.current_device()) if self._formation.backend == "nccl" \
            else torch.device("cpu")

    def _committed(self, step: int, record: Dict[str, Any], admit: bool) -> None:
        """A committed step's bookkeeping: the progress mark, the step record, and the joiners its
        commit admits (named under the step's key by the lowest member, `_admission`)."""
        self._mark_progress(step)
        if admit:
            joiners = [int(r) for r in self.store.get(keys.admit(self.generation, step)).decode().split(",")]
            candidates = sorted(set(self.members) | set(joiners))
            self._pending = (self.generation + 1, candidates)
            if self.rank == min(self.members):  # the candidates first: a named joiner reads them
                self.store.set(keys.candidates(self.generation + 1), ",".join(map(str, candidates)))
                for j in joiners:
                    self.store.set(keys.joinee(j), str(self.generation + 1))
        self._write_step(step, record)
        if admit:
            self.injector.maybe_fire(step, "admit")

    def _mark_progress(self, step: int) -> None:
        """The lowest member's one store call of a committed step: the progress trace-restarted ranks
        read. A store that fails here is found by the next step's confirmation or vote."""
        if self.rank == min(self.members) and self.store_health.lost_since() is None:
            try:
                self.store.set(keys.PROGRESS, str(step + 1))
            except Exception as e:  # a store error of any kind: the job's end is agreed in a collective
                self.store_health.failed(e)

    def _as_ran(self) -> Dict[str, Any]:
        """The step record's fields of the generation the current step ran in."""
        ran = self._micro_batches_run()
        return dict(generation=self.generation, live=list(self.members),
                    cover={str(k): v for k, v in self._cover.cover.items()}, degraded=self._cover.degraded,
                    micro_batches=[[m.replica, m.index, m.covering] for m in ran],
                    divisor_mha=self._plan.fold.divisor_mha)

    def _write_step(self, step: int, record: Dict[str, Any]) -> None:
        """`record` holds `_as_ran()`'s fields (a step committed after a regroup ran in the last one)."""
        self.steps_log.write("step", step=step, step_time_s=time.monotonic() - self._t_step,
                             store_calls=self.store.calls - self._calls, **record)

    def _voted_commit(self, ok: bool, record: Dict[str, Any]) -> bool:
        step = self.step
        try:
            decision = self.membership.decide(self.generation, step, self.members, ok, self.world)
        except _STORE_ERRORS as e:
            if not ok:  # this rank's reduction failed as well: no collective left to agree in
                raise
            self.store_health.failed(e)
            decision = None  # whether the others read a commit is agreed below
        if decision is not None and decision.commit and not ok:
            raise IncompleteStep(
                f"[gen {self.generation} rank {self.rank} step {step}] the step was decided commit although this "
                "rank's gradient reduction failed: the store's decisions do not match this job; not committing")
        if decision is None or decision.commit:
            everyone_read = self._everyone_read_commit(decision is not None)
            if everyone_read is False or (everyone_read is None and decision is None):
                # the store was lost between the decision and a member's read: no shard steps, and the
                # members agreed on that in a collective, so they agree on the writer as well
                writer = self.grid.replica_of(min(self.members)) if everyone_read is False else None
                raise StoreLost(self.store_health.message(step), writer=writer)
        if decision.commit:
            self._mark_progress(step)
            if decision.joiners:
                self._pending = (decision.next_generation, sorted(set(self.members) | set(decision.joiners)))
            self._write_step(step, {**self._as_ran(), **record})
            if decision.joiners:
                self.injector.maybe_fire(step, "admit")
            return True
        self._recover()
        return False

    def _everyone_read_commit(self, read: bool) -> Optional[bool]:
        """After a sharded step's vote: the MIN over every member of "read the commit decision" (a
        member whose store call failed says no), so either every shard steps or none does. None: the
        collective failed here (a peer died after the vote; the decision stands where it was read)."""
        try:
            t = torch.tensor(self._replica_min([1.0 if read else 0.0]), device=self._device())
            groups.allreduce_min_(self.group, t, should_abort=self.step_aborted)
            flags = self._replica_min(t.tolist())
        except MeCeFOError:
            raise
        except Exception as e:  # gloo: connection closed / timed out; the parameter gather finds the peer
            self.log.warning("the confirmation after step %d's vote failed: %s", self.step, str(e).splitlines()[0][:200])
            return None
        return flags[0] == 1.0

    def after_optimizer_step(self) -> None:
        """Call after the optimizer step of a committed step. If a collective after the commit
        failed (the sharded optimizer's parameter gather: a peer died), the step stands; regroup now
        at the next step, and the new generation re-sends the parameters.

        Raises:
            GaveUp: the failure cannot be absorbed (a shard of the optimizer state was lost).
        """
        error = self.sharding.gather_error if self.sharding is not None else None
        if error is None:
            return
        self.latch.report_error(error)
        self.events.write("gather_failed", step=self.step, error=str(error).splitlines()[0][:200])
        self.step += 1
        self.membership.abort_step(self.generation, self.step)  # a member already in the next step stops waiting
        self._guarded(self._recover)

    # -- recovery ---------------------------------------------------------------------------------

    def _recover(self, reduced: bool = False) -> bool:
        """Agree on the survivors and regroup. `reduced`: this rank holds the current step's reduced
        gradients (its confirmation failed). Returns True when a member committed that step: this
        rank then commits it too, with those gradients."""
        t_detect = self.latch.error_time or time.monotonic()
        self._detected_wall = self.latch.error_wall or time.time()
        t0 = time.monotonic()
        self._drop_group()
        self.log.warning("step %d aborted; agreeing on survivors", self.step)
        generation, candidates = self.generation + 1, self.members
        if self._pending is not None:  # the commit had admitted joiners: that generation, with them
            generation, candidates = self._pending
            self._pending = None
        return self._regroup(generation, candidates, detected_at=t_detect, t_start=t0, reduced=reduced)

    def _regroup(self, generation: int, candidates: Sequence[int], detected_at: Optional[float] = None,
                 t_start: Optional[float] = None, reduced: bool = False) -> bool:
        """Form the next generation (formation.py) and install it. Returns whether this rank rolls
        its held step forward (`_recover`)."""
        t0 = t_start or time.monotonic()
        self._drop_group()  # a rejoin replaces a healthy group: its communicator goes first
        held = self.step if self._has_state else None
        new = self._formation.form(generation, candidates, held, reduced=reduced)
        rolled = self.rank in new.rolled
        if new.state is not None:
            if held is not None and self.generation >= 0:
                # a member whose state is older than the generation's without holding the step's
                # gradients: it cannot take the newest state mid-step; restarted, it rejoins with it
                raise NotAMember(f"[gen {generation} rank {self.rank}] holds the state of step {held}, the members "
                                 f"step {new.step}: leaving to rejoin with it")
            self._load_state(new.state, new.step)
        self.group, self.generation, self.members = new.group, new.number, list(new.members)
        self._cover, self._plan, self.step = new.cover, new.plan, new.step
        t_done, now = time.monotonic(), time.time()
        self.events.write(
            "regroup", generation=self.generation, step=self.step, members=self.members,
            cover={str(k): v for k, v in new.cover.cover.items()}, joiners=list(new.joiners), rolled=list(new.rolled),
            detected_at=self._detected_wall if detected_at else None,
            agreed_at=now - (t_done - new.t_agreed), regrouped_at=now,
            detect_to_recover_s=(t0 - detected_at) if detected_at else None,
            agree_s=new.t_agreed - t0, regroup_s=t_done - new.t_agreed, plan=new.plan.summary(self.k),
            groups_alive=groups.alive(collect=False),  # 1: the old communicator was freed with its last reference
        )
        if self.generation > 0:
            runners = {f: rs[0] if len(rs) == 1 else list(rs) for f, rs in new.plan.runners().items()}
            self.log.warning("generation %d: members %s, cover %s (%s; slowest replica %.2fx a normal step "
                             "predicted, %d micro-batches approximated)", self.generation, self.members,
                             runners or "none", self.cfg.cover, new.plan.slowest / (self.k * new.plan.costs.exact),
                             new.plan.approximated)
        self.membership.watch_liveness(self.members)
        if self.grid.tp * self.grid.pp > 1:
            self.membership.watch_exclusion(self.generation, self._excluded)
        return rolled

    def _drop_group(self) -> None:
        """Abort this rank's data-parallel group (bounded: groups.AbortHung when NCCL's abort hangs)
        and drop the reference, so its communicator is freed before the next one is built."""
        group, self.group = self.group, None
        groups.destroy_group(group, self.cfg.collective_timeout_s)

    def _excluded(self, generation: int, members: list) -> None:
        """Left out of a generation (whatever it waits on may never return): retire."""
        retire(self.events, self.rank, generation, members, f"generation {generation} was agreed without this "
               f"rank (members {members}): its replica is out of the job")

    def _load_state(self, payload: bytes, step: int) -> None:
        user = decode_state(payload, step=step, rank=self.rank)
        if user is not None:
            if self._set_state is None:
                raise MeCeFOError("a rejoining rank needs ElasticRuntime(state=...) to load the training state")
            self._set_state(user)
        self.step, self._has_state = step, True

    # -- giving up --------------------------------------------------------------------------------

    def _guarded(self, fn: Callable, *args: Any) -> Any:
        try:
            return fn(*args)
        except groups.AbortHung as e:
            # its group's abort never returned: it cannot be trusted to build another communicator
            retire(self.events, self.rank, self.generation, self.members, str(e), reason=str(e))
        except GaveUp as e:
            self._give_up(e)
            raise
        except _STORE_ERRORS as e:
            # the store failed under a call only a failure or an admission makes (a recovery, a group
            # formation): with no agreed writer, the checkpoint is written only if the store answers
            self.store_health.failed(e)
            lost = StoreLost(f"{self.store_health.message(self.step, at_commit=False)} ({e})", writer=None)
            self._give_up(lost)
            raise lost from e

    def _give_up(self, error: GaveUp) -> None:
        give_up(error, checkpoint=self._checkpoint, membership=self.membership, events=self.events, log=self.log,
                step=self.step, generation=self.generation, members=self.members, has_state=self._has_state)
        self.close(finished=False)

    # -- checkpointable state ---------------------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        return {"generation": self.generation, "members": list(self.members), "step": self.step}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.step = int(state["step"])
