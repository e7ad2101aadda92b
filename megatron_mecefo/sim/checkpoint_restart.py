"""Checkpoint-restart: compute `interval_s`, write a checkpoint (`write_s`, blocking), repeat; a
failure loses everything since the last completed write and costs a restart (`restart_s`: detect,
reschedule, initialize, load), during which another failure starts the restart over. This is the
model of Young (1974) and Daly (2006), whose expected time per segment it must reproduce:

    E[T] = M e^(u/M) (e^((interval + write)/M) - 1),   M = 1 / cluster failure rate, u = restart_s

Spares or requeue are assumed to give the restarted job a full world at once (no wait for a repair).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, Sequence

from megatron_mecefo.sim.engine import Outcome
from megatron_mecefo.sim.trace import Failure

__all__ = ["CheckpointRestart", "daly_interval", "daly_segment_time"]


def daly_interval(write_s: float, mtbf_s: float) -> float:
    """Daly's (2006) near-optimal compute time between checkpoints (Young's sqrt(2 w M) plus
    higher-order terms; M itself when w >= 2 M)."""
    if write_s >= 2 * mtbf_s:
        return mtbf_s
    x = write_s / (2 * mtbf_s)
    return math.sqrt(2 * write_s * mtbf_s) * (1 + math.sqrt(x) / 3 + x / 9) - write_s


def daly_segment_time(interval_s: float, write_s: float, restart_s: float, mtbf_s: float) -> float:
    """Expected wall time to complete one segment (compute + write) under Poisson failures."""
    m = mtbf_s
    return m * math.exp(restart_s / m) * (math.exp((interval_s + write_s) / m) - 1)


@dataclasses.dataclass
class CheckpointRestart:
    interval_s: float
    write_s: float
    restart_s: float

    def __post_init__(self) -> None:
        if not (self.interval_s > 0 and self.write_s >= 0 and self.restart_s >= 0):
            raise ValueError("checkpoint-restart needs interval_s > 0, write_s >= 0 and restart_s >= 0")

    @property
    def failure_free_ettr(self) -> float:
        return self.interval_s / (self.interval_s + self.write_s)

    def run(self, trace: Sequence[Failure], horizon_s: float) -> Outcome:
        failures = [f.t for f in trace if f.t < horizon_s] + [math.inf]
        i, t, progress = 0, 0.0, 0.0
        lost = {"checkpoint": 0.0, "lost_work": 0.0, "restart": 0.0}
        segments = 0
        while t < horizon_s:
            end = min(t + self.interval_s + self.write_s, horizon_s)
            if failures[i] < end:  # the segment (compute and write so far) is lost
                lost["lost_work"] += failures[i] - t
                t = failures[i]
                i += 1
                while True:  # restart; a failure during it starts it over
                    done = min(t + self.restart_s, horizon_s)
                    if failures[i] < done:
                        lost["restart"] += failures[i] - t
                        t = failures[i]
                        i += 1
                        continue
                    lost["restart"] += done - t
                    t = done
                    break
                continue
            computed = min(end - t, self.interval_s)
            progress += computed  # at the horizon a segment's compute counts, its write does not exist yet
            lost["checkpoint"] += (end - t) - computed
            segments += end == t + self.interval_s + self.write_s
            t = end
        breakdown: Dict[str, float] = {k: v for k, v in lost.items() if v}
        out = Outcome(horizon_s, progress, breakdown, 0.0, len(failures) - 1, [])
        out.segments = segments  # type: ignore[attr-defined]  # for the Daly check
        return out
