"""The `mpu` object DeepSpeed expects, backed by Megatron-Core's parallel_state.

DeepSpeed calls get_model_parallel_rank/world_size/group, which parallel_state does not have in
that form: they are the model-parallel group of parallel_state (tensor x pipeline ranks), so each
stage's checkpoint shard gets its own mp_rank_XX file. The data-parallel accessors return the
replica-local view (size 1 under MeCeFO: data parallelism across replicas belongs to the MeCeFO
runtime, see engine.py).
"""

from __future__ import annotations

import torch.distributed as dist
from megatron.core import parallel_state as ps

__all__ = ["MegatronMPU"]


class MegatronMPU:
    get_model_parallel_group = staticmethod(ps.get_model_parallel_group)

    @staticmethod
    def get_model_parallel_rank() -> int:
        return dist.get_rank(group=ps.get_model_parallel_group())

    @staticmethod
    def get_model_parallel_world_size() -> int:
        return dist.get_world_size(group=ps.get_model_parallel_group())

    get_tensor_model_parallel_rank = staticmethod(ps.get_tensor_model_parallel_rank)
    get_tensor_model_parallel_world_size = staticmethod(ps.get_tensor_model_parallel_world_size)
    get_tensor_model_parallel_group = staticmethod(ps.get_tensor_model_parallel_group)
    get_pipeline_model_parallel_rank = staticmethod(ps.get_pipeline_model_parallel_rank)
    get_pipeline_model_parallel_world_size = staticmethod(ps.get_pipeline_model_parallel_world_size)
    get_pipeline_model_parallel_group = staticmethod(ps.get_pipeline_model_parallel_group)
    get_data_parallel_rank = staticmethod(ps.get_data_parallel_rank)
    get_data_parallel_world_size = staticmethod(ps.get_data_parallel_world_size)
    get_data_parallel_group = staticmethod(ps.get_data_parallel_group)
