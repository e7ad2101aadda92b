"""The gradient reduction of a step whose optimizer state is sharded (zero.py): a reduce-scatter
over the live replicas instead of the all-reduce (gradients.py), so each rank receives the reduced
gradient of the range it owns; with the neighbour copy, the owner then sends that range to the
holder of its copy. MeCeFO's divisors apply as in gradients.py.

Bytes each rank receives per step (N gradient elements, D live replicas): the all-reduce 2(D-1)/D·N;
NCCL's reduce-scatter (D-1)/D·N, plus N/D for the copy (an all-to-all with one non-empty split). On
gloo, whose reduce-scatter cannot be waited on with an abort check, the same chunks are all-reduced
(the bytes of the all-reduce, the rest of the path unchanged). The parameters' all-gather after the update
((D-1)/D·N, zero.py) comes on top in both cases, so a sharded step moves about what a replicated
one does (D = 4: 1.75 N against 1.5 N; the all-reduce with the gather moved 2.25 N).

Outside the ranges a rank holds, the gradients are zero afterwards: a host must not compute the
gradient norm from its own tensors. `ShardedOptimizer.grad_norm_sq(param)` is each parameter's
squared norm of the reduced gradient (summed over the owners' shards, the same on every rank); the
hosts' clipping reads it (deepspeed_hook.schedule.clip_grad_norm, Megatron-LM's optimizer).
Knows tensors and a group, not the protocol: the runtime calls it where it would all-reduce.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_mecefo.elastic.comm import groups

__all__ = ["reduce_scatter_with_divisors"]


def reduce_scatter_with_divisors(sharded, group, stats: Sequence[float], *,
                                 scale: Callable[[torch.Tensor, List[float]], float],
                                 attr: str = "grad", should_abort: Optional[Callable[[], bool]] = None) -> List[float]:
    """Reduce-scatter the SUMMED gradients of `sharded.sources` (and `stats`) over `group`; divide.

    Args:
        sharded: the ShardedOptimizer of this position, installed in the generation of `group`.
        scale: (a parameter, the summed stats) -> its divisor's reciprocal (gradients.divisor_scale).
        attr: "grad" or "main_grad" (Megatron's DDP buffers, written in place).
        should_abort: polled while waiting (groups.wait_).

    Returns:
        The summed `stats`.

    Raises:
        whatever the collectives raise (a peer failed); the gradients are then unchanged.
    """
    layout, mine, replicas = sharded.layout, sharded.replica, sharded.group_replicas
    width = max(b - a for a, b in (layout.shard(r) for r in layout.live))
    n_stats = len(stats)
    device = _device(sharded.sources)
    extra = torch.tensor(list(stats), dtype=torch.float32, device=device)
    chunks = []
    for replica in replicas:  # the group's order
        a, b = layout.shard(replica)
        chunk = torch.zeros(width + n_stats, dtype=torch.float32, device=device)
        sharded.read_sources(a, b, attr, out=chunk[:b - a])
        chunk[width:] = extra
        chunks.append(chunk)
    out = _reduce_scatter(group, chunks, replicas.index(mine), should_abort)
    del chunks
    summed = out[width:].cpu().tolist()
    scale_of = lambda p: scale(p, summed)  # noqa: E731
    own_a, own_b = layout.shard(mine)
    held = {"shard": (own_a, own_b, out[:own_b - own_a])}
    owner = layout.copy_of(mine)
    if owner is not None:  # the copy's gradient from its owner; this rank's own to the holder of its copy
        a, b = layout.shard(owner)
        copy = torch.empty(b - a, dtype=torch.float32, device=device)
        sent = out[:own_b - own_a].contiguous()
        holder, source = replicas.index(layout.copy_holder(mine)), replicas.index(owner)
        # an all-to-all with one non-empty split each way (gloo's send/recv cannot be polled)
        send_splits = [sent.numel() if j == holder else 0 for j in range(len(replicas))]
        recv_splits = [copy.numel() if j == source else 0 for j in range(len(replicas))]
        groups.wait_(group.alltoall_base(copy, sent, recv_splits, send_splits, dist.AllToAllOptions()), should_abort)
        held["copy"] = (a, b, copy)
    sq = torch.zeros(len(sharded.sources), dtype=torch.float64, device=device)
    scaled = {}
    for name, (a, b, values) in held.items():
        scaled[name] = (a, sharded.scale_by_source(a, b, values, scale_of))
    a, values = scaled["shard"]
    sharded.sq_by_source(a, values, out=sq)  # this rank's shard only: every element counted once
    groups.allreduce_sum_(group, sq, should_abort=should_abort)
    sharded.write_sources(attr, list(scaled.values()))
    sq = sq.cpu().tolist()
    sharded.grad_sq = {id(t): v for ts in (sharded.sources, sharded.params) for t, v in zip(ts, sq)}
    return summed


def _reduce_scatter(group, chunks: List[torch.Tensor], me: int, should_abort) -> torch.Tensor:
    """The SUM over the group of everyone's `chunks[me]`."""
    nccl = getattr(dist, "ProcessGroupNCCL", None)
    if nccl is not None and isinstance(group, nccl):  # untested here (no GPU in CI)
        out = torch.empty_like(chunks[me])
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        groups.wait_(group.reduce_scatter([out], [chunks], opts), should_abort)
        return out
    # gloo's reduce-scatter runs inside wait() (its work never reports completion, so a wait could
    # not be abandoned when a peer declares the step failed): the all-reduce, own chunk kept
    flat = torch.cat(chunks)
    groups.allreduce_sum_(group, flat, should_abort=should_abort)
    return flat.view(len(chunks), -1)[me].clone()


def _device(tensors: Sequence[torch.Tensor]) -> torch.device:
    return tensors[0].device if len(tensors) else torch.device("cpu")
