"""Megatron-LM's distributed-optimizer checkpoints (`torch_dist`) as the start of MeCeFO's sharded state.

Upstream's DistributedOptimizer stores its state in one of two layouts (content metadata
"distrib_optim_sharding_type"):
- "dp_reshardable" (the default): per grad buffer and bucket one flat tensor per key ("param": the
  fp32 main parameters, "exp_avg", "exp_avg_sq"), the parameters laid out as Megatron's DDP lays
  them out (`_ParamAndGradBuffer`: reverse order, starts padded to 64, buckets of `bucket_size`);
- "fully_reshardable" (`--dist-ckpt-optim-fully-reshardable`): one tensor per parameter and key,
  `optimizer.state.{key}.{the parameter's sharded key}`, in model space.
Each of MeCeFO's optimizer parameters is found in either: in model space through the model's own
`sharded_state_dict`, in bucket space through `bucket_offsets` (upstream's layout, checked against
the checkpoint's bucket sizes and chunk boundaries: a checkpoint laid out otherwise is refused, never
misread). A rank reads only the boxes of the ranges it will hold (torch.distributed.checkpoint with
a planner that asks for sub-chunks, no collective). The step counts come from the param groups.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import math
import re
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from megatron_mecefo.elastic.sharding.state_source import Piece, StateSource

__all__ = ["dist_optimizer_state", "fully_reshardable_state_dict", "bucket_offsets", "sharding_type"]

KEYS = {"master": "param"}
"""MeCeFO's per-element keys -> the distributed optimizer's (the rest are the same)."""


def sharding_type(common: dict) -> Optional[str]:
    """The distributed optimizer's layout of a torch_dist checkpoint (None: not one of its)."""
    optim = common.get("optimizer") or {}
    found = optim.get("param_state_sharding_type") if isinstance(optim, dict) else None
    return found or (common.get("content_metadata") or {}).get("distrib_optim_sharding_type")


def bucket_offsets(params: Sequence[torch.Tensor], *,
                   bucket_size: Optional[int]) -> Tuple[Dict[int, Tuple[int, int]], List[int]]:
    """Upstream's layout of one grad buffer with the distributed optimizer (megatron.core 0.16's
    `_ParamAndGradBuffer.__init__`): id(param) -> (bucket, offset in the bucket), and each
    bucket's unpadded size (what the checkpoint stores; checked against it by the reader)."""
    where, sizes = {}, []
    start = bucket_start = 0
    in_bucket = 0

    def close(end: int) -> int:
        nonlocal bucket_start, in_bucket
        sizes.append(end - bucket_start)
        # upstream pads the end to a multiple of lcm(dp, 128) (a multiple of 64): the next bucket's
        # offsets are those of a start at the next multiple of 64
        bucket_start, in_bucket = math.ceil(end / 64) * 64, 0
        return bucket_start

    for p in list(params)[::-1]:
        start = math.ceil(start / 64) * 64
        shared = getattr(p, "shared_embedding", False)
        if shared and in_bucket:
            start = close(start)
        end = start + p.numel()
        where[id(p)] = (len(sizes), start - bucket_start)
        in_bucket += 1
        if (bucket_size is not None and end - bucket_start >= bucket_size) or shared:
            start = close(end)
        else:
            start = end
    if in_bucket:
        close(end)
    return where, sizes


def _box_planner(boxes):
    """A DefaultLoadPlanner asking for one box of each requested tensor (torch.distributed.checkpoint);
    `boxes` ({fqn: (offsets, sizes)}) None: the state dict's objects whole."""
    return _box_planner_type()(boxes)


@functools.lru_cache(maxsize=None)
def _box_planner_type():
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class BoxPlanner(DefaultLoadPlanner):
        def __init__(self, boxes):
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
            self.boxes = boxes

        def create_local_plan(self):
            if self.boxes is None:  # whole objects (BytesIO values)
                return super().create_local_plan()
            items = []
            for fqn, (offsets, sizes) in self.boxes.items():
                chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
                items += create_read_items_for_chunk_list(fqn, self.metadata.state_dict_metadata[fqn], [chunk])
            return LoadPlan(items)

        def lookup_tensor(self, index):  # the box itself: offsets are relative to it
            return self.state_dict[index.fqn]

        def load_bytes(self, read_item, value: io.BytesIO) -> None:  # plain data only
            self.state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)

    return BoxPlanner


