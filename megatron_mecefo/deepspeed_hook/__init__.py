"""DeepSpeed integration: the only subpackage that imports deepspeed."""

from megatron_mecefo.deepspeed_hook.checkpoint import UnsafeCheckpoint, load_checkpoint, save_checkpoint
from megatron_mecefo.deepspeed_hook.engine import (
    MeCeFOEngine, init_distributed, initialize, param_digest,
)

__all__ = ["MeCeFOEngine", "UnsafeCheckpoint", "init_distributed", "initialize", "load_checkpoint",
           "param_digest", "save_checkpoint"]
