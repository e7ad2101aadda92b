"""Handing the training state to a rejoining rank: the lowest state holder at a (tp, pp) position
broadcasts it over that position's data-parallel group as bytes (`torch.save` of plain data), and
joiners load it with `weights_only=True` (tensors and plain containers only: nothing received can
run code). Knows a group and bytes, not what the state holds (the host's `training_state`)."""

from __future__ import annotations

import io
from typing import Any, Callable, Optional, Sequence

import torch

from megatron_mecefo.elastic.comm import groups
from megatron_mecefo.errors import MeCeFOError

__all__ = ["broadcast_state", "decode_state"]


def broadcast_state(group, peers: Sequence[int], rank: int, donor: int, state: Callable[[], Any], *,
                    step: int, midway: Callable[[], None] = lambda: None,
                    should_abort: Optional[Callable[[], bool]] = None) -> bytes:
    """Broadcast the donor's `{"step", "user": state()}` to `peers` (global ranks, in the group's
    order). Every peer calls it; returns the payload's bytes on every rank.

    `midway` runs between the size and the payload (an injection point: a death mid-transfer);
    `should_abort` is polled while waiting (groups.wait_)."""
    root = groups.dense_rank(peers, donor)
    if rank == donor:
        buf = io.BytesIO()
        torch.save({"step": step, "user": state()}, buf)
        payload = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
    else:
        size = torch.zeros(1, dtype=torch.int64)
    groups.broadcast_(group, size, root, should_abort)
    midway()
    if rank != donor:
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
    groups.broadcast_(group, payload, root, should_abort)
    return payload.numpy().tobytes()


def decode_state(payload: bytes, *, step: int, rank: int) -> Optional[Any]:
    """The user state in `payload`, checked to be of `step`.

    Raises:
        MeCeFOError: the state of another step.
    """
    state = torch.load(io.BytesIO(payload), weights_only=True)  # tensors and plain containers only
    if state["step"] != step:
        raise MeCeFOError(f"[rank {rank}] received the state of step {state['step']}, expected {step}")
    return state["user"]
