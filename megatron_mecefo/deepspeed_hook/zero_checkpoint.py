"""DeepSpeed's ZeRO stage 1 / 2 optimizer files as the start of MeCeFO's sharded state.

A ZeRO checkpoint (`DIR/global_stepN/zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt`, one per
data-parallel rank of the run that wrote it; `bf16_` in front under DeepSpeed's bf16 optimizer)
holds, per param group, that rank's partition of the group's flat fp32 parameters
(`single_partition_of_fp32_groups`, saved without DeepSpeed's alignment padding) and of the base
optimizer's state (`base_optimizer_state`: the torch optimizer's state_dict, padded; or, with
"elastic_checkpoint", a list of unpadded states). A group is flattened in its parameters' order,
and the groups in order: the same flat range as MeCeFO's (elastic/sharding/zero.py), so the partitions of
every rank, concatenated per group, are MeCeFO's state at any replica count.

The engine under MeCeFO runs stage 0 (the runtime shards), which would read a ZeRO checkpoint's
`optimizer` (None) and fail: `skip_zero_optimizer` makes it load model, scheduler and counters only.

Saving (`write_zero_checkpoint`): the engine's model-state file says 1 data-parallel rank (its
world is the replica), so the state is written as one ZeRO stage-1 rank's file holding every
element, in DeepSpeed's unpadded ("elastic") per-group form, which its stage 1/2 optimizer pads
to its own partition on load: plain DeepSpeed resumes it at one data-parallel rank (at another
count through its universal checkpoint; untested), MeCeFO at any replica count. The owners of
the shards write them as files first; the lead replica's rank gathers them (zero.py `collect`) and
replaces them with the ZeRO file; a give-up checkpoint's writer does the same with the holders'.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import os
import re
from typing import List, Optional

import torch

from megatron_mecefo.elastic.sharding.state_source import Piece, StateSource

__all__ = ["tag_dir", "zero_files", "zero_state", "skip_zero_optimizer", "write_zero_checkpoint"]

ALIGNMENT = 2
"""DeepSpeed's stage 1/2 flat groups are padded to a multiple of this x the data-parallel size
(`nccl_start_alignment_factor`); the padding is recorded, the values are saved without it."""

_NAME = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


def _name(mp_rank: int, dp_rank: int = 0) -> str:
    return f"zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_optim_states.pt"


def zero_files(tag_dir: str, mp_rank: int = 0) -> List[str]:
    """The ZeRO optimizer files of model-parallel rank `mp_rank` under a checkpoint tag's
    directory, in data-parallel rank order ([] when there are none)."""
    found = {}
    for path in glob.glob(os.path.join(tag_dir, "*zero_pp_rank_*_optim_states.pt")):
        m = _NAME.search(os.path.basename(path))
        if m and int(m.group(2)) == mp_rank:
            found[int(m.group(1))] = path
    if found and sorted(found) != list(range(len(found))):
        raise ValueError(f"{tag_dir}: ZeRO files of data-parallel ranks {sorted(found)}: a rank's file is missing")
    return [found[r] for r in sorted(found)]


@functools.lru_cache(maxsize=64)
def _load(path: str) -> dict:
    """A ZeRO file's optimizer state, memory-mapped; plain data and DeepSpeed's data classes only."""
    from megatron_mecefo.deepspeed_hook.checkpoint import plain_load

    try:
        return plain_load(path, map_location="cpu", mmap=True)["optimizer_state_dict"]
    except Exception as e:
        raise ValueError(f"{path} is not a ZeRO optimizer file MeCeFO can read: {str(e).splitlines()[0]}") from None


def zero_state(tag_dir: str, group_numels: List[int], keys: List[str], mp_rank: int = 0) -> Optional[StateSource]:
    """The state in the ZeRO files under `tag_dir` (None when there are none), checked against an
    optimizer of param groups of `group_numels` elements. Raises ValueError when it does not fit."""
    files = zero_files(tag_dir, mp_rank)
    if not files:
        return None
    origin = f"{tag_dir} (DeepSpeed ZeRO, {len(files)} data-parallel rank{'s' * (len(files) > 1)})"
    heads = [_load(p) for p in files]
    for path, sd in zip(files, heads):
        if int(sd.get("zero_stage", 0)) not in (1, 2) or "single_partition_of_fp32_groups" not in sd:
            raise ValueError(f"{path}: not a ZeRO stage 1 or 2 optimizer file (stage {sd.get('zero_stage')})")
        if len(sd["single_partition_of_fp32_groups"]) != len(group_numels):
            raise ValueError(f"{origin}: {len(sd['single_partition_of_fp32_groups'])} param groups, this job's "
                             f"optimizer has {len(group_numels)}")
    pieces, have, group_start = [], None, 0
    for g, numel in enumerate(group_numels):
        at = group_start
        for r, path in enumerate(files):
            n = heads[r]["single_partition_of_fp32_groups"][g].numel()
            state = _group_state(heads[r], g)
            names = {k for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0} | {"master"}
            have = names if have is None else have & names
            scalars = {k: float(v) for k, v in state.items() if not (torch.is_tensor(v) and v.dim() > 0)
                       and isinstance(v, (int, float, torch.Tensor))}
            pieces.append(Piece(at, at + n, functools.partial(_tensor, path, g), scalars))
            at += n
        if at - group_start != numel:
            raise ValueError(f"{origin}: param group {g} holds {at - group_start} elements, this model's has {numel} "
                             "(another model, or another tensor/pipeline layout)")
        group_start = at
    return StateSource(group_start, pieces, sorted(have or ()), origin)


def _group_state(sd: dict, g: int) -> dict:
    base = sd["base_optimizer_state"]
    if isinstance(base, list):  # "elastic_checkpoint": unpadded, per group
        return base[g]
    return base["state"].get(g, base["state"].get(str(g), {}))


def _tensor(path: str, g: int, key: str, lo: int, hi: int) -> torch.Tensor:
    sd = _load(path)
    if key == "master":
        return sd["single_partition_of_fp32_groups"][g][lo:hi]
    return _group_state(sd, g)[key][lo:hi]  # the rigid state keeps the alignment padding at its end


def write_zero_checkpoint(sharded, tag_dir: str, got, *, mp_rank: int, clip_grad: float) -> str:
    """On the lead replica's rank of a position, with the whole state collected from every rank's
    shard (`got`: StepDriver.save_shards, give_up.collect_given_up): replace the shard files with
    DeepSpeed's ZeRO file of the whole state. Returns its path."""
    import deepspeed
    from deepspeed.checkpoint.constants import BASE_OPTIMIZER_STATE_STEP
    from deepspeed.runtime.zero.config import ZeroStageEnum

    state, scalars, parts = got
    params = state["master"] if "master" in state else sharded.whole_parameters()
    groups, masters, steps = [], [], sharded.files.group_steps(scalars)
    for (a, b), step in zip(sharded.group_bounds, steps):  # views: torch.save keeps one copy of each flat tensor
        groups.append({**{k: v[a:b] for k, v in state.items() if k != "master"}, "step": torch.tensor(step)})
        masters.append(params[a:b])
    sd = {"dynamic_loss_scale": False, "overflow": False, "clip_grad": clip_grad,
          "base_optimizer_state": groups, BASE_OPTIMIZER_STATE_STEP: max(steps, default=0.0),
          "single_partition_of_fp32_groups": masters, "zero_stage": ZeroStageEnum.optimizer_states,
          "group_paddings": [(-(b - a)) % ALIGNMENT for a, b in sharded.group_bounds],
          "partition_count": [1] * len(masters), "ds_version": deepspeed.__version__}
    path = os.path.join(tag_dir, _name(mp_rank))
    torch.save({"optimizer_state_dict": sd, "ds_version": deepspeed.__version__}, f"{path}.tmp{os.getpid()}")
    os.replace(f"{path}.tmp{os.getpid()}", path)
    for part in parts:
        with contextlib.suppress(FileNotFoundError):
            os.remove(part)
    _load.cache_clear()
    return path


