"""One MeCeFO training run inside upstream's `pretrain()`: the `Run` every hook of that run is
given, torch.distributed over the rank's replica, and the call that runs `pretrain()` with the
host's patches applied and a job MeCeFO cannot continue ended with the launcher's exit codes."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional, Sequence

from megatron_mecefo.integrations.patches import Patch, patched
from megatron_mecefo.integrations.usage import UsageError, usage_errors

__all__ = ["Run", "checked_config", "init_replica_then_upstream", "add_args", "host_pretrain"]


@dataclasses.dataclass
class Run:
    """A rank's MeCeFO state inside one upstream `pretrain()` call; made by `host_pretrain`."""

    cfg: Any = None
    """The MeCeFOConfig; None: --mecefo is off and every hook calls upstream unchanged."""
    job: Any = None
    """The LaunchEnv (with the job's id) once torch.distributed is up over the replica."""
    host: Any = None
    """The upstream objects the step driver runs (`.driver`): a MeCeFOEngine or a MegatronLMHost."""
    train_ds: Any = None
    """The training set (on tensor-parallel rank 0: the only rank that reads data upstream)."""
    dp: int = 1
    """The original data-parallel size (replicas)."""
    record: Any = None
    """The Record of upstream's log lines and writer calls (record.py)."""
    sharded: bool = False
    """The optimizer state is sharded over the replicas (elastic/sharding/zero.py)."""
    save_shards: Optional[Callable[[int], Any]] = None
    """(iteration) -> writes this rank's shards of a sharded optimizer state into the checkpoint
    upstream is saving (every rank, at every save); None: the state is replicated."""

    @property
    def active(self) -> bool:
        return self.cfg is not None

    @property
    def driver(self):
        """The StepDriver of this rank (None before the rank joined)."""
        return self.host.driver if self.host is not None else None

    def lead(self) -> bool:
        """This rank's replica is the lowest live one: it saves and logs."""
        return self.driver.runtime.leads()

    def close(self, finished: bool) -> None:
        if self.driver is not None:
            if finished and self.record is not None:  # a lead that died at the end: print what it had not
                self.record.finish(timeout_s=self.cfg.heartbeat_timeout_s + 1.0)
            self.driver.runtime.close(finished=finished)


def checked_config(read: Callable[[], Any], check: Callable[[Any, Any], None]):
    """The run's MeCeFOConfig (`read()`) with what the host refuses checked against it and the job
    (`check(cfg, job)`), before anything starts (bad input: UsageError); None without --mecefo."""
    from megatron_mecefo.config import LaunchEnv

    with usage_errors():
        cfg = read()
        if not cfg.enable:
            return None
        check(cfg, LaunchEnv.read())
    return cfg


def init_replica_then_upstream(run: Run, cfg, original: Callable, a, kw, *, args, backend: str,
                               **model_parallel) -> Any:
    """An adapter's `_initialize_distributed` with --mecefo: torch.distributed over this rank's
    replica (its tensor- and pipeline-parallel ranks) on the job's store, then upstream's own init
    (`original(*a, **kw)`), which builds its groups over the replica; `model_parallel`: more
    arguments of upstream's `initialize_model_parallel`, called here when upstream skips it (no
    device counted)."""
    from megatron_mecefo.elastic.launch.bootstrap import init_distributed

    run.job = init_distributed(backend, args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                               timeout_s=cfg.collective_timeout_s, join_timeout_s=cfg.join_timeout_s,
                               heartbeat_timeout_s=cfg.heartbeat_timeout_s, log_dir=cfg.log_dir,
                               restart_failed_after=cfg.restart_failed_after, max_restarts=cfg.max_restarts,
                               store=cfg.store)
    run.cfg, run.dp = cfg, args.data_parallel_size
    out = original(*a, **kw)
    from megatron.core import mpu

    if not mpu.model_parallel_is_initialized():
        mpu.initialize_model_parallel(args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                                      **model_parallel)
    return out


def add_args(parser):
    """Megatron's `extra_args_provider`: the `--mecefo*` flags (the same as examples/pretrain_gpt)."""
    from megatron_mecefo.config import MeCeFOConfig

    MeCeFOConfig.add_cli_args(parser)
    return parser


def host_pretrain(pretrain: Callable, table: Callable[[Run], Sequence[Patch]]) -> Callable:
    """Upstream's `pretrain`, each call one `Run`: the host's patch table (`table(run)`) applied
    for the call and undone after it, the `--mecefo*` flags added to the user's
    `extra_args_provider`, and a job MeCeFO cannot continue ended with the launcher's exit codes
    (errors.run_to_exit: 3 gave up, 4 left the job and is restarted, 2 bad input)."""
    from megatron_mecefo.errors import run_to_exit

    @functools.wraps(pretrain)
    def run_pretrain(*args, extra_args_provider=None, **kwargs):
        def extra(parser):
            parser = extra_args_provider(parser) if extra_args_provider is not None else parser
            return add_args(parser)

        run = Run()
        with patched(table(run)):
            return run_to_exit(lambda: pretrain(*args, extra_args_provider=extra, **kwargs), usage=(UsageError,),
                               close=run.close)

    return run_pretrain
