"""A torch_dist checkpoint read box by box: torch.distributed.checkpoint with a load planner that asks
for one sub-chunk of each requested tensor (no collective), so a rank reads only the ranges it holds."""

from __future__ import annotations

import functools
import io
from typing import Sequence

import torch

__all__ = ["Checkpoint"]


def _box_planner(boxes):
    """A DefaultLoadPlanner asking for one box of each requested tensor (torch.distributed.checkpoint);
    `boxes` ({fqn: (offsets, sizes)}) None: the state dict's objects whole."""
    return _box_planner_type()(boxes)


@functools.lru_cache(maxsize=None)
def _box_planner_type():
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class BoxPlanner(DefaultLoadPlanner):
        def __init__(self, boxes):
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
            self.boxes = boxes

        def create_local_plan(self):
            if self.boxes is None:  # whole objects (BytesIO values)
                return super().create_local_plan()
            items = []
            for fqn, (offsets, sizes) in self.boxes.items():
                chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
                items += create_read_items_for_chunk_list(fqn, self.metadata.state_dict_metadata[fqn], [chunk])
            return LoadPlan(items)

        def lookup_tensor(self, index):  # the box itself: offsets are relative to it
            return self.state_dict[index.fqn]

        def load_bytes(self, read_item, value: io.BytesIO) -> None:  # plain data only
            self.state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)

    return BoxPlanner


class Checkpoint:
    """One torch_dist checkpoint directory, read box by box."""

    def __init__(self, directory: str) -> None:
        from torch.distributed.checkpoint import FileSystemReader

        self.directory = directory
        self.reader = FileSystemReader(directory)
        self.metadata = self.reader.read_metadata().state_dict_metadata

    def box(self, fqn: str, offsets: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
        import torch.distributed.checkpoint as dcp

        md = self.metadata[fqn]
        out = {fqn: torch.empty(tuple(sizes), dtype=md.properties.dtype)}
        dcp.load(out, storage_reader=self.reader, planner=_box_planner({fqn: (tuple(offsets), tuple(sizes))}),
                 no_dist=True)
        return out[fqn]

    def obj(self, key: str):
        """A ShardedObject of one piece (Megatron stores it as `{key}/shard_0_1`), plain data only."""
        import torch.distributed.checkpoint as dcp

        fqn = f"{key}/shard_0_1"
        if fqn not in self.metadata:
            raise ValueError(f"{self.directory}: no {key} in the checkpoint")
        out = {fqn: io.BytesIO()}
        dcp.load(out, storage_reader=self.reader, planner=_box_planner(None), no_dist=True)
        return out[fqn]
