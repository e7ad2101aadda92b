"""Run Megatron-Core on a machine without CUDA (CI, laptops): three documented redirections.

megatron-core 0.16 assumes CUDA in six places that a CPU/gloo run reaches:

1. `torch.cuda.current_device()` is used as a device for buffers (rotary embeddings, attention's
   global memory buffer, tensor-parallel gathers) -> return the CPU device.
2. The model-parallel RNG tracker stores CUDA generator states -> a tracker with the same interface
   that forks the CPU generator (dropout in tensor-parallel regions still gets per-rank streams).
3. `torch.cuda.synchronize()` is called by dist_checkpointing -> no-op.
4. The default causal mask (used when `attention_mask=None`) is built with `device="cuda"` -> the
   same mask on CPU.
5. The pipeline schedules allocate their token counter with `device="cuda"` -> the schedules
   module sees a `torch` whose `zeros` puts "cuda" tensors on the CPU (everything else is torch's).
6. Tied embeddings with pipeline parallelism: the model moves the last stage's copy with
   `.cuda()` before summing it with the first stage's -> `Tensor.cuda` returns the tensor itself
   while that method (`LanguageModule.setup_embeddings_and_output_layer`) runs.

`enable_cpu_support()` applies them only when CUDA is absent and is idempotent; on a GPU machine it
does nothing, so calling it unconditionally is safe. It does not make fused kernels, sequence
parallelism, apex or Transformer Engine available on CPU.
"""

from __future__ import annotations

import contextlib
import functools
import logging

import torch

__all__ = ["enable_cpu_support", "CPURNGStatesTracker"]

logger = logging.getLogger(__name__)

_ENABLED = False


def _cpu_current_device() -> torch.device:
    return torch.device("cpu")


def _noop_synchronize(device=None) -> None:
    return None


@functools.lru_cache()
def _cpu_default_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq), diagonal=1).bool()


class _CPUTorch:
    """`torch` for megatron.core.pipeline_parallel.schedules, with zeros(device="cuda") on the CPU."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)


def _tracker_base():
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    return CudaRNGStatesTracker


class CPURNGStatesTracker(_tracker_base()):
    """Megatron's RNG-states tracker over the CPU default generator."""

    def add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        orig = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)


def _tensor_stays_on_cpu(method):
    @functools.wraps(method)
    def run(*args, **kwargs):
        cuda = torch.Tensor.cuda
        torch.Tensor.cuda = lambda self, *a, **k: self
        try:
            return method(*args, **kwargs)
        finally:
            torch.Tensor.cuda = cuda

    return run


def enable_cpu_support() -> bool:
    """Apply the CPU redirections if CUDA is unavailable. Returns True when they are in effect."""
    global _ENABLED
    if torch.cuda.is_available():
        return False
    if _ENABLED:
        return True
    from megatron.core.fusions import fused_softmax
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as mcore_random
    from megatron.core.transformer import utils as mcore_utils

    torch.cuda.current_device = _cpu_current_device
    torch.cuda.synchronize = _noop_synchronize
    mcore_random._CUDA_RNG_STATE_TRACKER = CPURNGStatesTracker()
    mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    mcore_utils.get_default_causal_mask = _cpu_default_causal_mask
    fused_softmax.get_default_causal_mask = _cpu_default_causal_mask
    schedules.torch = _CPUTorch()
    LanguageModule.setup_embeddings_and_output_layer = _tensor_stays_on_cpu(
        LanguageModule.setup_embeddings_and_output_layer)
    _ENABLED = True
    logger.info("megatron_mecefo: CUDA absent; Megatron-Core redirected to CPU")
    return True
