"""Data-parallel process groups, rebuilt among the members of each generation.

Each generation gets a fresh group over `PrefixStore(f"mecefo/gen{g}/dp", store)`, so its
rendezvous keys never collide with an earlier, broken one; with tensor or pipeline parallelism there
is one per (tp, pp) position. Only members call `build_dp_group`; nothing else (the replica's own
tensor- and pipeline-parallel groups) is touched.

gloo (CPU, tested): `ProcessGroupGloo(prefix_store, rank, size, timeout)`; the timeout bounds how
long a hung peer can stall a collective. A broken group is aborted and dropped.

NCCL (GPU; written per PyTorch's documented API, NOT exercised by CI): `ProcessGroupNCCL` with the
same store prefix and `Options._timeout`; set TORCH_NCCL_ASYNC_ERROR_HANDLING to 2 (or 0) before
CUDA initialisation so a failed communicator raises instead of tearing the process down (the
default, 3, kills it), and call `abort()` on the broken group before building the next one.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

__all__ = ["build_dp_group", "destroy_group", "dense_rank"]

logger = logging.getLogger(__name__)


def default_backend() -> str:
    """The backend of the runtime's groups and of a rank's replica: NCCL on a CUDA machine (its
    recovery path follows PyTorch's documented APIs, untested here), gloo otherwise."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def dense_rank(members: Sequence[int], rank: int) -> int:
    """Position of `rank` among the sorted members: its rank inside the generation's group."""
    return sorted(members).index(rank)


def build_dp_group(store: dist.Store, generation: int, members: Sequence[int], rank: int, timeout: timedelta,
                   backend: str = "gloo", tag: str = "t0p0"):
    """The data-parallel group of `generation` over `members` (call on every member); `tag` names
    the (tp, pp) position whose group it is (one per position).

    Returns:
        A torch.distributed backend ProcessGroup (gloo or NCCL) of size len(members).
    """
    prefix = dist.PrefixStore(f"mecefo/gen{generation}/dp/{tag}", store)
    size, me = len(members), dense_rank(members, rank)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefix, me, size, timeout)
    if backend == "nccl":  # untested here (no GPU in CI)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(prefix, me, size, opts)
    raise ValueError(f"unsupported backend {backend!r} (gloo or nccl)")


def destroy_group(group) -> None:
    """Abort a (possibly broken) group so its sockets and threads go away."""
    if group is None:
        return
    try:
        group.abort()
    except Exception as e:  # already broken: nothing more to release
        logger.debug("abort of a broken group raised %s", e)


class PeerAborted(RuntimeError):
    """Another member gave up on the collective (it saw a failure first)."""


def allreduce_sum_(group, tensor: torch.Tensor, should_abort: Optional[Callable[[], bool]] = None,
                   poll_s: float = 0.05) -> None:
    """In-place SUM all-reduce over `group`; raises on a peer failure or timeout (see wait_)."""
    wait_(allreduce_sum_async_(group, tensor), should_abort, poll_s)


def allreduce_sum_async_(group, tensor: torch.Tensor):
    """Launch an in-place SUM all-reduce over `group`; returns its work (wait with wait_)."""
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    return group.allreduce([tensor], opts)


def wait_(work, should_abort: Optional[Callable[[], bool]] = None, poll_s: float = 0.05) -> None:
    """Wait for a collective's `work`; raises on a peer failure or timeout.

    With `should_abort`, the wait polls it every `poll_s`: a member whose peer already declared the
    step failed stops waiting at once instead of after the group's timeout (a survivor that gave
    up no longer feeds the collective, so without this the others would wait for the timeout).
    """
    if should_abort is None:
        work.wait()
        return
    next_check = time.monotonic() + poll_s
    while not work.is_completed():
        if time.monotonic() >= next_check:
            if should_abort():
                raise PeerAborted("a peer declared this step (or generation) failed")
            next_check = time.monotonic() + poll_s
        time.sleep(0.001)
    work.wait()  # raises the collective's own error, if any


def broadcast_(group, tensor: torch.Tensor, root: int, should_abort: Optional[Callable[[], bool]] = None) -> None:
    """In-place broadcast from dense rank `root` over `group` (`should_abort`: see wait_)."""
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    opts.rootTensor = 0
    wait_(group.broadcast([tensor], opts), should_abort)
