"""The run's record survives the lead: every committed iteration's log line and every evaluation
is printed once, by whichever replica leads when it is due, and TensorBoard writes follow.

Upstream's log functions (`training_log`, `evaluate_and_print_results`) run on every replica (each
computes the job's loss). Every replica captures what a call prints and writes to its TensorBoard
writer (each replica's logging rank has one, see `make_tb_writer`); the lead (the lowest live replica) emits it at once and records in the job's store
the last entry it emitted; the others keep their last entries. A replica that becomes the lead
(the old one died after a step was committed and before it printed) first emits what it holds
beyond the store's mark (one per position in the replica: each prints its own lines), and so does, when training ends, the lowest replica still alive if the
lead died at the end. Entries are keyed by (committed iteration, call number within it), the
same on every replica. What it does not handle: a lead that dies between printing a line and
recording it (a window of microseconds) makes the line appear twice; W&B keeps upstream's single
run on the job's last rank (a run per replica would split the dashboard), so it pauses while that
rank is down, as without MeCeFO.

Why every replica's line is the line upstream prints: each replica's `training_log` gets the job's
loss (the step's all-reduced statistics), the same counters (iteration, consumed samples, learning
rate: the same scheduler) and the same grad norm, and adds the loss to the sums upstream's `train()`
keeps over the log interval in locals (`total_loss_dict`, `report_memory_flag`, Megatron-LM's
`is_first_iteration`). Replicas that started together keep equal sums. A restarted rank starts
`train()` afresh, so its sums would start empty, its first line would not reset them (Megatron-LM)
and it would report memory again: if it later led, its lines would differ from upstream's. It
receives the others' sums and flags with the training state instead (`Carry`, sent with the
counters) and applies them at its first call. Upstream's own first line after a load is kept as
upstream prints it: Megatron-LM does not reset its sums on the first iteration of `train()`, so
with `--log-interval 1` the second line after a `--load` is the mean of two iterations, in an
unpatched resume as with `--mecefo`; Megatron-DeepSpeed resets every time.
"""

from __future__ import annotations

import collections
import contextlib
import inspect
import io
import json
import sys
import time
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

__all__ = ["Record", "Recorder", "Carry", "tensorboard_writer"]

_MARK = "record/emitted"
_KEEP = 64  # entries kept by a non-lead replica: a dead lead is replaced within a step or two


class Recorder:
    """A stand-in for a TensorBoard SummaryWriter: records every call."""

    def __init__(self, calls: List[Tuple[str, str, tuple, dict]], kind: str) -> None:
        self._calls, self._kind = calls, kind

    def __getattr__(self, name: str) -> Callable[..., None]:
        def record(*args: Any, **kwargs: Any) -> None:
            self._calls.append((self._kind, name, args, kwargs))

        return record


class Carry:
    """What upstream's `train()` keeps from one `training_log` call to the next in its locals: the
    sums of the log interval (`total_loss_dict`), `report_memory_flag` and, in Megatron-LM,
    `is_first_iteration`. `state()` is plain data (sent to a rejoining rank with the counters);
    `receive()` keeps it for the rank's first call, where `bind()` puts it into the arguments."""

    def __init__(self) -> None:
        self._sums: Optional[dict] = None
        """upstream's `total_loss_dict` (the same dict on every call of one `train()`)."""
        self._report_memory: Optional[bool] = None
        self._received: Optional[Dict[str, Any]] = None

    def state(self) -> Dict[str, Any]:
        if self._sums is None:  # no line yet: a joiner starts as upstream's train() does
            return {}
        return {"sums": {k: (v.item() if hasattr(v, "item") else v) for k, v in self._sums.items()},
                "report_memory": self._report_memory}

    def receive(self, state: Optional[Dict[str, Any]]) -> None:
        self._received = state or None

    def bind(self, signature: inspect.Signature, a: tuple, kw: dict) -> Tuple[tuple, dict]:
        """`training_log`'s arguments, with what a rejoining rank received put in at its first call."""
        bound = signature.bind(*a, **kw)
        self._sums = bound.arguments["total_loss_dict"]
        got, self._received = self._received, None
        if got:
            import torch

            near = [v for v in list(bound.arguments["loss_dict"].values()) + list(self._sums.values())
                    if torch.is_tensor(v)]
            device = near[0].device if near else None
            for key, value in got["sums"].items():  # upstream: a float tensor per loss, ints per count
                self._sums[key] = torch.tensor([value], dtype=torch.float, device=device) \
                    if isinstance(value, float) else value
            bound.arguments["report_memory_flag"] = got["report_memory"]
            if "is_first_iteration" in signature.parameters:  # the others have logged a line
                bound.arguments["is_first_iteration"] = False
        return bound.args, bound.kwargs

    def returned(self, report_memory_flag) -> None:
        self._report_memory = bool(report_memory_flag)


