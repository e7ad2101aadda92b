"""What the Megatron-DeepSpeed and Megatron-LM adapters share: bad-input errors, the sampler's
order (a covering rank draws a failed neighbour's micro-batches), the exit codes of a job that
MeCeFO cannot continue, and silencing the log lines of every replica but one. Imports nothing of
either codebase."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from typing import Any, Callable, List, Optional

import torch

from megatron_mecefo.integrations.record import Record

__all__ = ["UsageError", "usage_errors", "State", "refuse", "shared_refusals", "init_replica", "init_replica_then_upstream", "tensorboard_writer", "add_args", "install_hooks", "wrap_pretrain", "micro_batch", "run_job",
           "lead_only_save", "keep_training_set", "data_prefixes", "one_replica_at_a_time",
           "arg_counters"]


class UsageError(ValueError):
    """Bad input for MeCeFO found before training (exit with USAGE_EXIT_CODE)."""


@contextlib.contextmanager
def usage_errors():
    """ValueErrors raised inside (config validation, refusals) become UsageErrors."""
    try:
        yield
    except UsageError:
        raise
    except ValueError as e:
        raise UsageError(str(e)) from None


@dataclasses.dataclass
class State:
    """A rank's MeCeFO state inside one upstream `pretrain()` call."""

    cfg: Any = None
    """The MeCeFOConfig; None: --mecefo is off and every hook calls upstream unchanged."""
    job: Any = None
    """The LaunchEnv (with the job's id) once torch.distributed is up over the replica."""
    driver: Any = None
    """What drives the runtime on this rank (it has `.runtime`): MeCeFOEngine or megatron_lm.step.Step."""
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

    def lead(self) -> bool:
        """This rank's replica is the lowest live one: it saves and logs."""
        return self.driver.runtime.leads()

    def close(self, finished: bool) -> None:
        if self.driver is not None:
            if finished and self.record is not None:  # a lead that died at the end: print what it had not
                self.record.finish(timeout_s=self.cfg.heartbeat_timeout_s + 1.0)
            self.driver.runtime.close(finished=finished)


def refuse(checks) -> None:
    """Raise ValueError with the first message whose condition holds: `checks` are (bad, message)."""
    for bad, message in checks:
        if bad:
            raise ValueError(message)


def shared_refusals(args) -> list:
    """What MeCeFO refuses in both Megatron codebases, by their common flags."""
    return [
        (args.dataloader_type != "single",
         f"--mecefo needs --dataloader-type single (got {args.dataloader_type}): a failed rank's micro-batches are "
         "drawn from the sampler's order"),
        (args.rampup_batch_size is not None, "--mecefo does not support --rampup-batch-size"),
        (bool(getattr(args, "exit_duration_in_mins", None)),
         "--mecefo does not support --exit-duration-in-mins (replicas could stop at different iterations)"),
    ]


def init_replica(state: State, cfg, *, backend: str, tensor_parallel: int, data_parallel: int,
                 pipeline_parallel: int = 1) -> None:
    """torch.distributed over this rank's replica (its tensor- and pipeline-parallel ranks) on the
    job's store, before upstream's own init, which then builds its groups over the replica."""
    from megatron_mecefo.elastic.launch.bootstrap import init_distributed

    state.job = init_distributed(backend, tensor_parallel, pipeline_parallel, timeout_s=cfg.collective_timeout_s,
                                 join_timeout_s=cfg.join_timeout_s, heartbeat_timeout_s=cfg.heartbeat_timeout_s,
                                 log_dir=cfg.log_dir, restart_failed_after=cfg.restart_failed_after,
                                 max_restarts=cfg.max_restarts, store=cfg.store)
    state.cfg, state.dp = cfg, data_parallel


