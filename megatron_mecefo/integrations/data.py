"""The training data under MeCeFO in both Megatron codebases: a micro-batch drawn in the sampler's
order (a covering rank draws a failed neighbour's), the training set kept for it, and the dataset
builds of every replica's rank 0 taking turns. Imports nothing of either codebase."""

from __future__ import annotations

import contextlib
import os
from typing import Callable, List, Optional

import torch

__all__ = ["micro_batch", "step_draw", "keep_training_set", "data_prefixes", "one_replica_at_a_time"]


def micro_batch(dataset, consumed: int, replica: int, index: int, *, micro_batch_size: int, dp: int):
    """The micro-batch `index` of data-parallel rank `replica` in the step that starts at `consumed`
    samples, as Megatron's `MegatronPretrainingSampler` + the default collate give it to that rank
    (both codebases slice a global batch of micro_batch_size x dp samples the same way)."""
    start = consumed + index * micro_batch_size * dp + replica * micro_batch_size
    return torch.utils.data.default_collate([dataset[i] for i in range(start, start + micro_batch_size)])


def step_draw(run, args, reads_data: bool) -> Callable:
    """mb -> micro-batch `mb` (a plan's MicroBatch: whose, which) of the step that starts at
    `args.consumed_train_samples` now, as Megatron's sampler gives it to that data-parallel rank."""
    if reads_data and run.train_ds is None:
        raise RuntimeError("MeCeFO has no training set: build_train_valid_test_datasets was not called")
    consumed, mbs = args.consumed_train_samples, args.micro_batch_size
    return lambda mb: micro_batch(run.train_ds, consumed, mb.replica, mb.index, micro_batch_size=mbs, dp=run.dp)


def keep_training_set(original: Callable, run, cache_dir: Callable[[], Optional[str]]) -> Callable:
    """Upstream's `build_train_valid_test_datasets`: keep the training set, from which a covering
    rank draws a failed neighbour's micro-batches. Upstream builds missing index files on rank 0,
    and every replica's rank 0 is a rank 0 here: they take turns under a file lock in `cache_dir()`
    (one machine; the later ones load what the first built). Only the replica's rank 0 takes the lock:
    the others meet it in upstream's collectives after the build (over the pipeline stages too),
    which a rank waiting for the lock would never reach."""
    import torch.distributed as dist

    from megatron_mecefo.locks import file_lock

    def build_train_valid_test_datasets(*a, **kw):
        cache = cache_dir() if run.active and dist.get_rank() == 0 else None
        with file_lock(os.path.join(cache, ".mecefo-build.lock")) if cache else contextlib.nullcontext():
            train_ds, valid_ds, test_ds = original(*a, **kw)
        if train_ds is not None:  # with virtual stages it is called per model chunk, built on some only
            run.train_ds = train_ds
        return train_ds, valid_ds, test_ds

    return build_train_valid_test_datasets


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


def data_prefixes(args) -> List[str]:
    """The dataset prefixes of Megatron's --data-path / --train-data-path (blend weights dropped)."""
    return [p for p in (args.data_path or args.train_data_path or []) if not _is_number(p)]


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False
