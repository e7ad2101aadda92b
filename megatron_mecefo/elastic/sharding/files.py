"""A ShardedOptimizer's checkpoint files (zero.py): one file per held range, written by its holder
beside the host's checkpoint; the whole state collected from them once a save's files cover it
(for a host to write in its upstream format); a directory of them read as a StateSource."""

from __future__ import annotations

import glob
import os
import time
from typing import Dict, List, Optional

import torch

from megatron_mecefo.elastic.sharding.state_source import Piece, StateSource

__all__ = ["ShardFiles", "SHARD_FILE"]

SHARD_FILE = "mecefo_optim_{tag}_{start}-{end}.pt"
"""One held range of one (tp, pp) position's state in a checkpoint directory."""


class ShardFiles:
    """The files of one ShardedOptimizer (`opt`): its position's tag, its held ranges, its keys."""

    def __init__(self, opt) -> None:
        self.opt = opt

    def save(self, directory: str, *, copies: bool = True, stamp: str = "") -> List[str]:
        """Write this rank's held ranges under `directory` (every rank writes its own; a range two
        ranks hold is written twice with the same content, atomically); `copies` False: the shard
        only (the owners' shards cover the state once). `stamp` marks this save (`collect`).
        Returns the paths."""
        os.makedirs(directory, exist_ok=True)
        paths = []
        for name, held in self.opt.held.items():
            if name == "copy" and not copies:
                continue
            path = os.path.join(directory, SHARD_FILE.format(tag=self.opt.tag, start=held.start, end=held.end))
            tmp = f"{path}.tmp{os.getpid()}"
            segments = [(lo, hi, {k: float(held.inner.state[m][k]) for k in self.opt.fresh_scalars})
                        for m, g, lo, hi in held.parts]
            torch.save({"numel": self.opt.numel, "start": held.start, "end": held.end, "keys": self.opt.keys,
                        "state": dict(held.state), "segments": segments, "stamp": stamp}, tmp)
            os.replace(tmp, path)
            paths.append(path)
        return paths

    def collect(self, directory: str, stamp: str, timeout_s: float, log=None):
        """The whole state, once the shard files of the save `stamp` under `directory` cover it (the
        owners write theirs at the same step): ({key: flat values}, {scalar: per element}, their
        paths); None when they do not within timeout_s (logged to `log`: the files stay)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                source, paths = self.shard_files(directory, stamp=stamp), self._files(directory)
                break
            except ValueError:
                if time.monotonic() > deadline:
                    if log is not None:
                        log.warning("%s: not every optimizer shard was written within %.0f s: the state stays in "
                                    "MeCeFO's shard files (MeCeFO resumes them; the host alone does not)",
                                    directory, timeout_s)
                    return None
                time.sleep(0.05)
        state = {k: source.read(k, 0, self.opt.numel) for k in self.opt.keys}
        return state, dict(zip(self.opt.fresh_scalars, source.scalars(self.opt.fresh_scalars, 0, self.opt.numel))), paths

    def group_steps(self, scalars: Dict[str, torch.Tensor]) -> List[float]:
        """Each param group's step count from `collect`'s per-element scalars (a range rebuilt by
        "reinit" restarted lower: a format with one step per group takes the group's highest)."""
        return [float(scalars["step"][a:b].max()) if "step" in scalars and b > a else 0.0
                for a, b in self.opt.group_bounds]

    def _files(self, directory: str) -> List[str]:
        return glob.glob(os.path.join(directory, SHARD_FILE.format(tag=self.opt.tag, start="*", end="*")))

    def has_files(self, directory: str) -> bool:
        return bool(self._files(directory))

    def shard_files(self, directory: str, stamp: Optional[str] = None) -> StateSource:
        pieces, keys = [], self.opt.keys
        for path in self._files(directory):
            head = torch.load(path, weights_only=True, mmap=True)
            if stamp is not None and head.get("stamp") != stamp:
                continue  # another save's
            if head["numel"] != self.opt.numel or list(head["keys"]) != self.opt.keys:
                raise ValueError(f"{path}: optimizer state of {head['numel']} elements {head['keys']}, this model's "
                                 f"optimizer has {self.opt.numel} {self.opt.keys}")
            a = int(head["start"])

            def tensor(key, path=path):
                return torch.load(path, weights_only=True, mmap=True)["state"][key]

            for lo, hi, values in head["segments"]:  # a segment: one value of each scalar
                pieces.append(Piece(lo, hi, lambda k, i, j, t=tensor, at=lo - a: t(k)[at + i:at + j],
                                    {k: float(v) for k, v in values.items()}))
        return StateSource(self.opt.numel, pieces, keys, origin=f"{directory} (MeCeFO's shard files)")
