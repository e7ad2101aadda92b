"""Joining a MeCeFO job before any framework starts: torch.distributed over this rank's replica,
on the job's store (shared by the DeepSpeed hook and the Megatron integrations)."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sys
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from megatron_mecefo.config import LaunchEnv
from megatron_mecefo.elastic.comm import nccl_env
from megatron_mecefo.elastic.comm import store as job_store
from megatron_mecefo.elastic.comm.replica import replica_round, watch_replica
from megatron_mecefo.elastic.membership import OrphanWatch
from megatron_mecefo.elastic.plan.topology import Grid
from megatron_mecefo.errors import GaveUp
from megatron_mecefo.log import EventLog

__all__ = ["init_distributed", "replica_grid", "param_digest"]


_JOB: Optional[LaunchEnv] = None


def init_distributed(backend: str = "gloo", tensor_parallel: int = 1, pipeline_parallel: int = 1,
                     timeout_s: float = 60.0, join_timeout_s: float = 900.0, heartbeat_timeout_s: float = 5.0,
                     log_dir: Optional[str] = None, restart_failed_after: Optional[float] = None,
                     max_restarts: int = 3, store: Optional[str] = None) -> LaunchEnv:
    """Initialise torch.distributed over this rank's replica only: its tensor_parallel x
    pipeline_parallel ranks (a world of one with tp = pp = 1). Call Megatron's
    `initialize_model_parallel(tensor_parallel, pipeline_parallel)` afterwards, as usual.

    Ranks are placed in Megatron's default order (tp-cp-ep-dp-pp): global rank
    tp + T * (dp + D * pp); inside the replica, rank tp + T * pp. A restarted replica forms a new
    group once all its ranks are up again (replica.py). `join_timeout_s` is how long a rank waits
    for its replica's other ranks (and the default group's timeout); pass `timeout_s` to
    `init_model_parallel` too: it bounds the tensor- and pipeline-parallel collectives. A restarted
    rank waiting for its mates gives up (StateLost) once no rank holding the state has been alive
    for `heartbeat_timeout_s` (its mates may hang, and nobody is left to admit the replica); the
    give-up is recorded in `log_dir`'s events_rank{R}.jsonl.

    Under mecefo-launch the job's store is the launcher's. Under another launcher (deepspeed,
    torchrun, srun, by hand) this process becomes the rank's keeper (elastic/launch/keeper.py): it finds or
    starts the job's store (`store`: HOST:PORT of a mecefo-store), runs the training in a child that
    re-enters here as under mecefo-launch, restarts it `restart_failed_after` seconds after a crash
    (at most `max_restarts` times; None: never), and exits with the job; it never returns.
    Returns the launch environment the runtime needs (with the job's id).

    Raises:
        JobConflict: MASTER_PORT is held by another job's store (a rerun while the store of the
            previous run lingers): exit with USAGE_EXIT_CODE, the message says what to do.
        ValueError: the world is not a multiple of tensor_parallel x pipeline_parallel.
    """
    global _JOB
    if _JOB is not None:  # initialize() calls it again
        return _JOB
    env = LaunchEnv.read()
    grid = replica_grid(env.world, tensor_parallel, pipeline_parallel)
    # NCCL's recovery settings, before any process group exists: already in the environment when
    # mecefo-launch or the keeper started this process (they reported unsafe values), except the
    # rows that follow the collective timeout, which only this process knows
    nccl_env.apply(log=lambda w: print(f"[mecefo] warning: {w}", file=sys.stderr), collective_timeout_s=timeout_s,
                   launcher_reported=env.mecefo_launcher)
    if not env.mecefo_launcher:
        from megatron_mecefo.elastic.launch.keeper import keep

        keep(env, restart_failed_after=restart_failed_after, max_restarts=max_restarts, store=store)
    raw = job_store.client(env.master_addr, env.master_port, timedelta(seconds=300))
    info = job_store.read_job(raw, f"{env.master_addr}:{env.master_port}", env.job_id)
    env = dataclasses.replace(env, job_id=info["id"])
    if not dist.is_initialized():
        tp_rank, pp_rank, replica = grid.coords(env.rank)
        local, size = tp_rank + grid.tp * pp_rank, grid.tp * grid.pp
        owners, jstore = [], job_store.job_store(raw, env.job_id)
        orphan = None
        if size > 1 and env.incarnation > 0:  # waiting for restarted mates: give up if nobody holds the state
            orphan = OrphanWatch(jstore, env.rank, heartbeat_timeout_s).check
        try:
            store = replica_round(jstore, replica=replica, local_rank=local, size=size, incarnation=env.incarnation,
                                  rank=env.rank, timeout_s=join_timeout_s, owners=owners, while_waiting=orphan)
        except GaveUp as e:  # recorded like the runtime's give-ups (no runtime exists yet)
            if log_dir:
                EventLog(os.path.join(log_dir, f"events_rank{env.rank}.jsonl"), rank=env.rank).write(
                    "gave_up", kind=type(e).__name__, reason=str(e).splitlines()[0], generation=None, step=None,
                    members=[], has_state=False, checkpoint=None)
            raise
        watch_replica(lambda: job_store.job_store(job_store.client(env.master_addr, env.master_port, timedelta(seconds=60)),
                                                  env.job_id), owners, env.rank, env.mecefo_launcher)
        # the default group waits out start-up skew (imports, data); the tensor- and pipeline-parallel
        # groups that carry the training collectives get timeout_s (init_model_parallel)
        dist.init_process_group(backend, store=store, rank=local, world_size=size,
                                timeout=timedelta(seconds=max(timeout_s, join_timeout_s)))
    _JOB = env
    return env


def replica_groups_time_out(timeout_s: float) -> None:
    """Every torch process group of this replica times out after `timeout_s` from now on. The
    default group waits out the replicas' start-up skew (`init_distributed`: one replica builds the
    dataset indexes while the others wait for its lock), and upstream code creates groups inside a
    replica without a timeout (Megatron-DeepSpeed's parallel_state; DeepSpeed's pipeline engine
    sends and receives on the default group): torch's default is 30 minutes for gloo. Once the rank
    trains, a rank hung in any of them must fail its mates' collectives within the collective
    timeout (they then leave with the replica). The runtime's own groups are not torch's."""
    from torch.distributed import distributed_c10d as c10d

    for group in list(c10d._world.pg_map):
        if not c10d._rank_not_in_group(group):
            c10d._set_pg_timeout(timedelta(seconds=timeout_s), group)


def replica_grid(world: int, tensor_parallel: int, pipeline_parallel: int) -> Grid:
    """The job's (tp, pp, dp) grid. Raises ValueError when the world does not divide."""
    if tensor_parallel < 1 or pipeline_parallel < 1 or world % (tensor_parallel * pipeline_parallel):
        raise ValueError(f"the world of {world} ranks is not divisible by tensor-model-parallel size "
                         f"({tensor_parallel}) x pipeline-model-parallel size ({pipeline_parallel})")
    return Grid(tp=tensor_parallel, pp=pipeline_parallel, dp=world // (tensor_parallel * pipeline_parallel))


def param_digest(module: torch.nn.Module) -> str:
    """SHA-256 of the module's parameters, in order (bit-level: equal digests = identical replicas)."""
    h = hashlib.sha256()
    for p in module.parameters():
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
