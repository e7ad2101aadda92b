"""DeepSpeed integration: the only subpackage that imports deepspeed."""

from megatron_mecefo.deepspeed_hook.checkpoint import UnsafeCheckpoint, load_checkpoint, save_checkpoint
from megatron_mecefo.deepspeed_hook.engine import MeCeFOEngine
from megatron_mecefo.deepspeed_hook.initialize import initialize, wrap_engine
from megatron_mecefo.elastic.launch.bootstrap import init_distributed, param_digest

__all__ = ["MeCeFOEngine", "UnsafeCheckpoint", "init_distributed", "initialize", "load_checkpoint",
           "param_digest", "save_checkpoint", "wrap_engine"]
