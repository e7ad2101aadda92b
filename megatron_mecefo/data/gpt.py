"""Train / validation GPTDatasets from Megatron-Core's dataset stack, addressable by sample index.

MeCeFO needs data that any rank can fetch for any other rank: sample i of the training set is
`train[i]`, and the runtime maps (step, replica, micro-batch) to sample indices (`sample_range`).
Index caches are built once: Megatron's rank 0 of the (replica-local, under MeCeFO) world builds
under a file lock, so replicas take turns; the other ranks wait at Megatron's barrier and load.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Sequence, Tuple

import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

from megatron_mecefo.locks import file_lock
from megatron_mecefo.data.tokenizer import ByteTokenizer

__all__ = ["build_gpt_datasets", "check_token_ids", "collate"]


def build_gpt_datasets(data_prefix: str, *, seq_length: int, split: str, seed: int, train_samples: int,
                       valid_samples: int, cache_dir: str, tokenizer=None) -> Tuple[GPTDataset, GPTDataset]:
    """(train, valid) GPTDatasets over the indexed dataset at `data_prefix` (.bin/.idx), tokenized
    by `tokenizer` (default: ByteTokenizer).

    Raises:
        FileNotFoundError: the .bin/.idx pair does not exist (before any training starts).
        ValueError: the split leaves no training or validation data, or the first samples hold
            token ids outside the tokenizer's vocabulary (see `check_token_ids`).
    """
    tokenizer = tokenizer or ByteTokenizer()
    for suffix in (".bin", ".idx"):
        if not os.path.exists(data_prefix + suffix):
            raise FileNotFoundError(
                f"--data-path {data_prefix}: {data_prefix + suffix} not found; create it with "
                "python -m megatron_mecefo.data.preprocess --input FILE --output-prefix PREFIX"
            )
    config = GPTDatasetConfig(
        random_seed=seed, sequence_length=seq_length, blend=([data_prefix], None), split=split,
        tokenizer=tokenizer, reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
        create_attention_mask=False, path_to_cache=cache_dir, mmap_bin_files=True,
    )
    builder = BlendedMegatronDatasetBuilder(GPTDataset, [train_samples, valid_samples, 0], lambda: True, config)
    # Megatron coordinates a world: its rank 0 builds, a barrier, the rest load. Under MeCeFO each
    # replica is its own world, so several rank 0s may build at once: they take turns under a file lock.
    builds = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    with file_lock(Path(cache_dir) / "build.lock") if builds else contextlib.nullcontext():
        train, valid, _ = builder.build()
    if train is None or valid is None:
        raise ValueError(f"--split {split} leaves no training or validation documents in {data_prefix}")
    for dataset in (train, valid):
        check_token_ids(dataset, tokenizer, data_prefix)
    return train, valid


def check_token_ids(dataset, tokenizer, data_prefix: str, samples: int = 32) -> None:
    """A token id at or above the vocabulary size would crash the embedding mid-run (a device-side
    assert on GPU): look at the first `samples` samples before training starts."""
    top = max(int(torch.as_tensor(dataset[i]["tokens"]).max()) for i in range(min(samples, len(dataset))))
    if top >= tokenizer.vocab_size:
        raise ValueError(
            f"--data-path {data_prefix} holds token id {top}, but the {type(tokenizer).__name__}'s vocabulary has "
            f"{tokenizer.vocab_size} ids: for data made by another tokenizer pass --tokenizer-type NullTokenizer "
            "--vocab-size <that tokenizer's vocabulary size>"
        )


def collate(dataset, indices: Sequence[int]):
    """tokens, position_ids, labels, loss_mask for samples `indices` (wrapping around the dataset)."""
    items = [dataset[i % len(dataset)] for i in indices]
    stack = lambda key: torch.stack([torch.as_tensor(it[key]) for it in items])  # noqa: E731
    return stack("tokens").long(), stack("position_ids").long(), stack("labels").long(), stack("loss_mask").float()
