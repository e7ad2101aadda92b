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
new generation (regrouping.py: agreement and formation, formation.py). Restarted ranks are admitted
at step boundaries and receive the training state from a member (`StateHooks`).

Tensor and pipeline parallelism: a replica is the T*P ranks of one data-parallel index (plan/topology.py).
Generations and admissions take whole replicas; there is one data-parallel group per (tp, pp)
position, over that position's ranks of the live replicas, and a joiner receives the state of its
own position. A rank whose replica lost a rank leaves the job (NotAMember); the launcher restarts it
and the replica rejoins once all its ranks are back. The commit decision is one for the whole job.
It knows ranks and micro-batches, not layers.
"""

from __future__ import annotations

import logging
import os
import time
from datetime import timedelta
from typing import Any, Callable, Optional

import torch

from megatron_mecefo.config import LaunchEnv, MeCeFOConfig
from megatron_mecefo.elastic.comm import groups, nccl_env
from megatron_mecefo.elastic.comm import store as job_store
from megatron_mecefo.elastic.comm.replica import mark_started, replica_collectives
from megatron_mecefo.elastic.committing import STORE_ERRORS, Committer
from megatron_mecefo.elastic.current import Current
from megatron_mecefo.elastic.faults import holds
from megatron_mecefo.elastic.faults.inject import FaultInjector
from megatron_mecefo.elastic.formation import Formation
from megatron_mecefo.elastic.give_up import GiveUpCheckpoint
from megatron_mecefo.elastic.interface import StateHooks, StepPlan
from megatron_mecefo.elastic.latch import StepLatch
from megatron_mecefo.elastic.leaving import give_up, retire
from megatron_mecefo.elastic.marks import HostMarks
from megatron_mecefo.elastic.membership import Membership
from megatron_mecefo.elastic.plan.costs import CostMeter
from megatron_mecefo.elastic.plan.cover_plan import CoverPlan
from megatron_mecefo.elastic.plan.topology import CoverMap, Grid
from megatron_mecefo.elastic.rebalancing import Rebalancing
from megatron_mecefo.elastic.regrouping import Regrouping
from megatron_mecefo.errors import GaveUp, StoreLost
from megatron_mecefo.log import EventLog, RankPrefix
from megatron_mecefo.version import __version__

__all__ = ["ElasticRuntime", "StateHooks", "StepPlan"]

logger = logging.getLogger(__name__)


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
                 micro_batches: int = 1, state: Optional[StateHooks] = None, sharding=None,
                 injector: Optional[FaultInjector] = None, costs: Optional[CostMeter] = None,
                 backend: str = "gloo") -> None:
        rank, world = job.rank, job.world
        if world % (tensor_parallel * pipeline_parallel):
            raise ValueError(f"a world of {world} ranks is not divisible by tensor_parallel ({tensor_parallel}) x "
                             f"pipeline_parallel ({pipeline_parallel})")
        if config.enable and config.basis == "gradient" and sharding is not None:
            raise ValueError('mecefo "basis": "gradient" needs every weight\'s aggregated gradient on every rank; '
                             "a sharded optimizer (ZeRO stage 1, --use-distributed-optimizer) reduces each rank's "
                             'range only: use "weight" or "activation" there')
        # bad input fails before the store is touched
        self.injector = injector or FaultInjector.for_job(config, job, model_parallel=tensor_parallel * pipeline_parallel)
        self.cfg, self.rank, self.world, self.incarnation, self.k = config, rank, world, job.incarnation, micro_batches
        self.grid = Grid(tp=tensor_parallel, pp=pipeline_parallel, dp=world // (tensor_parallel * pipeline_parallel))
        self.now = Current(rank=rank, grid=self.grid, k=micro_batches)
        """Where this rank stands: generation, members, group, step (current.py)."""
        self.sharding, self.rejoined = sharding, False
        self.log = RankPrefix(logger, lambda: {"generation": self.now.generation, "rank": rank, "step": self.now.step})
        store, self.job_id = job_store.attach(job.master_addr, job.master_port, rank=rank, incarnation=job.incarnation,
                                              job_id=job.job_id, timeout=timedelta(seconds=config.agree_timeout_s))
        self.store = job_store.CountingStore(store)  # each step record says how many calls its step made
        hb_timeout = timedelta(seconds=max(10.0, config.heartbeat_timeout_s))
        self.membership = Membership(
            self.store, lambda: job_store.job_store(job_store.client(job.master_addr, job.master_port, hb_timeout),
                                                    self.job_id), rank,
            heartbeat_interval_s=config.heartbeat_interval_s, heartbeat_timeout_s=config.heartbeat_timeout_s,
            agree_timeout_s=config.agree_timeout_s, whole=self.grid.whole,
        )
        self.store_health = job_store.StoreHealth(f"{job.master_addr}:{job.master_port}",
                                                  lambda: self.membership.heartbeat.lost_since, self.log)
        self.events = EventLog(os.path.join(config.log_dir, f"events_rank{rank}.jsonl") if config.log_dir else None,
                               rank=rank)
        self.steps_log = EventLog(os.path.join(config.log_dir, f"steps_rank{rank}.jsonl") if config.log_dir else None,
                                  rank=rank)
        self.injector.events = self.events
        self.marks = HostMarks(self.store, self.now, self.membership)
        """The host's marks in the job's store (marks.py)."""
        self._costs = costs or CostMeter()
        self._rebalancing = Rebalancing(
            self.now, threshold=config.rebalance_threshold, window=config.rebalance_window,
            retire_above=config.retire_slower_than, replica_min=lambda flags: self._committer.replica_min(flags),
            events=self.events, log=self.log,
            may_retire=sharding is None or config.shard_redundancy == "neighbour") if config.rebalance else None
        self.latch = StepLatch(group=lambda: self.now.group, fold=lambda: self.now.plan.fold, fire=self._fire,
                               aborted=lambda: self._committer.step_aborted(), issued=self.now.micro_batches_run,
                               costs=self._costs, computed=lambda: self.injector.stretch(self.now.step),
                               speeds=self._rebalancing, log=self.log)
        """The step in progress, as the step's reduction sees it (latch.py)."""
        state = state or StateHooks()
        self._formation = Formation(config, self.grid, rank, self.store, self.membership, self.injector, self.events,
                                    self.log, micro_batches=micro_batches, sharding=sharding, get_state=state.get,
                                    backend=backend, costs=self._costs)
        self._regrouping = Regrouping(self.now, self._formation, self.membership, self.latch, set_state=state.set,
                                      events=self.events, log=self.log, cover=config.cover,
                                      collective_timeout_s=config.collective_timeout_s,
                                      join_deadline=time.monotonic() + config.join_timeout_s)
        self._committer = Committer(self.now, world=world, sharding=sharding, store=self.store,
                                    store_health=self.store_health, membership=self.membership, latch=self.latch,
                                    regrouping=self._regrouping, fire=self._fire, device=self._device,
                                    steps_log=self.steps_log, events=self.events, log=self.log)
        self._checkpoint = GiveUpCheckpoint(self.store, self.grid, rank, save=state.save_checkpoint,
                                            save_shards=state.save_shards, sharding=sharding, log=self.log,
                                            wait_s=config.collective_timeout_s,
                                            position_barrier=self._committer.position_barrier)

    # the standing, as hosts and tests read it
    step = property(lambda self: self.now.step)
    generation = property(lambda self: self.now.generation)
    members = property(lambda self: self.now.members)
    group = property(lambda self: self.now.group)

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
            self.now.step = step
        nccl = nccl_env.version_record(self._formation.backend, log=self.log.warning)  # the version, its known hangs
        self.events.write("started", version=__version__, incarnation=self.incarnation, backend=self._formation.backend,
                          nccl_env=nccl_env.recorded(), **nccl)  # what this process's NCCL runs with (nccl_env.py)
        step = self._guarded(self._start)
        self.rejoined = self._regrouping.rejoined
        mark_started()
        return step

    def _start(self) -> int:
        self.store.add("mecefo/world", 0)
        self.store.compare_set("mecefo/world", "0", str(self.world))
        self.membership.start()
        return self._regrouping.join(self.incarnation, self.world)

    def close(self, finished: bool = True) -> None:
        """Leave the job. `finished`: training is complete, so ranks still waiting to rejoin stop."""
        if finished:
            try:
                self.store.set("job/finished", "1")
            except Exception:
                pass
        self.membership.stop()
        try:
            self._regrouping.drop_group()
        except groups.AbortHung as e:  # leaving anyway
            self.log.warning("%s", e)

    # -- the step protocol ------------------------------------------------------------------------

    def begin_step(self, step: int) -> None:
        """Start (or redo) `step`. Admits pending joiners first (a step boundary).

        Raises:
            GaveUp: the job cannot go on (exit with GAVE_UP_EXIT_CODE).
        """
        self.now.step = step
        self._guarded(self._regrouping.admit_pending)
        if self._rebalancing is not None:
            self._rebalancing.at_boundary()
        holds.wait_for_holds(self.injector.holds(self.now.step), self.now.step, self.membership,
                             self.cfg.join_timeout_s, self.events, self.log)
        self.latch.reset()
        self.now.issued = ()
        self._committer.begin(time.monotonic())
        self.membership.votes.watch(self.now.generation, self.now.step)
        self._costs.begin()
        self.injector.begin()

    def plan(self) -> StepPlan:
        """This rank's micro-batches in the current step (own, then adopted), with the divisors."""
        now = self.now
        fold = now.plan.fold
        now.issued = mbs = fold.micro_batches(now.replica)
        return StepPlan(step=now.step, generation=now.generation, members=tuple(now.members), cover=now.cover,
                        micro_batches=mbs, divisor=fold.divisor, divisor_mha=fold.divisor_mha)

    def commit(self, **record: Any) -> bool:
        """Agree on this step (committing.py). True: every member takes the optimizer step. False: a
        peer failed, the survivors regrouped (a new generation), and the step must be redone.

        Raises:
            GaveUp: the failure cannot be absorbed; a checkpoint was written if possible (exit with
                GAVE_UP_EXIT_CODE).
        """
        committed = self._guarded(self._committer.commit, record)
        if committed and self._rebalancing is not None:
            self._rebalancing.committed(self.latch.speeds)
        return committed

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
        self.events.write("gather_failed", step=self.now.step, error=str(error).splitlines()[0][:200])
        self.now.step += 1
        self.membership.votes.abort(self.now.generation, self.now.step)  # a member already in the next step stops
        self._guarded(self._regrouping.recover)

    def cover_map(self) -> CoverMap:
        """The current generation's cover map."""
        return self.now.cover

    def cover_plan(self) -> CoverPlan:
        """The current generation's plan: who runs which micro-batch (`.text()` for a log line)."""
        return self.now.plan

    def leads(self) -> bool:
        """This rank's replica is the lowest live one: it saves (upstream's files) and logs."""
        return self.now.leads()

    def replica_collectives(self, step: int):
        """A block of collectives inside this rank's replica (comm/replica.py `replica_collectives`)."""
        return replica_collectives(self.grid.tp * self.grid.pp, self.rank, step, self.events)

    def _fire(self, phase: str, step: Optional[int] = None) -> None:
        """An injection point of the current step (or of `step`)."""
        self.injector.maybe_fire(self.now.step if step is None else step, phase)

    def _device(self):
        return torch.device("cuda", torch.cuda.current_device()) if self._formation.backend == "nccl" \
            else torch.device("cpu")

    # -- giving up --------------------------------------------------------------------------------

    def _guarded(self, fn: Callable, *args: Any) -> Any:
        try:
            return fn(*args)
        except groups.AbortHung as e:
            # its group's abort never returned: it cannot be trusted to build another communicator
            retire(self.events, self.rank, self.now.generation, self.now.members, str(e), reason=str(e))
        except GaveUp as e:
            self._give_up(e)
            raise
        except STORE_ERRORS as e:
            # the store failed under a call only a failure or an admission makes (a recovery, a group
            # formation): with no agreed writer, the checkpoint is written only if the store answers
            self.store_health.failed(e)
            lost = StoreLost(f"{self.store_health.message(self.now.step, at_commit=False)} ({e})", writer=None)
            self._give_up(lost)
            raise lost from e

    def _give_up(self, error: GaveUp) -> None:
        now = self.now
        give_up(error, checkpoint=self._checkpoint, membership=self.membership, events=self.events, log=self.log,
                step=now.step, generation=now.generation, members=now.members, has_state=now.has_state)
        self.close(finished=False)