class Record:
    """Wraps upstream's log functions for one rank (see the module docstring).

    Args:
        run: the adapter's `run.Run` (its driver, its lead()).
        training: upstream's training module (its `get_tensorboard_writer` / `get_wandb_writer`).
        make_tb_writer: () -> a SummaryWriter or None, for a replica whose rank upstream gave none
            (upstream creates one on the job's last rank only).
    """

    def __init__(self, run, training, make_tb_writer: Callable[[], Any] = lambda: None) -> None:
        self.run = run
        self.training = training
        self.make_tb_writer = make_tb_writer
        self.pending: Deque[Tuple[Tuple[int, int], str, list]] = collections.deque(maxlen=_KEEP)
        self._key: Tuple[int, int] = (-1, -1)
        self._was_lead = False
        self._tb = None
        self._getters: Optional[dict] = None
        self.carry = Carry()
        """upstream's log sums and flags: what a rejoining rank receives (`Carry`)."""

    # -- wrapping ---------------------------------------------------------------------------------

    def wrap(self, original: Callable, *, carries: bool = False) -> Callable:
        """`original` recorded; `carries`: it is upstream's `training_log` (its sums and flags are
        the `Carry`)."""
        signature = inspect.signature(original) if carries else None

        def logged(*a, **kw):
            if not self.run.active or self.run.driver is None:
                return original(*a, **kw)
            if carries:
                a, kw = self.carry.bind(signature, a, kw)
            key = self._next_key()
            text, calls = io.StringIO(), []
            with contextlib.redirect_stdout(text), self._recording(calls):
                out = original(*a, **kw)
            if carries:
                self.carry.returned(out)
            self._add(key, text.getvalue(), calls)
            return out

        return logged

    def _next_key(self) -> Tuple[int, int]:
        iteration = self.run.driver.committed
        self._key = (iteration, self._key[1] + 1 if self._key[0] == iteration else 0)
        return self._key

    @contextlib.contextmanager
    def _recording(self, calls: list):
        t = self.training
        if self._getters is None:
            self._getters = {"get_tensorboard_writer": t.get_tensorboard_writer} \
                if hasattr(t, "get_tensorboard_writer") else {}
        tb = self._getters.get("get_tensorboard_writer")
        if tb is not None:
            t.get_tensorboard_writer = lambda: Recorder(calls, "tb") if (tb() or self._tb_wanted()) else None
        try:
            yield
        finally:
            for name, getter in self._getters.items():
                setattr(t, name, getter)

    def _tb_wanted(self) -> bool:
        """Upstream gave this rank no writer: one is made for the rank that logs in each replica
        (its last, where upstream prints), so that TensorBoard moves with the lead."""
        import torch.distributed as dist

        logs = not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1
        return logs and self._tb_writer() is not None

    def _tb_writer(self):
        if self._tb is None:
            self._tb = self._getters["get_tensorboard_writer"]() or self.make_tb_writer()
        return self._tb

    # -- emitting ---------------------------------------------------------------------------------

    def _add(self, key, text: str, calls: list) -> None:
        if text or calls:
            self.pending.append((key, text, calls))
        lead = self.run.lead()
        if lead:
            if not self._was_lead:  # the lead changed: emit what the old one had not
                self._emit(after=self._mark())
            else:
                self._emit(after=(key[0], key[1] - 1))
        self._was_lead = lead

    def _mark(self) -> Tuple[int, int]:
        """The last entry emitted at this rank's (tp, pp) position: each position of a replica prints
        its own lines (a pipeline's last stage the losses, its first stage the memory report), so
        each keeps its own mark."""
        mark = self.run.driver.runtime.marks.read(_MARK)
        return tuple(json.loads(mark)) if mark is not None else (-1, -1)

    def _emit(self, after: Tuple[int, int]) -> None:
        last = None
        while self.pending:
            key, text, calls = self.pending.popleft()
            if key <= after:
                continue
            sys.stdout.write(text)
            for _, name, args, kwargs in calls:
                writer = self._tb_writer()
                if writer is not None:
                    getattr(writer, name)(*args, **kwargs)
            last = key
        if last is not None:
            sys.stdout.flush()
            self.run.driver.runtime.marks.write(_MARK, json.dumps(list(last)))

    def finish(self, timeout_s: float) -> None:
        """At the end of training: if the lead died with entries this replica holds unprinted, the
        lowest replica still alive emits them. Waits at most `timeout_s` for the lead to print."""
        if not self.pending or self.run.driver is None:
            return
        deadline = time.monotonic() + timeout_s
        while True:
            if self._mark() >= self.pending[-1][0]:
                return  # the lead printed everything
            if self.run.driver.runtime.marks.leads_among_whole():
                self._emit(after=self._mark())
                return
            if time.monotonic() > deadline:
                return
            time.sleep(0.2)


def tensorboard_writer(args):
    """A TensorBoard writer as upstream makes one (None without --tensorboard-dir): upstream makes it
    on the job's last rank only; the record makes one on each replica's logging rank so that
    TensorBoard moves with the lead."""
    if not getattr(args, "tensorboard_dir", None):
        return None
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=args.tensorboard_dir, max_queue=getattr(args, "tensorboard_queue_size", 1000))
