"""Small factories for LLaMA-style Megatron-Core GPT models (tests, benchmarks, the example).

Not a training framework: they only spell out the TransformerConfig a LLaMA-style model needs
(RMSNorm, SwiGLU, rotary embeddings, no biases) and build a GPTModel with the MeCeFO layer spec,
CPU-ready when CUDA is absent.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_mecefo.layers.cpu import enable_cpu_support
from megatron_mecefo.layers.specs import get_gpt_layer_mecefo_spec

__all__ = ["init_model_parallel", "llama_config", "build_gpt"]


def init_model_parallel(tensor_parallel: int = 1, pipeline_parallel: int = 1, seed: int = 0,
                        timeout_s: float = 1800.0) -> None:
    """Megatron's parallel_state + RNG trackers over the already initialised torch.distributed world.

    Call on every rank, once, after `torch.distributed.init_process_group`. `timeout_s` bounds each
    collective of the tensor- and pipeline-parallel groups (how long a hung peer can stall one).
    """
    enable_cpu_support()
    import torch.distributed as dist

    dist.barrier()  # arrive together: creating each group waits at most timeout_s for the others
    parallel_state.initialize_model_parallel(tensor_parallel, pipeline_parallel,
                                             distributed_timeout_minutes=timeout_s / 60.0)
    model_parallel_cuda_manual_seed(seed)


def llama_config(
    *,
    num_layers: int,
    hidden_size: int,
    num_attention_heads: int,
    ffn_hidden_size: Optional[int] = None,
    dtype: torch.dtype = torch.float32,
    dropout: float = 0.0,
    **overrides,
) -> TransformerConfig:
    """TransformerConfig of a LLaMA-style decoder: RMSNorm, SwiGLU, no biases.

    ffn_hidden_size defaults to LLaMA's 8/3 * hidden rounded up to a multiple of 64.
    """
    if ffn_hidden_size is None:
        ffn_hidden_size = -(-int(8 * hidden_size / 3) // 64) * 64
    kwargs = dict(
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_attention_heads=num_attention_heads,
        ffn_hidden_size=ffn_hidden_size,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=dropout,
        attention_dropout=dropout,
        bias_dropout_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        use_cpu_initialization=not torch.cuda.is_available(),
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
    )
    if parallel_state.model_parallel_is_initialized():
        pp = parallel_state.get_pipeline_model_parallel_world_size()
        kwargs.update(tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
                      pipeline_model_parallel_size=pp, pipeline_dtype=dtype if pp > 1 else None)
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build_gpt(
    config: TransformerConfig,
    *,
    vocab_size: int,
    seq_length: int,
    spec: Optional[ModuleSpec] = None,
    seed: int = 0,
    position_embedding_type: str = "rope",
    share_embeddings_and_output_weights: bool = False,
) -> GPTModel:
    """A GPTModel with `spec` (default: the MeCeFO spec for config.normalization), seeded. With
    pipeline parallelism, this rank's stage (its layers; the embedding on the first, the output
    layer and loss on the last; a tied output layer's copy on the last stage starts as the first
    stage's embedding, and `deepspeed_hook.schedule.reduce_tied_embeddings` keeps them equal)."""
    if spec is None:
        spec = get_gpt_layer_mecefo_spec(normalization=config.normalization)
    torch.manual_seed(seed)  # CPU initialisation draws from the default generator
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=vocab_size,
        max_sequence_length=seq_length,
        position_embedding_type=position_embedding_type,
        share_embeddings_and_output_weights=share_embeddings_and_output_weights,
        pre_process=parallel_state.is_pipeline_first_stage() if parallel_state.model_parallel_is_initialized() else True,
        post_process=parallel_state.is_pipeline_last_stage() if parallel_state.model_parallel_is_initialized() else True,
    )
    if torch.cuda.is_available():
        model = model.cuda()
    return model