@contextlib.contextmanager
def skip_zero_optimizer():
    """While inside, a DeepSpeed engine that runs without ZeRO (MeCeFO's, which shards itself) loads
    a ZeRO checkpoint's model, scheduler and counters, not its optimizer (`zero_state` reads that);
    a checkpoint of another model raises ValueError (a message, not torch's traceback)."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    original = DeepSpeedEngine.load_checkpoint

    def load_checkpoint(self, load_dir, tag=None, load_optimizer_states=True, **kw):
        if load_optimizer_states and not self.zero_optimization():
            found = tag_dir(load_dir, tag)
            load_optimizer_states = not (found and zero_files(found, self.checkpoint_mp_rank))
        try:
            return original(self, load_dir, tag=tag, load_optimizer_states=load_optimizer_states, **kw)
        except RuntimeError as e:
            if "Error(s) in loading state_dict" not in str(e):
                raise
            lines = str(e).splitlines()
            raise ValueError(f"--load {load_dir}: the checkpoint is of another model ({lines[0].strip()} "
                             f"{lines[1].strip() if len(lines) > 1 else ''} ...)") from None

    DeepSpeedEngine.load_checkpoint = load_checkpoint
    try:
        yield
    finally:
        DeepSpeedEngine.load_checkpoint = original


def tag_dir(load_dir: Optional[str], tag=None) -> Optional[str]:
    """The directory of checkpoint `tag` under `load_dir` (None: the tag DeepSpeed's `latest` file
    names); None when there is no such checkpoint."""
    if tag is None:
        latest = os.path.join(load_dir, "latest") if load_dir else None
        if latest is None or not os.path.exists(latest):
            return None
        with open(latest) as f:
            tag = f.read().strip()
    return os.path.join(load_dir, str(tag))
