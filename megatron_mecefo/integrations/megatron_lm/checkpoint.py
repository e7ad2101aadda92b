"""Which optimizer state `--load` brings into a MeCeFO job on Megatron-LM, and how upstream's load
is told to leave it to the sharded state.

A checkpoint's optimizer state is one of:
- MeCeFO's shard files (`mecefo_optim_*.pt` in `iter_N`): read by the sharded state; upstream's
  files hold no moments, so upstream's optimizer must not create them for its load to fill;
- upstream's DistributedOptimizer state (`torch_dist`, "dp_reshardable" or "fully_reshardable"):
  read by the sharded state (dist_checkpoint.py) at any replica count; upstream's load takes model,
  scheduler, RNG and counters, not the optimizer (its plain optimizer's keys are not in there);
- a plain optimizer's state: upstream loads it, and the sharded state starts from it.
What the job cannot read ends before the model is built (UsageError: exit 2).

Saving (`shard_saver`): every rank writes its shard as a file; the lead replica's rank of each
position gathers them (zero.py `collect`) and upstream's own save writes the whole state as its
DistributedOptimizer's "fully_reshardable" layout (content metadata included), in the same
torch_dist checkpoint as the model: upstream with --use-distributed-optimizer resumes it at any
data-parallel size, MeCeFO at any replica count. A job that gives up does the same from the
holders' files (every holder writes its ranges, the checkpoint's writer gathers them); when a range
has no live holder they stay shard files, which MeCeFO refuses to resume the optimizer from.
"""

from __future__ import annotations

import contextlib
import glob
import os
from typing import Callable, Optional

from megatron_mecefo.integrations.usage import UsageError

__all__ = ["check_loaded_optimizer", "loaded_optimizer_state", "wrap_load_checkpoint", "shard_saver",
           "as_upstream_optimizer"]


def _loaded_checkpoint(args) -> Optional[str]:
    """The directory of the checkpoint `--load` reads with its optimizer state (`--ckpt-step`, else
    the tracker's iteration); None when no optimizer state is loaded or there is no checkpoint."""
    from megatron.training.checkpointing import get_checkpoint_name, get_checkpoint_tracker_filename, read_metadata

    if not args.load or args.no_load_optim or args.finetune:
        return None
    iteration = getattr(args, "ckpt_step", None)
    if iteration is None:
        tracker = get_checkpoint_tracker_filename(args.load)
        if not os.path.isfile(tracker):
            return None
        iteration, release = read_metadata(tracker)
        if release:
            return None
    return get_checkpoint_name(args.load, iteration, return_base_dir=True)


def _kind(directory: Optional[str]) -> Optional[str]:
    """"shards" (MeCeFO's files), "distributed" (upstream's DistributedOptimizer, torch_dist),
    "legacy" (its `distrib_optim.pt`), or None (a plain optimizer's state, or no checkpoint)."""
    if directory is None:
        return None
    if glob.glob(os.path.join(directory, "mecefo_optim_*.pt")):
        return "shards"
    if glob.glob(os.path.join(directory, "**", "distrib_optim.pt"), recursive=True):
        return "legacy"
    try:
        from megatron.core import dist_checkpointing

        metadata = dist_checkpointing.load_content_metadata(directory) or {}
    except Exception:  # not a torch_dist checkpoint: upstream's load says what it is
        return None
    return "distributed" if "distrib_optim_sharding_type" in metadata else None


def check_loaded_optimizer(args, sharded: bool) -> None:
    """Refuse, before the model is built, a `--load` whose optimizer state this job cannot read."""
    directory = _loaded_checkpoint(args)
    kind = _kind(directory)
    restart = "or pass --no-load-optim to load the model and restart the optimizer state"
    if kind == "shards" and not sharded:
        raise UsageError(f"{directory} holds a sharded optimizer state (MeCeFO's shard files, written with "
                         f"--use-distributed-optimizer): resume with --use-distributed-optimizer, {restart}")
    if kind == "distributed" and not sharded:
        raise UsageError(f"the checkpoint in {args.load} was written by Megatron's DistributedOptimizer: resume it "
                         f"with --use-distributed-optimizer (MeCeFO shards its state over the replicas), {restart}")
    if kind == "legacy":
        raise UsageError(f"the checkpoint in {args.load} keeps its DistributedOptimizer state in the legacy "
                         f"distrib_optim.pt, which MeCeFO does not read: save it in the torch_dist format "
                         f"(--ckpt-format torch_dist, upstream's default), {restart}")
    if kind is None and directory is not None and sharded and args.bf16:
        raise UsageError(f"the checkpoint in {args.load} keeps its fp32 master parameters in Megatron's "
                         "mixed-precision optimizer (a --bf16 run without --use-distributed-optimizer); with --bf16 "
                         "--use-distributed-optimizer they live in MeCeFO's sharded state, and this checkpoint has "
                         f"none: resume it without --use-distributed-optimizer, {restart}")