def init_replica_then_upstream(state: State, cfg, original: Callable, a, kw, *, args, backend: str,
                               **model_parallel) -> Any:
    """An adapter's `_initialize_distributed` with --mecefo: torch.distributed over this rank's
    replica (`init_replica`), then upstream's own init (`original(*a, **kw)`), which builds its
    groups over the replica; `model_parallel`: more arguments of upstream's
    `initialize_model_parallel`, called here when upstream skips it (no device counted)."""
    init_replica(state, cfg, backend=backend, tensor_parallel=args.tensor_model_parallel_size,
                 data_parallel=args.data_parallel_size, pipeline_parallel=args.pipeline_model_parallel_size)
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


def install_hooks(initialize, training, hooks, *, helpers_dir: Callable[[], str], wrap_evaluate: Callable,
                  get_args: Callable) -> None:
    """Put an adapter's hooks (`hooks`: its training.py) into upstream's `initialize` and `training`
    modules, once: both codebases call these module globals by name. Checkpoints: one replica (the
    lowest live) writes; logs: the record (record.py)."""
    if getattr(training, "_mecefo_installed", False):
        return
    initialize._initialize_distributed = hooks.wrap_initialize_distributed(initialize._initialize_distributed)
    initialize._compile_dependencies = one_replica_at_a_time(initialize._compile_dependencies,
                                                             lambda: hooks.STATE.active, helpers_dir)
    training.setup_model_and_optimizer = hooks.wrap_setup_model_and_optimizer(training.setup_model_and_optimizer)
    if hasattr(hooks, "wrap_load_checkpoint"):
        training.load_checkpoint = hooks.wrap_load_checkpoint(training.load_checkpoint)
    training.build_train_valid_test_datasets = hooks.wrap_datasets(training.build_train_valid_test_datasets)
    training.train_step = hooks.wrap_train_step(training.train_step)
    training.evaluate = wrap_evaluate(training.evaluate)
    training.save_checkpoint = lead_only_save(training.save_checkpoint, hooks.STATE)
    record = hooks.STATE.record = Record(hooks.STATE, training, make_tb_writer=lambda: tensorboard_writer(get_args()))
    training.training_log = record.wrap(training.training_log, carries=True)
    training.evaluate_and_print_results = record.wrap(training.evaluate_and_print_results)
    training._mecefo_installed = True


def wrap_pretrain(pretrain: Callable, state: State) -> Callable:
    """Upstream's `pretrain` with the `--mecefo*` flags added to the user's `extra_args_provider`
    and a job MeCeFO cannot continue ended with the launcher's exit codes (run_job)."""

    @functools.wraps(pretrain)
    def run(*args, extra_args_provider=None, **kwargs):
        def extra(parser):
            parser = extra_args_provider(parser) if extra_args_provider is not None else parser
            return add_args(parser)

        return run_job(lambda: pretrain(*args, extra_args_provider=extra, **kwargs),
                       mecefo_launcher=lambda: state.job is not None and state.job.mecefo_launcher, close=state.close)

    return run


def micro_batch(dataset, consumed: int, replica: int, index: int, *, micro_batch_size: int, dp: int):
    """The micro-batch `index` of data-parallel rank `replica` in the step that starts at `consumed`
    samples, as Megatron's `MegatronPretrainingSampler` + the default collate give it to that rank
    (both codebases slice a global batch of micro_batch_size x dp samples the same way)."""
    start = consumed + index * micro_batch_size * dp + replica * micro_batch_size
    return torch.utils.data.default_collate([dataset[i] for i in range(start, start + micro_batch_size)])


def run_job(pretrain: Callable, *, mecefo_launcher: Callable[[], bool], close: Callable[[bool], None]):
    """Run upstream's `pretrain()`; how a MeCeFO job ends becomes the launcher's exit codes
    (errors.run_to_exit: 3 gave up, 4 left the job and is restarted, 2 bad input)."""
    from megatron_mecefo.errors import run_to_exit

    return run_to_exit(pretrain, usage=(UsageError,), close=close)


