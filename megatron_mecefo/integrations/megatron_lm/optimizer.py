"""Megatron-LM's optimizer under MeCeFO's sharded state (`--use-distributed-optimizer`): the
runtime's ShardedOptimizer (elastic/sharding/zero.py) steps the torch optimizer inside Megatron's wrapper,
and the wrapper's gradient norm and clipping are pointed at the reduce-scattered shards. Patches
instances only; upstream's classes stay as they are."""

from __future__ import annotations

import contextlib
import copy

import torch

from megatron_mecefo.config import LaunchEnv, MeCeFOConfig
from megatron_mecefo.elastic.sharding.zero import ShardedOptimizer

__all__ = ["sharded_state", "bf16_parameters", "no_fp32_copies"]


def sharded_state(optimizer, cfg: MeCeFOConfig, job: LaunchEnv, tensor_parallel: int,
             pipeline_parallel: int) -> ShardedOptimizer:
    """The sharded state of Megatron's (plain) optimizer, a ChainedOptimizer of one of:

    * Float16OptimizerWithFloat16Params (fp32 copies of the bf16 model parameters, the model's
      `main_grad` their gradients): not built under sharding (training.py), kept for a host that does;
    * FP32Optimizer over fp32 parameters (their `main_grad` is their `.grad`);
    * FP32Optimizer over bf16 parameters (`--bf16`: training.py has upstream build it so, as its
      layer-wise optimizer does): the fp32 masters exist only in the held ranges (zero.py), the
      gradients stay in `main_grad` (fp32), and the clipping is applied there (`bf16_parameters`).

    Its gradient norm comes from the reduce-scattered shards (shard_grads.py), through upstream's
    own filter of what counts (not shared, not a tensor-parallel duplicate)."""
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    if len(inner) != 1:
        raise ValueError(f"the sharded optimizer state needs one Megatron optimizer; the model has {len(inner)}")
    megatron_opt = inner[0]
    sources = {}
    for model_group, main_group in zip(getattr(megatron_opt, "float16_groups", []),
                                       getattr(megatron_opt, "fp32_from_float16_groups", [])):
        for model_param, main_param in zip(model_group, main_group):
            sources[id(main_param)] = model_param
    bf16 = any(p.dtype != torch.float32 for p in megatron_opt.get_parameters())
    # after a re-shard re-sent the fp32 copies, the bf16 model parameters follow them
    refresh = getattr(megatron_opt, "_copy_main_params_to_model_params", None)
    shards = ShardedOptimizer.for_job(optimizer, cfg, job, tensor_parallel=tensor_parallel,
                                      pipeline_parallel=pipeline_parallel,
                                      on_parameters=refresh, sources=sources, grad_attr="main_grad" if bf16 else "grad")
    if bf16:
        bf16_parameters(megatron_opt, shards)
        return shards
    counted = megatron_opt.get_main_grads_for_grad_norm

    def get_main_grads_for_grad_norm():
        grads = counted()
        if shards.grad_sq is None:  # an all-reduced step: the tensors are whole
            return grads
        owner = {id(p.grad): p for p in megatron_opt.get_parameters() if p.grad is not None}
        return [torch.tensor([shards.grad_norm_sq(owner[id(g)]) ** 0.5], dtype=torch.float32, device=g.device)
                for g in grads]

    megatron_opt.get_main_grads_for_grad_norm = get_main_grads_for_grad_norm
    return shards


def bf16_parameters(megatron_opt, shards: ShardedOptimizer) -> None:
    """Upstream's FP32Optimizer over bf16 parameters, as the sharded state needs it: `.grad` (bf16)
    cannot hold the fp32 `main_grad`, so the gradients stay there. Its `prepare_grads` (which
    would assign them) does nothing; the norm counts `main_grad` with upstream's filter; the clip
    coefficient, computed as upstream's `clip_grad_by_total_norm_fp32` does, scales `main_grad`
    before the sharded update reads it (upstream's own clip, which reads `.grad`, is given
    clip_grad 0 so it does not run on the empty `.grad`s)."""

    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    clip = megatron_opt.config.clip_grad
    megatron_opt.config = copy.copy(megatron_opt.config)
    megatron_opt.config.clip_grad = 0.0
    tp_group = getattr(megatron_opt, "tp_group", None)
    norm = []

    def get_main_grads_for_grad_norm():
        out = []
        for p in megatron_opt.get_parameters():
            g = getattr(p, "main_grad", None)
            if g is None or not param_is_not_shared(p) or not param_is_not_tensor_parallel_duplicate(p, tp_group):
                continue
            sq = shards.grad_norm_sq(p)
            out.append(g if sq is None else torch.tensor([sq ** 0.5], dtype=torch.float32, device=g.device))
        return out

    get_grad_norm = megatron_opt.get_grad_norm

    def get_grad_norm_kept():
        norm[:] = [get_grad_norm()]
        return norm[0]

    step_with_ready_grads = megatron_opt.step_with_ready_grads

    @torch.no_grad()
    def clip_then_step():
        if clip > 0.0 and norm:
            coeff = clip / (float(norm[0]) + 1.0e-6)
            if coeff < 1.0:
                for p in megatron_opt.get_parameters():
                    if getattr(p, "main_grad", None) is not None:
                        p.main_grad.mul_(coeff)
        norm.clear()
        return step_with_ready_grads()

    megatron_opt.prepare_grads = lambda: False
    megatron_opt.get_main_grads_for_grad_norm = get_main_grads_for_grad_norm
    megatron_opt.get_grad_norm = get_grad_norm_kept
    megatron_opt.step_with_ready_grads = clip_then_step


@contextlib.contextmanager
def no_fp32_copies(active: bool):
    """`--bf16` with the sharded state: upstream builds its FP32Optimizer over the bf16 parameters
    (as its layer-wise optimizer does, optimizer/muon.py) instead of a mixed-precision wrapper with
    fp32 copies of every parameter on every rank; the sharded state keeps the fp32 masters of its
    held ranges only (elastic/sharding/zero.py; optimizer.py's `bf16_parameters`)."""
    import megatron.training.training as training

    build = training.get_megatron_optimizer
    if not active:
        yield
        return

    def get_megatron_optimizer(config, *a, **kw):
        config = copy.copy(config)
        config.bf16 = False
        return build(config, *a, **kw)

    training.get_megatron_optimizer = get_megatron_optimizer
    try:
        yield
    finally:
        training.get_megatron_optimizer = build
