"""One rank of the TP=2 layer test (run by test_tensor_parallel.py; not collected by pytest).

python -m tests.layers.tp_worker RANK WORLD STORE_PORT OUT_JSON
"""

import json
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
import torch.distributed as dist


def main(rank: int, world: int, port: int, out: str) -> None:
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_mecefo import covering, get_gpt_layer_mecefo_spec
    from megatron_mecefo.approx import CoverPolicy
    from megatron_mecefo.layers import lowrank_linears
    from megatron_mecefo.layers.model import build_gpt, init_model_parallel, llama_config
    from megatron_mecefo.params import GradGroup, grad_group
    from tests.helpers import SEQ, TINY, VOCAB, gpt_loss, grads, make_batch

    init_model_parallel(tensor_parallel=world, seed=5)
    config = llama_config(**TINY, dropout=0.1)
    report = {"rank": rank}

    def run(model, policy, steps=2):
        losses, all_grads = [], []
        torch.manual_seed(11)
        model_parallel_cuda_manual_seed(11)
        for step in range(steps):
            model.zero_grad()
            with covering(model, policy):
                loss = gpt_loss(model, make_batch(step))
            loss.backward()
            losses.append(loss.item())
            all_grads.append(grads(model))
        return losses, all_grads

    stock = build_gpt(config, vocab_size=VOCAB, seq_length=SEQ, spec=get_gpt_layer_local_spec(normalization="RMSNorm"), seed=3)
    ours = build_gpt(config, vocab_size=VOCAB, seq_length=SEQ, spec=get_gpt_layer_mecefo_spec(normalization="RMSNorm"), seed=3)

    # 1. exact mode: bit-identical losses and gradients
    ls, gs = run(stock, None)
    lo, go = run(ours, None)
    assert ls == lo, (ls, lo)
    n = 0
    for a, b in zip(gs, go):
        for name in a:
            assert torch.equal(a[name], b[name]), name
            n += 1
    report["exact_losses"] = lo
    report["exact_compared"] = n

    # 2. low-rank only: each shard's dW is its exact dW projected on its own basis; all else exact
    _, (cov,) = run(ours, CoverPolicy(step=0, skip_attention=False, lowrank_ffn=True, rank=8), steps=1)
    exact = go[0]
    linears = dict(lowrank_linears(ours))
    n = 0
    for name, g in cov.items():
        module = name.rsplit(".", 1)[0]
        if module in linears:
            v = linears[module]._mecefo_projector.basis
            assert v.shape == (linears[module].weight.shape[1], 8)
            torch.testing.assert_close(g, exact[name] @ v @ v.T, rtol=1e-4, atol=1e-6, msg=name)
            n += 1
        else:
            torch.testing.assert_close(g, exact[name], rtol=1e-5, atol=1e-7, msg=name)
    report["lowrank_compared"] = n
    report["fc1_local_shape"] = list(ours.decoder.layers[0].mlp.linear_fc1.weight.shape)

    # 3. all three techniques: no attention gradient; replicated (non-sharded) grads agree across TP ranks
    _, (cov,) = run(ours, CoverPolicy(step=0, skip_attention=True, recompute_ffn=True, lowrank_ffn=True, rank=8), steps=1)
    for name, p in ours.named_parameters():
        if grad_group(p) is GradGroup.MHA:
            assert cov[name] is None, name
    norm = cov["decoder.layers.0.pre_mlp_layernorm.weight"]
    gathered = [torch.empty_like(norm) for _ in range(world)]
    dist.all_gather(gathered, norm)
    assert all(torch.equal(gathered[0], t) for t in gathered), "TP ranks disagree on a replicated gradient"
    report["replicated_norm_grad_norm"] = norm.norm().item()

    with open(out, "w") as f:
        json.dump(report, f)
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
