"""Which gradient-averaging group a parameter belongs to.

MeCeFO averages gradients differently per parameter kind (MeCeFO §3.1 and the project's averaging
rule): attention parameters (attention linears and the attention pre-norm) get no gradient on a
covering rank, so they are averaged over non-covering ranks only; every other parameter is averaged
over the original number of micro-batches. The layers tag their parameters here; the runtime reads
the tag without knowing anything about layers.
"""

from __future__ import annotations

import enum
from typing import Dict, Iterable, List, Tuple

import torch

__all__ = ["GradGroup", "tag_parameters", "grad_group", "split_by_group"]

_ATTR = "mecefo_grad_group"


class GradGroup(str, enum.Enum):
    MHA = "mha"
    """Attention linears and the attention pre-norm: no gradient from covering ranks."""
    DEFAULT = "default"
    """Everything else: every rank contributes."""


def tag_parameters(module: torch.nn.Module, group: GradGroup) -> int:
    """Tag every parameter of `module` with `group`. Returns the number tagged."""
    count = 0
    for param in module.parameters():
        setattr(param, _ATTR, GradGroup(group))
        count += 1
    return count


def grad_group(param: torch.nn.Parameter) -> GradGroup:
    """The group of `param`; untagged parameters are DEFAULT."""
    return getattr(param, _ATTR, GradGroup.DEFAULT)


def split_by_group(
    named_params: Iterable[Tuple[str, torch.nn.Parameter]],
) -> Dict[GradGroup, List[Tuple[str, torch.nn.Parameter]]]:
    """Partition `model.named_parameters()` by group (both keys always present)."""
    out: Dict[GradGroup, List[Tuple[str, torch.nn.Parameter]]] = {g: [] for g in GradGroup}
    for name, param in named_params:
        out[grad_group(param)].append((name, param))
    return out
