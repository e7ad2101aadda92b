"""Data-parallel process groups, rebuilt among the members of each generation.

Each generation gets a fresh group over `PrefixStore(f"mecefo/gen{g}/dp", store)`, so its
rendezvous keys never collide with an earlier, broken one; with tensor or pipeline parallelism there
is one per (tp, pp) position. Only members call `build_dp_group`; nothing else (the replica's own
tensor- and pipeline-parallel groups) is touched.

gloo (CPU, tested): `ProcessGroupGloo(prefix_store, rank, size, timeout)`; the timeout bounds how
long a hung peer can stall a collective. A broken group is aborted and dropped.

NCCL (GPU; written per PyTorch's documented API, NOT exercised by CI, see docs/design.md "NCCL"):
`ProcessGroupNCCL` with the same store prefix, `Options._timeout` and a non-blocking communicator
(`config.blocking = 0`), connected right away (`eager_connect_single_device`) from a helper thread
while the caller polls `should_abort` and a deadline: a member that died after the agreement would
otherwise leave the others blocked inside the communicator's init at the first collective, where
nothing polls (torchft's pattern). The process environment comes from nccl_env.py.

Every abort is bounded (`destroy_group`, `release`): NCCL's abort can hang in some versions
(pytorch#119215, #149153); past the deadline it raises AbortHung and the runtime retires the rank,
as it does a rank left out of a generation (its launcher restarts it). A group is only ever
aborted, never shut down or destroyed (a destroy waits for a dead peer). An aborted group must not
be referenced any more: a communicator's memory (~0.5 GB on a GPU) is freed only with the object
(`alive()` counts).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from datetime import timedelta
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

__all__ = ["build_dp_group", "destroy_group", "release", "dense_rank", "nccl_options", "connect", "alive", "AbortHung",
           "allreduce_min_", "replica_min"]

logger = logging.getLogger(__name__)

_BUILT: "weakref.WeakSet" = weakref.WeakSet()  # every group built here that still exists


class AbortHung(RuntimeError):
    """A group's abort did not return within its deadline (NCCL's abort can hang): the process
    cannot be trusted to build another communicator and must leave (the runtime retires it)."""


def alive(collect: bool = True) -> int:
    """How many groups built here still exist (after a regroup: one per (tp, pp) position this
    rank holds; more means an old communicator is still referenced and its memory not freed).
    `collect=False` counts without a garbage collection first (a full one takes ~0.25 s in a
    process holding torch, DeepSpeed and Megatron): then an old group left in a reference cycle,
    which waits for the collector, counts as alive too."""
    if collect:
        import gc

        gc.collect()
    return len(_BUILT)


def default_backend() -> str:
    """The backend of the runtime's groups and of a rank's replica: NCCL on a CUDA machine (its
    recovery path follows PyTorch's documented APIs, untested here), gloo otherwise."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def dense_rank(members: Sequence[int], rank: int) -> int:
    """Position of `rank` among the sorted members: its rank inside the generation's group."""
    return sorted(members).index(rank)


def build_dp_group(store: dist.Store, generation: int, members: Sequence[int], rank: int, timeout: timedelta,
                   backend: str = "gloo", tag: str = "t0p0", should_abort: Optional[Callable[[], bool]] = None):
    """The data-parallel group of `generation` over `members` (call on every member); `tag` names
    the (tp, pp) position whose group it is (one per position). An NCCL group is connected before
    it returns, within `timeout` (see `connect`; `should_abort` ends the wait early).

    Returns:
        A torch.distributed backend ProcessGroup (gloo or NCCL) of size len(members).
    """
    prefix = dist.PrefixStore(f"mecefo/gen{generation}/dp/{tag}", getattr(store, "raw", store))
    size, me = len(members), dense_rank(members, rank)
    if backend == "gloo":  # connects in its constructor, bounded by `timeout`
        group = dist.ProcessGroupGloo(prefix, me, size, timeout)
    elif backend == "nccl":  # untested here (no GPU in CI)
        group = dist.ProcessGroupNCCL(prefix, me, size, nccl_options(timeout))
        connect(group, torch.device("cuda", torch.cuda.current_device()), timeout, should_abort)
    else:
        raise ValueError(f"unsupported backend {backend!r} (gloo or nccl)")
    _BUILT.add(group)
    return group


def nccl_options(timeout: timedelta, options_type=None):
    """Options of a generation's NCCL group: the collective timeout, and a non-blocking
    communicator (its init and abort can be interrupted: hazard (b) of docs/design.md "NCCL";
    NCCL's own waits are bounded by TORCH_NCCL_NONBLOCKING_TIMEOUT, nccl_env.py)."""
    opts = (options_type or dist.ProcessGroupNCCL.Options)()
    opts._timeout = timeout
    opts.config.blocking = 0
    return opts


def _bounded(fn: Callable[[], None], name: str, deadline: float, should_abort: Optional[Callable[[], bool]] = None,
             poll_s: float = 0.05) -> Optional[BaseException]:
    """Run `fn` on a daemon thread; wait until it returns, `deadline` (time.monotonic()) passes or
    `should_abort()`. Returns its exception (None when it returned); raises TimeoutError or
    PeerAborted when the wait ended first (the thread is left behind: it may never return)."""
    done, raised = threading.Event(), []

    def run() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: B902 - handed to the caller
            raised.append(e)
        finally:
            done.set()

    threading.Thread(target=run, name=f"mecefo-{name}", daemon=True).start()
    while not done.wait(poll_s):
        if should_abort is not None and should_abort():
            raise PeerAborted(f"{name}: a peer declared this generation failed")
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{name} did not return within its deadline")
    return raised[0] if raised else None


def connect(group, device, timeout: timedelta, should_abort: Optional[Callable[[], bool]] = None) -> None:
    """Build `group`'s communicator now (`eager_connect_single_device`), not at its first
    collective: a member that died after the agreement leaves the others waiting in the init, and
    here that wait is bounded by `timeout` and `should_abort`; then the group is aborted (bounded,
    see destroy_group) and the error raised, so the generation fails to form and the members agree
    on the next one."""
    try:
        error = _bounded(lambda: group.eager_connect_single_device(device), "nccl-connect",
                         time.monotonic() + timeout.total_seconds(), should_abort)
    except (TimeoutError, PeerAborted):
        destroy_group(group, timeout.total_seconds())
        raise
    if error is not None:
        destroy_group(group, timeout.total_seconds())
        raise error


def destroy_group(group, deadline_s: float = 60.0) -> None:
    """Abort a (possibly broken) group so its communicator, sockets and threads go away, waiting at
    most `deadline_s` for the abort (`release` of one group).

    Raises:
        AbortHung: the abort did not return in time (the rank must leave the job).
    """
    release([group], deadline_s)


def release(backends: Sequence, deadline_s: float = 60.0, nccl_version: Optional[tuple] = None) -> None:
    """Abort every group in `backends` (a generation's, on this rank) within one deadline, on one
    helper thread. Abort only: never `shutdown()` or `destroy_process_group` on a group whose peer
    may be dead (they finalize and destroy the communicator, which waits for the dead peer:
    pytorch PR 180611). Each NCCL backend's `abort()` aborts all its communicators inside one
    ncclGroupStart/End from NCCL 2.22 (abortCommsFromMap; pytorch#150690), so a generation keeps
    its communicators in one backend; several NCCL backends are also bracketed in the first one's
    `_group_start()` / `_group_end()`, as torch's own `_abort_process_group` does for the world
    (docs/design.md, "NCCL": what each call does). Errors of groups already broken are ignored.

    Raises:
        AbortHung: the aborts did not return in time (the rank must leave the job).
    """
    live = [g for g in backends if g is not None]
    if not live:
        return
    bracket = _bracket(live, nccl_version)
    errors: list = []

    def abort_all() -> None:
        if bracket is not None:
            bracket._group_start()
        try:
            for g in live:
                try:
                    g.abort()
                except Exception as e:  # already broken: nothing more to release
                    errors.append(e)
        finally:
            if bracket is not None:
                bracket._group_end()

    what = "aborting the data-parallel group" if len(live) == 1 else f"aborting {len(live)} groups"
    try:
        error = _bounded(abort_all, "abort", time.monotonic() + deadline_s)
    except TimeoutError:
        raise AbortHung(f"{what} did not return within {deadline_s:g} s") from None
    for e in errors + ([error] if error is not None else []):
        logger.debug("abort of a broken group raised %s", e)


def _bracket(live: Sequence, nccl_version: Optional[tuple]):
    """The group whose `_group_start`/`_group_end` bracket several NCCL backends' aborts: only
    where every one is an NCCL backend and the NCCL aborts as a group (>= 2.22)."""
    if len(live) < 2 or not all(hasattr(g, "_group_start") and hasattr(g, "_group_end") for g in live):
        return None
    from megatron_mecefo.elastic.comm import nccl_env

    version = nccl_version if nccl_version is not None else nccl_env.runtime_version()
    return live[0] if version is not None and tuple(version) >= nccl_env.GROUP_ABORT_SINCE else None


class PeerAborted(RuntimeError):
    """Another member gave up on the collective (it saw a failure first)."""


def allreduce_sum_(group, tensor: torch.Tensor, should_abort: Optional[Callable[[], bool]] = None,
                   poll_s: float = 0.05) -> None:
    """In-place SUM all-reduce over `group`; raises on a peer failure or timeout (see wait_)."""
    wait_(allreduce_sum_async_(group, tensor), should_abort, poll_s)


def allreduce_min_(group, tensor: torch.Tensor, should_abort: Optional[Callable[[], bool]] = None) -> None:
    """In-place MIN all-reduce over `group`; raises on a peer failure or timeout (see wait_)."""
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MIN
    wait_(group.allreduce([tensor], opts), should_abort)


def replica_min(values: Sequence[float]) -> list:
    """Element-wise MIN of `values` over this rank's replica: torch.distributed's default group,
    which spans the replica's T x P ranks under MeCeFO (bootstrap.init_distributed). Raises on a
    failed rank."""
    if not dist.is_initialized():
        raise RuntimeError("tensor or pipeline parallelism needs torch.distributed initialised over the replica "
                           "(megatron_mecefo.elastic.launch.bootstrap.init_distributed)")
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor(list(values), dtype=torch.float32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return t.tolist()


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
