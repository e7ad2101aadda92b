"""Megatron-LM's distributed-optimizer checkpoints (`torch_dist`) as the start of MeCeFO's sharded state.

Upstream's DistributedOptimizer stores its state in one of two layouts (content metadata
"distrib_optim_sharding_type"):
- "dp_reshardable" (the default): per grad buffer and bucket one flat tensor per key ("param": the
  fp32 main parameters, "exp_avg", "exp_avg_sq"), the parameters laid out as Megatron's DDP lays
  them out (`_ParamAndGradBuffer`: reverse order, starts padded to 64, buckets of `bucket_size`);
- "fully_reshardable" (`--dist-ckpt-optim-fully-reshardable`): one tensor per parameter and key,
  `optimizer.state.{key}.{the parameter's sharded key}`, in model space.
Each of MeCeFO's optimizer parameters is found in either: in model space through the model's own
`sharded_state_dict`, in bucket space through `bucket_layout.py` (upstream's layout, checked against
the checkpoint's bucket sizes and chunk boundaries: a checkpoint laid out otherwise is refused, never
misread). A rank reads only the boxes of the ranges it will hold (torch.distributed.checkpoint with
a planner that asks for sub-chunks, no collective: `dcp_boxes.py`). The step counts come from the param groups.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from megatron_mecefo.elastic.sharding.state_source import Piece, StateSource
from megatron_mecefo.integrations.megatron_lm.bucket_layout import bucket_boxes
from megatron_mecefo.integrations.megatron_lm.dcp_boxes import Checkpoint

__all__ = ["dist_optimizer_state", "fully_reshardable_state_dict", "sharding_type"]

KEYS = {"master": "param"}
"""MeCeFO's per-element keys -> the distributed optimizer's (the rest are the same)."""


def sharding_type(common: dict) -> Optional[str]:
    """The distributed optimizer's layout of a torch_dist checkpoint (None: not one of its)."""
    optim = common.get("optimizer") or {}
    found = optim.get("param_state_sharding_type") if isinstance(optim, dict) else None
    return found or (common.get("content_metadata") or {}).get("distrib_optim_sharding_type")


def dist_optimizer_state(directory: str, common: dict, model_chunks, params: Sequence[torch.Tensor],
                         group_bounds: Sequence[Tuple[int, int]], keys: Sequence[str], mp_rank: int,
                         pp_rank: int) -> StateSource:
    """The state of the distributed-optimizer checkpoint in `directory` (its common state dict
    `common`) for this rank's optimizer: `params` in flat order, its param groups' flat bounds,
    the per-element `keys` it needs; `mp_rank` / `pp_rank`: this rank's model-parallel and
    pipeline ranks. Raises ValueError when the checkpoint does not fit."""
    kind = sharding_type(common)
    ckpt = Checkpoint(directory)
    origin = f"{directory} (Megatron's distributed optimizer, {kind})"
    offsets = []
    n = 0
    for p in params:
        offsets.append(n)
        n += p.numel()
    if kind == "dp_reshardable":
        boxes, have = bucket_boxes(ckpt, common.get("args"), model_chunks, params, mp_rank, pp_rank, origin)
    elif kind == "fully_reshardable":
        boxes, have = _model_space_boxes(ckpt, model_chunks, params, origin)
    else:
        raise ValueError(f"{origin}: MeCeFO reads the distributed optimizer's 'dp_reshardable' (the default) and "
                         f"'fully_reshardable' layouts, not {kind!r}: save it again with one of them, or pass "
                         "--no-load-optim to restart the optimizer state")
    steps = _group_steps(ckpt, common, kind, mp_rank, len(group_bounds), origin)
    pieces = []
    for i, (p, at) in enumerate(zip(params, offsets)):
        g = next(j for j, (a, b) in enumerate(group_bounds) if a <= at < b)
        pieces.append(Piece(at, at + p.numel(), functools.partial(_read, ckpt, boxes[i]), {"step": steps[g]}))
    names = {k for k in keys if KEYS.get(k, k) in have}
    return StateSource(n, pieces, sorted(names), origin)


def _read(ckpt: Checkpoint, box, key: str, lo: int, hi: int) -> torch.Tensor:
    prefix, offsets, sizes, flat = box
    fqn = prefix.format(key=KEYS.get(key, key))
    if flat:  # a bucket: the sub-range is a box itself
        return ckpt.box(fqn, (offsets[0] + lo,), (hi - lo,))
    return ckpt.box(fqn, offsets, sizes).reshape(-1)[lo:hi]


