"""MeCeFO's three approximations as plain torch: no torch.distributed, Megatron or DeepSpeed.

* skip.py        attention backward through the residual only (§3.1)
* recompute.py   FFN activations recomputed in backward (§3.2)
* projector.py   low-rank basis V of a weight (§3.3)
* lowrank_grad.py  linear map with the projected weight gradient (§3.3)
* mode.py        the exact / covering switch the layers read
"""

from megatron_mecefo.approx.lowrank_grad import LowRankWeightGradLinear, lowrank_linear
from megatron_mecefo.approx.mode import (
    CoverPolicy,
    Coverable,
    activate,
    active_policy,
    covering,
    set_covering,
)
from megatron_mecefo.approx.projector import LowRankProjector, top_right_singular_vectors
from megatron_mecefo.approx.recompute import recompute
from megatron_mecefo.approx.skip import ResidualOnlyGrad, forward_with_residual_grad

__all__ = [
    "CoverPolicy",
    "Coverable",
    "LowRankProjector",
    "LowRankWeightGradLinear",
    "ResidualOnlyGrad",
    "activate",
    "active_policy",
    "covering",
    "forward_with_residual_grad",
    "lowrank_linear",
    "recompute",
    "set_covering",
    "top_right_singular_vectors",
]
