"""Shared fixtures: a single-process Megatron world, a tiny LLaMA-style GPT, saved-bytes meter."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest


@pytest.fixture(scope="session")
def megatron_world():
    """torch.distributed (gloo, world size 1, in-memory store) + Megatron parallel_state, TP=PP=1."""
    import torch.distributed as dist

    from megatron_mecefo.layers.model import init_model_parallel

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    init_model_parallel(1, 1, seed=1234)
    yield
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


@pytest.fixture
def tiny_config(megatron_world):
    from megatron_mecefo.layers.model import llama_config

    from tests.helpers import TINY

    return llama_config(**TINY)
