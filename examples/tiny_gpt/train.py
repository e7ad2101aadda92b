"""The smallest MeCeFO job: a LLaMA-style Megatron-Core GPT in a DeepSpeed engine, on CPU.

    # 4 ranks, rank 1 killed at step 8 and restarted 5 s later (it rejoins):
    mecefo-launch --nproc-per-node 4 --restart-failed-after 5 examples/tiny_gpt/train.py \
        --steps 40 --out runs/tiny --mecefo-inject kill:1:8:backward
    # the same under DeepSpeed's launcher (an injected kill exits with status 0 there, see README):
    deepspeed --num_gpus 4 examples/tiny_gpt/train.py --steps 40 --out runs/tiny --mecefo-inject kill:1:8
    # plain training, no MeCeFO:
    mecefo-launch --nproc-per-node 4 examples/tiny_gpt/train.py --steps 40 --out runs/plain --no-mecefo

The training loop is DeepSpeed's, with one change: the micro-batches come from
`engine.micro_batches()` (a covering rank also gets a failed neighbour's). Data: micro-batch
`index` of replica `replica` at step s holds samples sample_range(s, replica, index) of a synthetic
token stream (sample i drawn from a generator seeded with i), so any rank can build any micro-batch.
Writes DIR/steps_rank*.jsonl, DIR/events_rank*.jsonl and DIR/final_rank*.{pt,json}.
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
from megatron_mecefo.elastic.plan.fold import sample_range
from megatron_mecefo.errors import run_to_exit

VOCAB, SEQ = 128, 16


def batch(ids):
    """Sample i: an arithmetic token sequence (start and stride drawn from a generator seeded with i)
    with 10 % noise tokens. Learnable in context, so the loss falls; any rank can rebuild any sample."""
    rows = []
    for i in ids:
        g = torch.Generator().manual_seed(10_000 + i)
        start, stride = torch.randint(0, VOCAB, (1,), generator=g), torch.randint(1, 4, (1,), generator=g)
        seq = (start + stride * torch.arange(SEQ + 1)) % VOCAB
        noise = torch.rand(SEQ + 1, generator=g) < 0.1
        rows.append(torch.where(noise, torch.randint(0, VOCAB, (SEQ + 1,), generator=g), seq))
    data = torch.stack(rows)
    tokens, labels = data[:, :-1], data[:, 1:]
    return tokens, torch.arange(SEQ).expand(len(ids), SEQ), labels


def log_iteration(engine, total, t_last, interval=1):
    """A Megatron-style line, printed by the lowest live rank (so logs go on if rank 0 fails)."""
    rt = engine.runtime
    if rt.rank != min(rt.members):
        return
    cover = rt.cover_plan().text()
    print(
        f" iteration {engine.global_steps:8d}/{total:8d} | consumed samples: {engine.global_steps * rt.world * rt.k * engine.micro_batch_size:10d}"
        f" | elapsed time per iteration (ms): {1000 * (time.monotonic() - t_last) / interval:7.1f} | learning rate: {engine.get_lr()[0]:.3E}"
        f" | lm loss: {engine.last_loss:.6E} | mecefo: gen {rt.generation} live {len(rt.members)}/{rt.world} cover {cover} |",
        flush=True,
    )


def build_model():
    from megatron_mecefo.layers.model import build_gpt, llama_config

    return build_gpt(llama_config(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96),
                     vocab_size=VOCAB, seq_length=SEQ, seed=3)


MECEFO = {"rank": 8, "tau": 2}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--no-mecefo", action="store_true", help="plain DeepSpeed training (MeCeFO off)")
    p.add_argument("--log-interval", type=int, default=1, help="print every N iterations")
    p.add_argument("--hash-params", action="store_true",
                   help="record a hash of the parameters in every step record (= --mecefo-log-param-hash)")
    p.add_argument("--local_rank", "--local-rank", type=int, default=0, help="set by the deepspeed launcher")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds of fake compute per micro-batch")
    p.add_argument("--dump-step", type=int, nargs="+", action="extend", default=[],
                   help="save the parameters and the reduced gradients just before these steps' optimizer updates "
                        "(OUT/dump_rank{R}_step{S}.pt)")
    MeCeFOConfig.add_cli_args(p)
    args = p.parse_args()
    from megatron_mecefo.deepspeed_hook import init_distributed, initialize, param_digest

    if args.hash_params:  # replicas must be bit-identical at the start of every step
        args.mecefo_log_param_hash = True
    from megatron_mecefo.layers.model import init_model_parallel

    job = run_to_exit(init_distributed)  # exit 2 when MASTER_PORT is held by the store of another job
    init_model_parallel(1, 1, seed=3)
    model = build_model()
    ds_config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "torch_adam": True}},
        "zero_optimization": {"stage": 0},
        "steps_per_print": 10_000,
        "mecefo": {"enable": not args.no_mecefo, **MECEFO, "log_dir": str(args.out)},
    }

    def train():
        engine = initialize(model=model, config=ds_config, args=args, train_iters=args.steps,
                            save_dir=str(args.out / "checkpoint"))
        world, k, mb_size = job.world, engine.runtime.k, engine.micro_batch_size
        if args.dump_step:
            def dump(optimizer, *_):  # runs inside the optimizer step: p.grad is the reduced gradient
                if engine.global_steps in args.dump_step:
                    m = engine.module
                    torch.save({"params": {n: q.detach().clone() for n, q in m.named_parameters()},
                                "grads": {n: q.grad.detach().clone() for n, q in m.named_parameters()}},
                               args.out / f"dump_rank{job.rank}_step{engine.global_steps}.pt")
            engine.optimizer.register_step_pre_hook(dump)
        t_last, degraded = time.monotonic(), False
        while engine.global_steps < args.steps:
            for mb in engine.micro_batches():
                step = engine.global_steps
                tokens, pos, labels = batch(sample_range(step, mb.replica, mb.index, micro_batch_size=mb_size, dp=world, k=k))
                loss = engine(tokens, pos, None, labels=labels).float().mean()
                engine.backward(loss)
                time.sleep(args.step_sleep)
                if engine.step() and (engine.global_steps % args.log_interval == 0 or engine.runtime.cover_map().degraded != degraded):
                    log_iteration(engine, args.steps, t_last, args.log_interval)
                    t_last = time.monotonic()
                    degraded = engine.runtime.cover_map().degraded
        return engine

    # exits 3 (gave up), 4 (left the job: mecefo-launch restarts it), 2 (bad input)
    engine = run_to_exit(train)
    if engine is None:  # a restarted rank came back after training ended
        return
    params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    digest = param_digest(engine.module)
    opt = engine.optimizer.state_dict()["state"]
    opt_digest = hashlib.sha256(b"".join(v[key].numpy().tobytes() for v in opt.values() for key in ("exp_avg", "exp_avg_sq"))).hexdigest()
    torch.save(params, args.out / f"final_rank{job.rank}.pt")
    (args.out / f"final_rank{job.rank}.json").write_text(json.dumps(
        {"steps": engine.global_steps, "param_sha256": digest, "opt_sha256": opt_digest, "last_loss": engine.last_loss}))
    engine.close()


if __name__ == "__main__":
    main()