class _Checkpoint:
    """One torch_dist checkpoint directory, read box by box."""

    def __init__(self, directory: str) -> None:
        from torch.distributed.checkpoint import FileSystemReader

        self.directory = directory
        self.reader = FileSystemReader(directory)
        self.metadata = self.reader.read_metadata().state_dict_metadata

    def box(self, fqn: str, offsets: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
        import torch.distributed.checkpoint as dcp

        md = self.metadata[fqn]
        out = {fqn: torch.empty(tuple(sizes), dtype=md.properties.dtype)}
        dcp.load(out, storage_reader=self.reader, planner=_box_planner({fqn: (tuple(offsets), tuple(sizes))}),
                 no_dist=True)
        return out[fqn]

    def obj(self, key: str):
        """A ShardedObject of one piece (Megatron stores it as `{key}/shard_0_1`), plain data only."""
        import torch.distributed.checkpoint as dcp

        fqn = f"{key}/shard_0_1"
        if fqn not in self.metadata:
            raise ValueError(f"{self.directory}: no {key} in the checkpoint")
        out = {fqn: io.BytesIO()}
        dcp.load(out, storage_reader=self.reader, planner=_box_planner(None), no_dist=True)
        return out[fqn]


def dist_optimizer_state(directory: str, common: dict, model_chunks, params: Sequence[torch.Tensor],
                         group_bounds: Sequence[Tuple[int, int]], keys: Sequence[str], mp_rank: int,
                         pp_rank: int) -> StateSource:
    """The state of the distributed-optimizer checkpoint in `directory` (its common state dict
    `common`) for this rank's optimizer: `params` in flat order, its param groups' flat bounds,
    the per-element `keys` it needs; `mp_rank` / `pp_rank`: this rank's model-parallel and
    pipeline ranks. Raises ValueError when the checkpoint does not fit."""
    kind = sharding_type(common)
    ckpt = _Checkpoint(directory)
    origin = f"{directory} (Megatron's distributed optimizer, {kind})"
    offsets = []
    n = 0
    for p in params:
        offsets.append(n)
        n += p.numel()
    if kind == "dp_reshardable":
        boxes, have = _bucket_boxes(ckpt, common.get("args"), model_chunks, params, mp_rank, pp_rank, origin)
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


def _read(ckpt: _Checkpoint, box, key: str, lo: int, hi: int) -> torch.Tensor:
    prefix, offsets, sizes, flat = box
    fqn = prefix.format(key=KEYS.get(key, key))
    if flat:  # a bucket: the sub-range is a box itself
        return ckpt.box(fqn, (offsets[0] + lo,), (hi - lo,))
    return ckpt.box(fqn, offsets, sizes).reshape(-1)[lo:hi]


_BUCKET = re.compile(r"^optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_(.+)"
                     r"\.bucket_idx_(\d+)\.(\w+)$")


def _bucket_boxes(ckpt: _Checkpoint, args, model_chunks, params, mp_rank: int, pp_rank: int, origin: str):
    """Each parameter's box in the dp_reshardable buckets of this model-parallel rank."""
    stored: Dict[Tuple[int, int], Tuple[str, int]] = {}  # (gbuf, bucket) -> (dtype name, unpadded size)
    have = set()
    for fqn, md in ckpt.metadata.items():
        m = _BUCKET.match(fqn)
        if m and int(m.group(1)) == mp_rank:
            stored[(int(m.group(2)), int(m.group(4)))] = (m.group(3), int(md.size[0]))
            have.add(m.group(5))
    if not stored:
        raise ValueError(f"{origin}: no distributed-optimizer state of model-parallel rank {mp_rank} (written with "
                         "another tensor or pipeline layout?)")
    dp = getattr(args, "data_parallel_size", 1) * getattr(args, "context_parallel_size", 1)
    size = getattr(args, "ddp_bucket_size", None) or max(40000000, 1000000 * dp)
    if not getattr(args, "overlap_grad_reduce", False):
        size = None
    where, gbuf = {}, 0
    for c, chunk in enumerate(model_chunks):
        module = getattr(chunk, "module", chunk)
        by_dtype: Dict[tuple, list] = {}
        for _, p in module.named_parameters():
            if p.requires_grad and getattr(p, "allreduce", True):
                grad = torch.float if getattr(args, "grad_reduce_in_fp32", False) else p.dtype
                by_dtype.setdefault((p.dtype, grad), []).append(p)
        for buffer in by_dtype.values():
            bucketing = size if (c == 0 and pp_rank == 0) else None
            offsets, sizes = bucket_offsets(buffer, bucket_size=bucketing)
            got = [stored.get((gbuf, b), (None, None))[1] for b in range(len(sizes))]
            if got != sizes:
                raise ValueError(f"{origin}: grad buffer {gbuf} has buckets of {got} elements, this model's layout "
                                 f"gives {sizes} (another model or DDP bucketing); save it with "
                                 "--dist-ckpt-optim-fully-reshardable, or pass --no-load-optim")
            for p in buffer:
                b, at = offsets[id(p)]
                where[id(p)] = (gbuf, b, at)
            gbuf += 1
    boxes = []
    for p in params:
        if id(p) not in where:
            raise ValueError(f"{origin}: a parameter of this job's optimizer ({tuple(p.shape)}) is in no grad buffer")
        g, b, at = where[id(p)]
        dtype = stored[(g, b)][0]
        prefix = f"optimizer.distributed.dp_group_idx_{mp_rank}.gbuf_idx_{g}.dtype_{dtype}.bucket_idx_{b}.{{key}}"
        _check_boundaries(ckpt, prefix.format(key="exp_avg"), at, at + p.numel(), origin)
        boxes.append((prefix, (at,), (p.numel(),), True))
    return boxes, have


def _check_boundaries(ckpt: _Checkpoint, fqn: str, a: int, b: int, origin: str) -> None:
    """A parameter's range starts and ends at chunk boundaries (the writer's chunks are split at
    every parameter): a misplaced range is refused, never misread."""
    md = ckpt.metadata.get(fqn)
    if md is None:
        return
    cuts = {int(c.offsets[0]) for c in md.chunks} | {int(c.offsets[0] + c.sizes[0]) for c in md.chunks}
    if a not in cuts or b not in cuts:
        raise ValueError(f"{origin}: the elements [{a}, {b}) of {fqn} are not one parameter's (another model or "
                         "bucket layout); save it with --dist-ckpt-optim-fully-reshardable, or pass --no-load-optim")


def _model_space_boxes(ckpt: _Checkpoint, model_chunks, params, origin: str):
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


def _group_steps(ckpt: _Checkpoint, common: dict, kind: str, mp_rank: int, groups: int, origin: str) -> List[float]:
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
