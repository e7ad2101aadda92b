"""StepDriver: the one MeCeFO training step, for every host. Read this file first.

Every host (the DeepSpeed engine wrapper, Megatron-DeepSpeed's `train_step`, Megatron-LM's
`train_step`, a user's own loop) joins the job through `attach.attach` (the composition root) and
runs the same sequence, which lives here:

    driver.begin(step)                    # admit joiners, the plan (own + adopted micro-batches), record
    for mb in plan.micro_batches:
        with driver.forward(mb):          # "forward" injection, covering mode for an adopted/covering mb
            out = model(...)
        driver.backward_point(out)        # "backward" injection inside this micro-batch's backward
        ...backward...                    # buckets plugged into driver.reduction may launch here
    driver.finish(loss_sum=..., loss_count=..., micro_batches=n, averaged_over=a)
        # gradients reduced across replicas with MeCeFO's divisors (reduction.py), the job's commit;
        # then, only on a committed step, the host's optimizer step ("optimizer" injection first);
        # otherwise the gradients are zeroed and the step is redone by the new generation

`run(step, body)` is the redo loop for hosts that own one (torchft's `OptimizerWrapper`: the
optimizer steps only `if should_commit()`). A host fills `Host`: which module is covered, which
tensors hold the gradients (`grad` or Megatron's `main_grad` buffers), how its optimizer steps. What
the runtime sends a rejoining rank is `training_state(...)` of the host's parts.

When a peer dies in the middle of a step (say rank 3, in the backward of a Megatron-LM step;
D replicas of T * P ranks each):

1. Detection (nothing blocks for long). The reduction's collective fails: gloo raises "connection
   closed" within a fraction of a second of a SIGKILL, and a hung (SIGSTOPped) peer makes it time
   out after `collective_timeout_s`. `Reduction` (reduction.py) latches the error in the runtime
   (`runtime.latch`, latch.py); the step's later collectives are skipped. A rank that is not in a
   failing collective learns it from its heartbeat thread, which watches the step's failure mark
   (`StepLatch.step_aborted`, no store call of its own); the launcher marks a crashed rank's
   heartbeat at once, and a rank is presumed failed once its counter stalls for
   `heartbeat_timeout_s` (membership/liveness.py). A failed collective inside the replica (T or
   P > 1) raises ReplicaLost (`replica_collectives`): rank 3's replica mates leave the job (exit 4)
   to rejoin together.
2. No commit. `finish` still calls `runtime.commit()` (committing.py): a member commits only where the step's
   confirmation all-reduce completed (every member reduced), which a dead rank prevents; a
   sharded optimizer state is voted in the store instead (membership/commit.py). Nobody steps
   the optimizer (replicas stay bit-identical); `finish` zeroes the gradients and returns False.
   The adapter's half: in Megatron-LM `finish` runs inside upstream's `optimizer.step()`, whose
   gate then returns upstream's skipped update (no scheduler step), and the host redoes the step;
   the own loop and Megatron-DeepSpeed redo it inside `run` before `train_step` returns.
   A member whose confirmation failed after the others' completed keeps its gradients, and commits
   the step late when the agreement says a member did.
3. Agreement (`Regrouping.recover`, regrouping.py and membership/agreement.py): the survivors destroy the generation's
   group and check in for generation g+1; the first to check in publishes the members. A failure
   during the agreement restarts it, not the job.
4. Regroup (formation.py, `Formation.form`): a data-parallel group per (tp, pp) position over the store's
   `gen{g+1}` prefix (groups.py); a sharded optimizer state re-sharded over the survivors from the
   neighbour copies (zero.py); the new cover map (topology.ring_cover: rank 3's replica's ring
   neighbour adopts it) and plan (cover_plan.py, from the costs the members posted with their
   check-in, costs.py: which micro-batches each replica runs, in which mode, and the divisors;
   "neighbour" or "spread"). No neighbour left, or a shard lost with its copy: GaveUp, a
   checkpoint of the last committed step and exit 3 (errors.run_to_exit).
5. Redo. `run` (or the host's own loop, whose step counter did not move) begins the same step:
   `begin` hands out the new plan, the replicas run their own and adopted micro-batches, the
   covering ones in covering mode (approx/), and the step commits with every sample of the global
   batch once.
6. Rejoin. The launcher restarts rank 3's replica; it asks to join, a later commit admits it at a
   step boundary, the next `begin` forms the generation with it and a member sends it the training
   state (transfer.py); its neighbour stops covering.

It knows micro-batches and gradients, not layers: covering mode is set through approx.mode.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Dict, Iterable, Iterator, Optional, Tuple, TypeVar

import torch

from megatron_mecefo.approx.mode import CoverPolicy, covering
from megatron_mecefo.approx.projector import observe_gradients
from megatron_mecefo.config import MeCeFOConfig
from megatron_mecefo.elastic.launch.bootstrap import param_digest
from megatron_mecefo.elastic.plan.fold import MicroBatch, micro_batch_policy
from megatron_mecefo.elastic.reduction import Reduction
from megatron_mecefo.elastic.interface import StepPlan
from megatron_mecefo.elastic.runtime import ElasticRuntime
from megatron_mecefo.rng import rng_state, set_rng_state
from megatron_mecefo.version import __version__

__all__ = ["Host", "StepDriver", "DrivenHost", "training_state"]

T = TypeVar("T")
GetSet = Tuple[Callable[[], Any], Callable[[Any], None]]


@dataclasses.dataclass
class Host:
    """What a host's step looks like to the driver."""

    module: torch.nn.Module
    """The model (covering mode is set on it; its parameters are hashed for the step record)."""
    parameters: Callable[[], Iterable[torch.nn.Parameter]]
    """The trainable parameters whose gradients are reduced across replicas."""
    optimizer_step: Callable[[], Any]
    """The host's optimizer step; called only on a committed step (its result: `driver.optimizer_result`)."""
    zero_grad: Callable[[], None]
    """Drop the gradients of an aborted step (it is redone)."""
    grad_attr: str = "grad"
    """Where the gradients are: "grad", or "main_grad" (Megatron's DDP buffers, reduced in place)."""
    lr: Callable[[], Optional[float]] = lambda: None
    """The learning rate, for the step record."""
    before_optimizer: Optional[Callable[[], None]] = None
    """Runs before the optimizer step of a committed step (clipping over a replica's model-parallel ranks)."""


