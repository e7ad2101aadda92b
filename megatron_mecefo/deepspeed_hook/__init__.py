"""DeepSpeed integration: the only subpackage that imports deepspeed."""

from megatron_mecefo.deepspeed_hook.engine import (
    MeCeFOEngine, check_ds_config, init_distributed, initialize, param_digest, save_checkpoint,
)

__all__ = ["MeCeFOEngine", "check_ds_config", "init_distributed", "initialize", "param_digest", "save_checkpoint"]