def _model_space_boxes(ckpt: Checkpoint, model_chunks, params, origin: str):
    """Each parameter's box in the fully_reshardable tensors, from the model's sharded state dict."""
    sharded = _sharded_tensors(model_chunks, params, origin)
    boxes, have = [], set()
    for p in params:
        sh = sharded[id(p)]
        prefix = f"optimizer.state.{{key}}.{sh.key}"
        sizes = (1,) * sh.prepend_axis_num + tuple(sh.local_shape)
        md = ckpt.metadata.get(prefix.format(key="exp_avg"))
        if md is None or tuple(md.size) != tuple(sh.global_shape):
            raise ValueError(f"{origin}: {sh.key}: {tuple(md.size) if md else 'absent'} in the checkpoint, "
                             f"{tuple(sh.global_shape)} in this model")
        boxes.append((prefix, tuple(sh.global_offset), sizes, False))
    for fqn in ckpt.metadata:
        if fqn.startswith("optimizer.state."):
            have.add(fqn.split(".")[2])
    return boxes, have


def _sharded_tensors(model_chunks, params, origin: str) -> dict:
    """id(parameter) -> its ShardedTensor in the model's sharded state dict (upstream's key, global
    shape and offsets), for each of `params`."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.utils import extract_sharded_base

    sharded = {}
    for chunk in model_chunks:
        while hasattr(chunk, "module"):  # DDP, Float16Module: upstream's keys are the inner model's
            chunk = chunk.module
        sd, _ = extract_sharded_base(chunk.sharded_state_dict())
        for sh in _values(sd):
            sharded[id(sh.data)] = sh
    for p in params:
        sh = sharded.get(id(p))
        if not isinstance(sh, ShardedTensor) or sh.flattened_range is not None:
            raise ValueError(f"{origin}: a parameter of shape {tuple(p.shape)} has no plain sharded tensor in the "
                             "model (a fused or factory layout): MeCeFO cannot place its optimizer state in model space")
    return sharded


def fully_reshardable_state_dict(model_chunks, inner, params: Sequence[torch.Tensor], state: Dict[str, torch.Tensor],
                                 steps: Sequence[float]) -> dict:
    """The whole optimizer state (flat, `state` per key over `params`, `steps` per param group)
    as upstream's DistributedOptimizer writes it with "fully_reshardable" (its
    `sharded_param_state_fully_reshardable`): per parameter "param" (fp32), "exp_avg",
    "exp_avg_sq" in model space, and the param groups (of the torch optimizer `inner`) with their step."""
    sharded = _sharded_tensors(model_chunks, params, "the optimizer state")
    groups = []
    for pg, step in zip(inner.state_dict()["param_groups"], steps):
        groups.append({**{k: v for k, v in pg.items() if k != "params"}, "step": step})
    param_state, at = {}, 0
    for i, p in enumerate(params):
        sh, n = sharded[id(p)], p.numel()
        tensors = {}
        for key in ("param", "exp_avg", "exp_avg_sq"):
            flat = state["master" if key == "param" else key] if key != "param" or "master" in state else None
            data = (flat[at:at + n] if flat is not None else p.detach().reshape(-1).float()).reshape(sh.data.shape)
            tensors[key] = dataclasses.replace(sh, key=f"optimizer.state.{key}.{sh.key}", data=data, dtype=data.dtype)
        param_state[i] = tensors
        at += n
    return {"optimizer": {"param_groups": groups}, "param_state": param_state,
            "param_state_sharding_type": "fully_reshardable"}


def _values(tree):
    if isinstance(tree, dict):
        for v in tree.values():
            yield from _values(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _values(v)
    else:
        yield tree


def _group_steps(ckpt: Checkpoint, common: dict, kind: str, mp_rank: int, groups: int, origin: str) -> List[float]:
    """The optimizer's step count per param group (AdamW's bias correction)."""
    if kind == "fully_reshardable":
        param_groups = common["optimizer"]["optimizer"]["param_groups"]
    else:
        found = ckpt.obj(f"optimizer.distributed.dp_group_idx_{mp_rank}.optimizer")
        param_groups = [g for sd in (found if isinstance(found, list) else [found]) for g in sd["param_groups"]]
    steps = [float(g.get("step", 0)) for g in param_groups]
    if len(steps) == groups:
        return steps
    if len(set(steps)) == 1:
        return steps[:1] * groups
    raise ValueError(f"{origin}: {len(steps)} param groups with steps {steps}, this job's optimizer has {groups}")
