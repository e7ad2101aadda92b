"""How a rank leaves a job it cannot stay in.

* Retiring (exit 4): this rank cannot be trusted in the job any more (left out of a generation, or
  its group's abort never returned); its launcher restarts it and it rejoins with its replica.
* Giving up (exit 3, errors.run_to_exit): the job cannot go on; a checkpoint of the last committed
  step is written (give_up.py) and every rank learns it from the store.
"""

from __future__ import annotations

from typing import Any, Sequence

from megatron_mecefo.errors import RETIRED_EXIT_CODE, GaveUp, JobAborted, exit_now

__all__ = ["retire", "give_up"]


def retire(events, rank: int, generation: int, members: Sequence[int], why: str, **record: Any) -> None:
    """Leave the job at once, from any thread: the launcher restarts this rank and it rejoins (its
    replica whole); the others see it exit and go on without it."""
    events.write("retired", generation=generation, members=list(members), **record)
    exit_now(RETIRED_EXIT_CODE, f"[mecefo] rank {rank}: {why}; leaving so the launcher restarts it")


def give_up(error: GaveUp, *, checkpoint, membership, events, log, step: int, generation: int,
            members: Sequence[int], has_state: bool) -> None:
    """End this rank's part in a job that cannot go on: the first state holder to get here writes a
    checkpoint of the last committed step (`checkpoint`, give_up.GiveUpCheckpoint; every rank of its
    replica writes its shard), the job is marked failed in the store, and `error.checkpoint` says
    where the checkpoint is (None: not here)."""
    reason = str(error).splitlines()[0]
    if not isinstance(error, JobAborted):
        log.error("giving up: %s", reason)
    ckpt = checkpoint.write(step, has_state=has_state, survivors=getattr(error, "members", None),
                            shard_peers=getattr(error, "peers", None), writer=getattr(error, "writer", None))
    error.checkpoint = ckpt
    try:
        membership.mark_failed(reason, generation=generation, step=step)
    except Exception:
        pass
    events.write("gave_up", kind=type(error).__name__, reason=reason, generation=generation, step=step,
                 members=getattr(error, "members", list(members)), has_state=has_state, checkpoint=ckpt)
    membership.watch_exclusion(None)
