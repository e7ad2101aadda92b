"""Every RNG a Megatron training step draws from, as plain values and tensors: what a checkpoint
and a rejoining rank's state carry, so a run with dropout continues on the same curve."""

from __future__ import annotations

import random
from typing import Any, Dict

import numpy as np
import torch

__all__ = ["rng_state", "set_rng_state"]


def rng_state() -> Dict[str, Any]:
    """Every RNG a training step draws from, as tensors and plain values."""
    from megatron.core import tensor_parallel

    np_state = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *map(float, np_state[2:])],
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    from megatron.core import tensor_parallel

    torch.set_rng_state(state["torch"])
    random.setstate(tuple(tuple(x) if isinstance(x, list) else x for x in state["python"]))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), int(pos), int(has_gauss), cached))
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
