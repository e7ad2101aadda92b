"""The composition root: one rank joins a MeCeFO job, the same way for every host.

    driver = attach(cfg, job, host, micro_batches=k, micro_batch_size=b, state=StateHooks(...),
                    current_step=lambda: engine.global_steps, sharding=shards, load_shards=tag)
    if lead_rank and not driver.runtime.rejoined:
        print(driver.banner(iteration), flush=True)

It builds the rank's injector (rules and the laid-out trace) and runtime, loads the sharded
optimizer state of a checkpoint (first incarnations only: a restarted rank takes the live state
from a peer), joins the job (`ElasticRuntime.start`: generation 0, or a rejoin at a step boundary)
and returns the host's StepDriver. The hosts (deepspeed_hook/engine.py, integrations/, the toy
job) build only what is theirs: the Host, the state hooks, their optimizer's ShardedOptimizer.
"""

from __future__ import annotations

from typing import Callable, Optional

from megatron_mecefo.config import LaunchEnv, MeCeFOConfig
from megatron_mecefo.elastic.comm.groups import default_backend
from megatron_mecefo.elastic.faults.inject import FaultInjector
from megatron_mecefo.elastic.interface import StateHooks
from megatron_mecefo.elastic.runtime import ElasticRuntime
from megatron_mecefo.elastic.step import Host, StepDriver

__all__ = ["attach"]


def attach(cfg: MeCeFOConfig, job: LaunchEnv, host: Host, *, micro_batches: int, micro_batch_size: int,
           state: StateHooks, current_step: Callable[[], int], tensor_parallel: int = 1, pipeline_parallel: int = 1,
           sharding=None, load_shards: Optional[str] = None, train_iters: Optional[int] = None,
           backend: Optional[str] = None) -> StepDriver:
    """Join the job as `host`; returns its StepDriver once this rank holds the job's state.

    Args:
        cfg, job: the validated MeCeFOConfig and this rank of the job (`bootstrap.init_distributed`).
        host: the host's step (elastic/step.py `Host`).
        micro_batches, micro_batch_size: k per replica per step, and the samples in each.
        state: what a rejoining rank receives and the give-up checkpoint (interface.StateHooks).
        current_step: () -> the step the host's counters are at (after its `--load`); after the
            start the runtime's step must equal it (a restarted rank's counters come from a peer).
        tensor_parallel, pipeline_parallel: T and P of a replica.
        sharding: the host optimizer's ShardedOptimizer (zero.py), or None (replicated state).
        load_shards: a checkpoint directory holding shard files to start from (None: the state the
            host loaded, or a fresh one).
        train_iters: the job's length (lays out config.trace).
        backend: the runtime groups' backend (None: NCCL with CUDA, else gloo).

    Raises:
        ValueError: injection rules or a trace that cannot run as written, before the store is touched.
        GaveUp / JobFinished: the job cannot go on, or ended before a restarted rank came back.
    """
    injector = FaultInjector.for_job(cfg, job, model_parallel=tensor_parallel * pipeline_parallel,
                                     train_iters=train_iters)
    runtime = ElasticRuntime(cfg, job, tensor_parallel=tensor_parallel, pipeline_parallel=pipeline_parallel,
                             micro_batches=micro_batches, state=state, sharding=sharding, injector=injector,
                             backend=backend or default_backend())
    if sharding is not None and load_shards is not None and job.incarnation == 0:
        sharding.load(load_shards)
    step = runtime.start(current_step())
    if step != current_step():
        raise RuntimeError(f"the runtime's step {step} != the host's step {current_step()} after joining the job")
    return StepDriver(runtime, cfg, host, micro_batch_size=micro_batch_size, sharding=sharding)