def training_state(module: GetSet, optimizer, scheduler=None, counters: Optional[GetSet] = None) -> GetSet:
    """(get, set) of what a rejoining rank receives: the module (its own (get, set): legacy Megatron
    models load only their save format), the optimizer, the scheduler, the RNG states and the host's
    counters (plain data). For `ElasticRuntime(state=...)`."""

    def get() -> Dict[str, Any]:
        return {"module": module[0](), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict() if scheduler is not None else None, "rng": rng_state(),
                "counters": counters[0]() if counters else None}

    def set_(state: Dict[str, Any]) -> None:
        module[1](state["module"])
        optimizer.load_state_dict(state["optimizer"])
        if scheduler is not None and state["scheduler"] is not None:
            if hasattr(scheduler, "num_steps"):
                # Megatron's OptimizerParamScheduler adds the loaded count to its own
                # (`step(increment=num_steps)`); a restarted rank that loaded --load before it
                # joined would count the checkpoint's steps twice (its learning rate then decays
                # too early): the peer's count replaces them
                scheduler.num_steps = 0
            scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])
        if counters:
            counters[1](state["counters"])

    return get, set_


class StepDriver:
    """Drives the runtime through one step for a host (see the module docstring)."""

    def __init__(self, runtime: ElasticRuntime, cfg: MeCeFOConfig, host: Host, *, micro_batch_size: int,
                 live_microbatches: int = 1, sharding=None) -> None:
        self.runtime = runtime
        self.cfg = cfg
        self.host = host
        self.micro_batch_size = micro_batch_size
        self.recompute_note = cfg.recompute_note(live_microbatches=live_microbatches)
        self._live_microbatches = live_microbatches
        runtime.events.write("config", recompute=self.recompute_note)
        self.plan: Optional[StepPlan] = None
        """The plan of the step in progress (None between steps)."""
        self.last_loss: Optional[float] = None
        """The job's loss of the last committed step (every replica's micro-batches)."""
        self.last_committed = False
        self.committed = runtime.step
        """Steps committed so far (the iteration upstream logs after a step): the same on every replica."""
        self.optimizer_result: Any = None
        self._observed = False
        self.record_extra: Dict[str, Any] = {}
        """Extra fields for this step's record in steps_rank{R}.jsonl."""
        self.reduction = Reduction(runtime.latch, sharding=sharding)
        """The step's reduction across replicas; a host that overlaps it plugs its buckets in here."""

    @property
    def step(self) -> int:
        return self.runtime.step

    def samples_of_other_replicas(self) -> int:
        """What a committed step consumed beyond one replica's micro-batches: (D - 1) x micro-batch
        size x k, run by the other replicas or by this one covering. Megatron's train() counts the
        one replica it sees (its data-parallel size is 1 here); the host adds this."""
        return (self.runtime.grid.dp - 1) * self.micro_batch_size * self.runtime.k

    def save_shards(self, directory: str, iteration: int, *, collect: bool = True) -> Optional[tuple]:
        """Every rank's part of a checkpoint with a sharded optimizer state, at upstream's save of
        `iteration`: its shard under `directory`, stamped with this save (job, generation,
        iteration). On the lead replica, returns the whole state once the owners' shards of the
        same stamp cover it (`ShardedOptimizer.collect`), for the host to write in its upstream
        format; None elsewhere, without `collect` (the host's format cannot hold it), or when they
        do not within the collective timeout (the shard files stay: MeCeFO resumes from them)."""
        rt, sharding = self.runtime, self.reduction.sharding
        stamp = f"{rt.job_id}:{rt.generation}:{iteration}"
        sharding.files.save(directory, copies=False, stamp=stamp)
        if not (collect and rt.leads()):
            return None
        return sharding.files.collect(directory, stamp, self.cfg.collective_timeout_s, rt.log)

    # -- the sequence -----------------------------------------------------------------------------

    def begin(self, step: int) -> StepPlan:
        """Start (or redo) `step`: admit joiners at the boundary, and return this rank's plan."""
        self.runtime.begin_step(step)
        self.plan = self.runtime.plan()
        self.optimizer_result = None
        self._ran, self._loss_sum = 0, 0.0  # this pass's, for hosts that run one micro-batch at a time
        self.reduction.record.clear()  # this pass's
        if self.cfg.log_param_hash:  # replicas must be bit-identical at the start of every step
            self.record_extra["param_sha256"] = param_digest(self.host.module)
        return self.plan

    # -- one micro-batch at a time: hosts whose loop calls forward, backward and step per micro-batch

    def begun(self, step: int) -> StepPlan:
        """The plan of the pass in progress; begins `step` if no pass is (the first forward of a step).
        A redo (`run`, or a failed `finish`) begins a new pass, and the count starts again."""
        if self.plan is None:
            self.begin(step)
        return self.plan

    @property
    def micro_batch(self) -> MicroBatch:
        """The micro-batch the host runs next in this pass."""
        return self.plan.micro_batches[self._ran]

    def backward_begins(self) -> None:
        """Before the backward of `micro_batch`: the "backward" injection point, and the overlapped
        buckets (if a host plugged `.grad` buckets in) armed for the pass's last micro-batch only."""
        buckets = self.reduction.overlap
        if buckets is not None:
            if self._ran == len(self.plan.micro_batches) - 1:
                buckets.arm()
            else:  # an earlier one (also of a pass redone after a failure in the last backward)
                buckets.disarm()
        self._fire("backward")

    def micro_batch_done(self, loss: float) -> Optional[Tuple[float, int]]:
        """`micro_batch` ran with this loss. At the pass's last: (the pass's summed loss, micro-batches
        run), and the host calls `finish`; None before."""
        self._ran, self._loss_sum = self._ran + 1, self._loss_sum + loss
        return (self._loss_sum, self._ran) if self._ran == len(self.plan.micro_batches) else None

    def _policy(self, mb: MicroBatch) -> Optional[CoverPolicy]:
        """The covering policy of micro-batch `mb` (None: the exact backward)."""
        if not (mb.covering and self.cfg.enable):
            return None
        return micro_batch_policy(self.cfg.cover_policy(self.runtime.step, live_microbatches=self._live_microbatches), mb)

    def _fire(self, phase: str) -> None:
        """An injection point of the step (forward | backward | optimizer)."""
        self.runtime.latch.fire(phase)

    @contextlib.contextmanager
    def forward(self, mb: MicroBatch, module: Optional[torch.nn.Module] = None) -> Iterator[None]:
        """Run micro-batch `mb`'s forward in the block: in covering mode where the plan says so."""
        self._fire("forward")
        with covering(module if module is not None else self.host.module, self._policy(mb)):
            yield

    def backward_point(self, output: Any) -> None:
        """The "backward" injection point inside the backward of the micro-batch whose output this is
        (for hosts whose schedule runs the backward). A tuple's first tensor that requires grad."""
        if isinstance(output, (tuple, list)):
            output = next((t for t in output if isinstance(t, torch.Tensor) and t.requires_grad), None)
        if isinstance(output, torch.Tensor) and output.requires_grad:
            fire = self.runtime.latch.fire
            output.register_hook(lambda grad: fire("backward"))

    def replica_collectives(self):
        """The block's collectives inside this rank's replica retire the replica when they fail."""
        return self.runtime.replica_collectives(self.runtime.step)

    def finish(self, *, loss_sum: float, loss_count: float, micro_batches: int, averaged_over: int = 1) -> bool:
        """The step's end, after the plan's micro-batches: reduce, agree, and (committed) step.

        Args:
            loss_sum, loss_count: this rank's loss summed over what it counts (micro-batches, or
                tokens) and that count; the job's loss is sum over sum.
            micro_batches: how many micro-batches this rank ran (the commit refuses a step whose
                members did not run the whole global batch).
            averaged_over: the host's schedule divided each micro-batch's gradient by this many
                (Megatron's schedules: the number of micro-batches); 1 when gradients are sums.
                Buckets reduced during the backward were given theirs when armed.

        Returns:
            True when the optimizer step was taken; False: a peer failed and the step is redone.
        """
        plan = self.plan
        total_loss, total_count, samples = self.reduction.reduce(
            self.host.parameters(), stats=[loss_sum, loss_count, micro_batches * self.micro_batch_size],
            micro_batches=micro_batches, attr=self.host.grad_attr, averaged_over=averaged_over)
        loss = total_loss / total_count if total_count else None
        self.plan = None
        committed = self.runtime.commit(loss=loss, samples=int(samples), lr=self.host.lr(), **self.record_extra,
                                        **self.reduction.record)
        self.last_committed = committed
        if not committed:
            self.host.zero_grad()
            return False
        self.last_loss = loss
        self.committed = plan.step + 1
        if self.cfg.enable and self.cfg.lowrank_ffn and self.cfg.basis == "gradient":  # every rank holds the aggregate now
            n = observe_gradients(self.host.module, self.cfg.cover_policy(plan.step, live_microbatches=self._live_microbatches),
                                  plan.step, exact=not plan.degraded, grad_attr=self.host.grad_attr)
            if n and not self._observed:  # once: which weights follow their gradient
                self._observed = True
                self.runtime.events.write("gradient_basis", step=plan.step, weights=n)
        self._fire("optimizer")
        if self.host.before_optimizer is not None:
            with self.runtime.replica_collectives(plan.step):
                self.host.before_optimizer()
        self.optimizer_result = self.host.optimizer_step()
        self.runtime.after_optimizer_step()  # a peer that died after the commit: regroup now
        return True

    def run(self, step: int, body: Callable[[StepPlan], T]) -> T:
        """Run `step` until it is committed: `body(plan)` runs the plan's micro-batches and calls
        `finish` (directly or through the host's optimizer); a failed step is redone by the
        survivors with their new plan. Returns the last `body`'s result; a body that returns
        without finishing (the host skipped its optimizer step) ends the loop too."""
        while True:
            self.last_committed = False
            plan = self.begin(step)
            with self.runtime.replica_collectives(step):
                out = body(plan)
            if self.last_committed or self.plan is not None:
                self.plan = None
                return out

    def banner(self, iteration: int) -> str:
        """The start-up lines a host prints once, on its lead rank (not on a rank that rejoined)."""
        rt, z = self.runtime, self.reduction.sharding
        lines = [f" mecefo {__version__}: job {rt.job_id} | {self.recompute_note} | starting at iteration {iteration}"]
        if z is not None:
            lines.append(f" mecefo: optimizer state sharded over {len(z.layout.live)} replicas (shard_redundancy="
                         f"{self.cfg.shard_redundancy}): {z.nbytes() / 2**20:.2f} MiB on this rank, replicated "
                         f"{z.replicated_nbytes() / 2**20:.2f} MiB ({z.numel:,} parameters, "
                         f"{'fp32 masters in the shards' if z.masters else 'fp32'})")
        return "\n".join(lines)

    def close(self, finished: bool = True) -> None:
        self.runtime.close(finished=finished)


class DrivenHost:
    """Base of the host wrappers: what the training loops read of the last step (`self.driver`)."""

    driver: StepDriver

    @property
    def last_loss(self) -> Optional[float]:
        """The job's loss of the last committed step."""
        return self.driver.last_loss

    @property
    def last_committed(self) -> bool:
        return self.driver.last_committed
