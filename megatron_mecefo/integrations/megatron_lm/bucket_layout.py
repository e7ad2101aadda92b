"""Upstream's "dp_reshardable" layout of the distributed optimizer's state: per grad buffer and
bucket one flat tensor per key, the parameters laid out as Megatron's DDP lays them out
(`_ParamAndGradBuffer`: reverse order, starts padded to 64, buckets of `bucket_size`). Each
parameter's box is checked against the checkpoint's bucket sizes and chunk boundaries: a checkpoint
laid out otherwise is refused, never misread."""

from __future__ import annotations

import math
import re
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from megatron_mecefo.integrations.megatron_lm.dcp_boxes import Checkpoint

__all__ = ["bucket_offsets", "bucket_boxes"]


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


_BUCKET = re.compile(r"^optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_(.+)"
                     r"\.bucket_idx_(\d+)\.(\w+)$")


def bucket_boxes(ckpt: Checkpoint, args, model_chunks, params, mp_rank: int, pp_rank: int, origin: str):
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


def _check_boundaries(ckpt: Checkpoint, fqn: str, a: int, b: int, origin: str) -> None:
    """A parameter's range starts and ends at chunk boundaries (the writer's chunks are split at
    every parameter): a misplaced range is refused, never misread."""
    md = ckpt.metadata.get(fqn)
    if md is None:
        return
    cuts = {int(c.offsets[0]) for c in md.chunks} | {int(c.offsets[0] + c.sizes[0]) for c in md.chunks}
    if a not in cuts or b not in cuts:
        raise ValueError(f"{origin}: the elements [{a}, {b}) of {fqn} are not one parameter's (another model or "
                         "bucket layout); save it with --dist-ckpt-optim-fully-reshardable, or pass --no-load-optim")