def one_replica_at_a_time(original: Callable, active: Callable[[], bool], lock_dir: Callable[[], str]) -> Callable:
    """`original` (upstream's `_compile_dependencies`: it compiles the dataset helpers on rank 0)
    under a file lock in `lock_dir()` on each replica's rank 0: every replica's rank 0 is a rank 0
    here, and two compilers writing the same library at once can leave a broken one. The other
    ranks wait in upstream's own barrier."""
    import torch.distributed as dist

    from megatron_mecefo.locks import file_lock

    def locked(*a, **kw):
        if not active() or dist.get_rank() != 0:
            return original(*a, **kw)
        with file_lock(os.path.join(lock_dir(), ".mecefo-build.lock")):
            return original(*a, **kw)

    return locked


def lead_only_save(original: Callable, state: State) -> Callable:
    """Upstream's `save_checkpoint`: one replica (the lowest live) writes; every replica believes it
    is data-parallel rank 0, so more writers would write the same files. A sharded optimizer state
    is written by every rank, its own ranges (`state.save_shards`), which may return a context the
    lead's save runs in (Megatron-LM: the state gathered into upstream's format)."""

    def save_checkpoint(*a, **kw):
        around = None
        if state.active and state.save_shards is not None:  # every rank writes its optimizer shards
            around = state.save_shards(a[0] if a else kw["iteration"])  # the lead's: how it writes them
        if state.active and not state.lead():
            return None
        with around or contextlib.nullcontext():
            return original(*a, **kw)

    return save_checkpoint


def keep_training_set(original: Callable, state: State, cache_dir: Callable[[], Optional[str]]) -> Callable:
    """Upstream's `build_train_valid_test_datasets`: keep the training set, from which a covering
    rank draws a failed neighbour's micro-batches. Upstream builds missing index files on rank 0,
    and every replica's rank 0 is a rank 0 here: they take turns under a file lock in `cache_dir()`
    (one machine; the later ones load what the first built). Only the replica's rank 0 takes the lock:
    the others meet it in upstream's collectives after the build (over the pipeline stages too),
    which a rank waiting for the lock would never reach."""
    import torch.distributed as dist

    from megatron_mecefo.locks import file_lock

    def build_train_valid_test_datasets(*a, **kw):
        cache = cache_dir() if state.active and dist.get_rank() == 0 else None
        with file_lock(os.path.join(cache, ".mecefo-build.lock")) if cache else contextlib.nullcontext():
            train_ds, valid_ds, test_ds = original(*a, **kw)
        if train_ds is not None:  # with virtual stages it is called per model chunk, built on some only
            state.train_ds = train_ds
        return train_ds, valid_ds, test_ds

    return build_train_valid_test_datasets


def tensorboard_writer(args):
    """A TensorBoard writer as upstream makes one (None without --tensorboard-dir): upstream makes it
    on the job's last rank only; the record (record.py) makes one on each replica's logging rank so
    that TensorBoard moves with the lead."""
    if not getattr(args, "tensorboard_dir", None):
        return None
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=args.tensorboard_dir, max_queue=getattr(args, "tensorboard_queue_size", 1000))


def data_prefixes(args) -> List[str]:
    """The dataset prefixes of Megatron's --data-path / --train-data-path (blend weights dropped)."""
    return [p for p in (args.data_path or args.train_data_path or []) if not _is_number(p)]


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def arg_counters(args, keys, record: Optional[Record] = None) -> tuple:
    """(get, set) of the training loop's counters kept on Megatron's `args` (what a rejoining rank
    receives with the state): plain values of the `keys` that `args` has, and the sums and flags of
    upstream's log (`record`'s Carry: a rejoining rank's log lines then are the others')."""

    def get():
        values = {key: getattr(args, key) for key in keys if hasattr(args, key)}
        if record is not None:
            values["log"] = record.carry.state()
        return values

    def set_(values):
        values = dict(values)
        if record is not None:
            record.carry.receive(values.pop("log", None))
        for key, value in values.items():
            setattr(args, key, value)

    return get, set_
