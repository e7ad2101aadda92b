"""Megatron-Core's own schedules and gradient clipping for one replica of a tensor/pipeline-parallel
model, usable under a DeepSpeed engine (with or without MeCeFO).

* `forward_backward(model, forward_step_func, batches, ...)` runs `get_forward_backward_func()`
  (1F1B with P > 1, no pipelining with P = 1) over the given micro-batches and leaves the
  micro-batch gradients SUMMED in `.grad` (`sum_gradients=True`, the convention of MeCeFO's
  runtime, which applies its own divisors) or averaged over the micro-batches (Megatron's default,
  for DeepSpeed's own data-parallel averaging). `before_forward(i)` is entered around the forward of
  micro-batch i (MeCeFO sets the covering mode there; the mode then holds for that micro-batch's
  backward, whenever 1F1B runs it).
* `clip_grad_norm(model, max_norm)`: the global gradient norm over the tensor- and pipeline-parallel
  ranks of the replica (each parameter counted once: tensor-parallel duplicates only on tp rank 0),
  as Megatron-Core's clip_grads computes it. DeepSpeed's own clipping counts non-tensor-parallel parameters on
  model-parallel rank 0 only, which is wrong for pipeline stages > 0.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Iterable, List, Optional

import torch

__all__ = ["forward_backward", "reduce_tied_embeddings", "clip_grad_norm"]


def forward_backward(model: torch.nn.Module, forward_step_func: Callable, batches: Iterable[Any], *,
                     num_microbatches: int, seq_length: int, micro_batch_size: int, forward_only: bool = False,
                     sum_gradients: bool = True,
                     before_forward: Optional[Callable[[int], ContextManager]] = None,
                     after_forward: Optional[Callable[[int, torch.Tensor], None]] = None) -> List[float]:
    """One pass of Megatron's schedule over `num_microbatches` micro-batches of this replica.

    Args:
        forward_step_func: Megatron's `(data_iterator, model) -> (output_tensor, loss_func)`, where
            `loss_func(output) -> (loss, dict)`; `data_iterator` yields the items of `batches`.
        after_forward: called with (i, this stage's output) after micro-batch i's forward.

    Returns:
        The loss of every micro-batch on the last pipeline stage (as the loss_func returned it,
        before any scaling); an empty list on other stages.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.utils import get_model_config

    config = get_model_config(model)
    losses: List[float] = []
    counter = iter(range(num_microbatches))

    def step(data_iterator, mdl):
        i = next(counter)
        with (before_forward(i) if before_forward is not None else contextlib.nullcontext()):
            output, loss_func = forward_step_func(data_iterator, mdl)
        if after_forward is not None:
            after_forward(i, output)

        def loss(out):
            value, reduced = loss_func(out)
            losses.append(float(value.detach()))
            if sum_gradients:  # with calculate_per_token_loss the schedule does not divide by num_microbatches
                return value, torch.tensor(1, dtype=torch.int, device=value.device), reduced
            return value, reduced
        return output, loss

    saved = config.calculate_per_token_loss
    config.calculate_per_token_loss = sum_gradients
    try:
        get_forward_backward_func()(
            forward_step_func=step, data_iterator=iter(batches), model=[model], num_microbatches=num_microbatches,
            seq_length=seq_length, micro_batch_size=micro_batch_size, forward_only=forward_only)
    finally:
        config.calculate_per_token_loss = saved
    return losses


def reduce_tied_embeddings(model: torch.nn.Module) -> None:
    """Sum the gradients of a tied input/output embedding over its two copies (the first and the
    last pipeline stage of the replica), as Megatron-Core's finalize_model_grads does: both then
    take the same update. Every rank of the replica calls it; a no-op without tying or with P = 1."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if (not getattr(model, "share_embeddings_and_output_weights", False) or not ps.model_parallel_is_initialized()
            or ps.get_pipeline_model_parallel_world_size() == 1 or not ps.is_rank_in_embedding_group(ignore_virtual=True)):
        return
    weight = model.shared_embedding_or_output_weight()
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    dist.all_reduce(weight.grad, group=ps.get_embedding_group())


def clip_grad_norm(model: torch.nn.Module, max_norm: float,
                   grad_norm_sq: Optional[Callable[[torch.nn.Parameter], Optional[float]]] = None,
                   scale: Optional[Callable[[float], None]] = None) -> float:
    """Clip the gradients of `model` (one replica's shard) to the global norm `max_norm`; returns
    the norm before clipping. Every rank of the replica must call it (a collective over its
    tensor- and pipeline-parallel ranks). Megatron-Core's clip_grads does the same on CUDA only.

    `grad_norm_sq`: a parameter's squared gradient norm, where the tensors do not hold the whole
    gradient (a reduce-scattered step: ShardedOptimizer.grad_norm_sq); None: from the tensors.
    Without Megatron's model-parallel groups (a plain model) the norm is this rank's.
    `scale`: takes the clip coefficient instead of the gradients being multiplied in place (bf16
    gradients that the optimizer reads in fp32: ShardedOptimizer.grad_scale)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    params = [p for p in model.parameters() if p.grad is not None]
    # each parameter once: not a tensor-parallel duplicate, not the copy of a tied weight on another
    # pipeline stage (DeepSpeed's `ds_pipe_replicated`, Megatron's `shared`)
    counted = [p for p in params if param_is_not_tensor_parallel_duplicate(p)
               and not getattr(p, "ds_pipe_replicated", False) and not getattr(p, "shared", False)]
    device = params[0].grad.device if params else torch.device("cpu")
    if grad_norm_sq is not None:
        square = torch.tensor([sum(grad_norm_sq(p) for p in counted)], dtype=torch.float32, device=device)
    elif counted:
        square = torch.stack([torch.linalg.vector_norm(p.grad.detach().float()) ** 2 for p in counted]).sum()
    else:
        square = torch.zeros((), device=device)
    square = square.reshape(1)
    if ps.model_parallel_is_initialized():
        dist.all_reduce(square, group=ps.get_model_parallel_group())
    norm = float(square.sqrt())
    coeff = max_norm / (norm + 1e-6)
    if max_norm > 0 and coeff < 1.0:
        if scale is not None:
            scale(coeff)
        else:
            torch._foreach_mul_([p.grad for p in params], coeff)
    return norm
