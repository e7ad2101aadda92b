"""megatron_mecefo: MeCeFO fault-tolerant training for Megatron-Core and DeepSpeed.

Public API (imported lazily, so `import megatron_mecefo.approx` does not pull in Megatron):

    MeCeFOConfig                 configuration (ds_config "mecefo" block / --mecefo* flags)
    CoverPolicy                  what a covering micro-batch approximates
    covering, set_covering       switch a model's layers between exact and covering backward
    get_gpt_layer_mecefo_spec    GPT layer spec with the covering backward (Megatron-Core)
    mecefo_gpt_layer_spec        module-level spec for `--spec megatron_mecefo.layers.specs ...`
    enable_cpu_support           run Megatron-Core without CUDA
    check_lowrank_rank           validate the rank against a model's FFN weights
    LowRankProjector, lowrank_linear   the low-rank weight-gradient math
    GradGroup, grad_group        attention vs other parameters, for gradient averaging
    ElasticRuntime               the fault-tolerant data-parallel step protocol
    FaultInjector                kill / hang a rank at an exact (step, phase)

The DeepSpeed integration is `megatron_mecefo.deepspeed_hook.initialize` (imports deepspeed).
"""

from __future__ import annotations

import importlib

from megatron_mecefo.version import __version__  # the one source (version.py)

_EXPORTS = {
    "MeCeFOConfig": "megatron_mecefo.config",
    "CoverPolicy": "megatron_mecefo.approx.mode",
    "covering": "megatron_mecefo.approx.mode",
    "set_covering": "megatron_mecefo.approx.mode",
    "LowRankProjector": "megatron_mecefo.approx.projector",
    "lowrank_linear": "megatron_mecefo.approx.lowrank_grad",
    "GradGroup": "megatron_mecefo.params",
    "grad_group": "megatron_mecefo.params",
    "get_gpt_layer_mecefo_spec": "megatron_mecefo.layers.specs",
    "mecefo_gpt_layer_spec": "megatron_mecefo.layers.specs",
    "enable_cpu_support": "megatron_mecefo.layers.cpu",
    "check_lowrank_rank": "megatron_mecefo.layers.linear",
    "ElasticRuntime": "megatron_mecefo.elastic.runtime",
    "FaultInjector": "megatron_mecefo.elastic.faults.inject",
}

__all__ = ["__version__", *sorted(_EXPORTS)]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'megatron_mecefo' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
