"""Megatron-Core version differences, kept in one place.

* The MLP entry of a layer spec is a `ModuleSpec(module=MLP, submodules=MLPSubmodules(...))` up to
  core 0.17 and may be a `functools.partial` of a builder taking `submodules=` from core 0.18 on
  (MlpBuilder). `mlp_submodules` / `replace_mlp_submodules` read and rewrite either form.
* `ConfigNorm` picks the norm from `config.normalization` when the module is built, so one
  module-level spec serves LayerNorm and RMSNorm models (`--spec` uses a spec object uncalled).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from megatron.core.transformer.spec_utils import ModuleSpec

__all__ = ["mlp_submodules", "replace_mlp_submodules", "ConfigNorm"]


def mlp_submodules(mlp_spec: Any) -> Any:
    """The MLPSubmodules of an MLP spec (ModuleSpec or builder partial)."""
    if isinstance(mlp_spec, ModuleSpec):
        return mlp_spec.submodules
    if isinstance(mlp_spec, functools.partial) and "submodules" in mlp_spec.keywords:
        return mlp_spec.keywords["submodules"]
    raise TypeError(f"unsupported MLP spec {mlp_spec!r}: expected a ModuleSpec or a builder partial")


def replace_mlp_submodules(mlp_spec: Any, **changes: Any) -> Any:
    """A copy of `mlp_spec` whose MLPSubmodules fields are replaced by `changes`."""
    new_sub = dataclasses.replace(mlp_submodules(mlp_spec), **changes)
    if isinstance(mlp_spec, ModuleSpec):
        return dataclasses.replace(mlp_spec, submodules=new_sub)
    keywords = dict(mlp_spec.keywords, submodules=new_sub)
    return functools.partial(mlp_spec.func, *mlp_spec.args, **keywords)


class ConfigNorm:
    """Builds the norm named by `config.normalization` (like WrappedTorchNorm), using Megatron's
    local LayerNorm (apex's fused one when importable) for "LayerNorm"."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **kwargs):
        from megatron.core.models.backends import LocalSpecProvider
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        if config.normalization == "LayerNorm":
            norm_cls = LocalSpecProvider().layer_norm(rms_norm=False)
        else:
            norm_cls = WrappedTorchNorm
        return norm_cls(config=config, hidden_size=hidden_size, eps=eps, **kwargs)