def loaded_optimizer_state(args, model, shards):
    """What the sharded state starts from after upstream's load: MeCeFO's shard files (their
    directory), upstream's DistributedOptimizer state (a StateSource), or None (the state
    upstream loaded, or a fresh one). Raises ValueError when the state does not fit the job."""
    directory = _loaded_checkpoint(args)
    kind = _kind(directory)
    if kind == "shards":
        return directory
    if kind != "distributed":
        return None
    import torch
    from megatron.core import dist_checkpointing, mpu

    from megatron_mecefo.integrations.megatron_lm.dist_checkpoint import dist_optimizer_state

    common = dist_checkpointing.load_common_state_dict(directory)
    return dist_optimizer_state(directory, common, model, shards.params, shards.group_bounds, shards.keys,
                                mp_rank=torch.distributed.get_rank(mpu.get_model_parallel_group()),
                                pp_rank=mpu.get_pipeline_model_parallel_rank())


def wrap_load_checkpoint(original: Callable, run) -> Callable:
    """`megatron.training.training.load_checkpoint` in a sharded job: upstream's optimizer must not
    load a state the sharded state reads itself (see the module docstring)."""

    def load_checkpoint(model, optimizer, *a, **kw):
        from megatron.training import get_args

        if not run.active:
            return original(model, optimizer, *a, **kw)
        args = get_args()
        kind = _kind(_loaded_checkpoint(args)) if optimizer is not None else None
        with contextlib.ExitStack() as undo:
            if kind == "shards":  # upstream's files hold the optimizer's hyperparameters, no moments
                for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
                    undo.callback(setattr, inner, "init_state_fn", inner.init_state_fn)
                    inner.init_state_fn = lambda *_a, **_k: None
            elif kind == "distributed":  # model, scheduler, RNG and counters only
                skips = (("sharded_state_dict", lambda *_a, **_k: {}), ("load_state_dict", lambda *_a, **_k: None))
                for name, skip in skips:
                    undo.callback(vars(optimizer).pop, name, None)
                    setattr(optimizer, name, skip)
            try:
                return original(model, optimizer, *a, **kw)
            except BaseException as e:  # torch.distributed.checkpoint's CheckpointException is no Exception
                if not _checkpointing_error(e):
                    raise
                lines = [ln.strip() for ln in str(e).splitlines() if "Exception:" in ln or "Error:" in ln]
                raise UsageError(f"--load {args.load}: the checkpoint does not fit this job "
                                 f"({(lines[-1] if lines else str(e).splitlines()[0])[:400]})") from None

    return load_checkpoint


def _checkpointing_error(e: BaseException) -> bool:
    """A checkpoint that does not fit the model (torch.distributed.checkpoint's or Megatron's error)."""
    from torch.distributed.checkpoint.api import CheckpointException

    from megatron.core.dist_checkpointing.core import CheckpointingException

    return isinstance(e, (CheckpointException, CheckpointingException))


def shard_saver(args, model, optimizer, shards, directory_of: Callable, run) -> Callable:
    """`Run.save_shards` of a sharded job: (iteration) -> this rank writes its shard under
    `directory_of(iteration)` (StepDriver.save_shards); on the lead replica returns the context
    upstream's save runs in to write the gathered state in its format (None: the shard files stay,
    see the module docstring)."""

    def save(iteration=None):
        got = run.driver.save_shards(directory_of(iteration), args.iteration if iteration is None else iteration,
                                     collect=args.ckpt_format == "torch_dist")
        return as_upstream_optimizer(args, model, optimizer, shards, got)

    return save


def as_upstream_optimizer(args, model, optimizer, shards, got):
    """The context in which upstream's save writes the whole state collected from the shard files
    (`got`: StepDriver.save_shards, give_up.collect_given_up) as its DistributedOptimizer's (then
    the files go). None when nothing was collected, or the format is not torch_dist."""
    if got is None or args.ckpt_format != "torch_dist":
        return None
    from megatron_mecefo.elastic.sharding.zero import innermost_optimizer
    from megatron_mecefo.integrations.megatron_lm.dist_checkpoint import fully_reshardable_state_dict

    whole, scalars, parts = got
    sd = fully_reshardable_state_dict(model, innermost_optimizer(optimizer), shards.params, whole,
                                      shards.files.group_steps(scalars))
    return _as_distributed_optimizer(args, optimizer, sd, parts)


@contextlib.contextmanager
def _as_distributed_optimizer(args, optimizer, sharded_state_dict: dict, parts):
    """Upstream's save writes `sharded_state_dict` as its optimizer's, with the content metadata of
    a DistributedOptimizer in "fully_reshardable"; the shard files go once it is written."""
    flags = ("use_distributed_optimizer", "dist_ckpt_optim_fully_reshardable",
             "distrib_optim_fully_reshardable_mem_efficient")
    before = {f: getattr(args, f, None) for f in flags}
    args.use_distributed_optimizer, args.dist_ckpt_optim_fully_reshardable = True, True
    args.distrib_optim_fully_reshardable_mem_efficient = False
    optimizer.sharded_state_dict = lambda *_a, **_k: sharded_state_dict
    try:
        yield
    finally:
        vars(optimizer).pop("sharded_state_dict", None)
        for f, v in before.items():
            setattr(args, f, v)
    for part in parts:
        with contextlib.suppress(FileNotFoundError):
            os.remove(part)
