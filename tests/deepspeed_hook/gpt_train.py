"""A tiny Megatron-Core GPT (MeCeFO spec) trained in a DeepSpeed engine with the MeCeFO hook.

Run under mecefo-launch by test_engine.py (not collected). Data: micro-batch `index` of replica
`replica` at step s holds samples sample_range(s, replica, index); sample i's tokens come from a
generator seeded with i, so every rank can build any micro-batch.
"""

import argparse
import hashlib
import json
import os
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
warnings.filterwarnings("ignore")

import torch

from megatron_mecefo.config import MeCeFOConfig
from megatron_mecefo.elastic.fold import sample_range
from megatron_mecefo.errors import JobFinished, NoCoverAvailable

VOCAB, SEQ = 128, 16


def batch(ids):
    rows = []
    for i in ids:
        g = torch.Generator().manual_seed(10_000 + i)
        rows.append(torch.randint(0, VOCAB, (SEQ + 1,), generator=g))
    data = torch.stack(rows)
    tokens, labels = data[:, :-1], data[:, 1:]
    return tokens, torch.arange(SEQ).expand(len(ids), SEQ), labels


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds of fake compute per micro-batch")
    MeCeFOConfig.add_cli_args(p)
    args = p.parse_args()
    from megatron_mecefo.deepspeed_hook import init_distributed, initialize
    from megatron_mecefo.layers.model import build_gpt, init_model_parallel, llama_config

    job = init_distributed()
    init_model_parallel(1, 1, seed=3)
    model = build_gpt(llama_config(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96),
                      vocab_size=VOCAB, seq_length=SEQ, seed=3)
    ds_config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "torch_adam": True}},
        "zero_optimization": {"stage": 0},
        "steps_per_print": 10_000,
        "mecefo": {"enable": True, "rank": 8, "tau": 2, "log_dir": str(args.out)},
    }
    try:
        engine = initialize(model=model, config=ds_config, args=args)
        world, k, mb_size = job["world"], engine.runtime.k, engine.micro_batch_size
        while engine.global_steps < args.steps:
            for mb in engine.micro_batches():
                step = engine.global_steps
                tokens, pos, labels = batch(sample_range(step, mb.replica, mb.index, micro_batch_size=mb_size, dp=world, k=k))
                loss = engine(tokens, pos, None, labels=labels).float().mean()
                engine.backward(loss)
                time.sleep(args.step_sleep)
                engine.step()
    except NoCoverAvailable as e:
        print(f"MeCeFO: {e}", file=sys.stderr, flush=True)
        sys.exit(3)
    except JobFinished as e:
        print(f"MeCeFO: {e}", file=sys.stderr, flush=True)
        return
    params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    digest = hashlib.sha256(b"".join(t.numpy().tobytes() for t in params.values())).hexdigest()
    opt = engine.optimizer.state_dict()["state"]
    opt_digest = hashlib.sha256(b"".join(v[key].numpy().tobytes() for v in opt.values() for key in ("exp_avg", "exp_avg_sq"))).hexdigest()
    torch.save(params, args.out / f"final_rank{job['rank']}.pt")
    (args.out / f"final_rank{job['rank']}.json").write_text(json.dumps(
        {"steps": engine.global_steps, "param_sha256": digest, "opt_sha256": opt_digest, "last_loss": engine.last_loss}))
    engine.close()


if __name__ == "__main__":
    main()
