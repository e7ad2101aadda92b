"""Which basis makes the low-rank FFN weight gradient closest to the exact one, per layer and rank r.

MeCeFO (§3.3) replaces a covering micro-batch's FFN weight gradient G = G_y^T x (out, in) by
G V V^T, V (in, r) a basis of input directions. Measured here, on a trained model, for each FFN
weight and r, the relative error ||G V V^T - G|| / ||G|| of one micro-batch's gradient with

  weight      top-r right singular vectors of W (the paper; refreshed every tau steps)
  gradient    top-r right singular vectors of the weight's last exact aggregated gradient (the
              previous step's global batch, as every rank holds it after a healthy all-reduce)
  activation  the micro-batch's own FFN input x (tokens, in): its dominant directions as MeCeFO's
              `basis: "activation"` draws them (randomized range finder, one power iteration)
  activation_svd  the exact top-r right singular vectors of x (what the range finder estimates)
  optimal     top-r right singular vectors of G itself (the best any rank-r basis can do)

and the same for the sum over the global batch (every micro-batch projected on its own basis,
as when every micro-batch of the step is covered).

The model is examples/pretrain_gpt/pretrain_gpt.py's LLaMA-style GPT (the convergence benchmark's
size) trained here first without failures (2 ranks, --iters steps, ~1 min on 2 cores).

    python benchmarks/lowrank_basis.py            # ~2 min; benchmarks/results/lowrank_basis.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from convergence import MODEL  # noqa: E402  (the same model as the convergence benchmark)

BASES = ("weight", "gradient", "activation", "activation_svd", "optimal")


def train(args, save: Path) -> None:
    cmd = [sys.executable, "-m", "megatron_mecefo.elastic.launch", "--nproc-per-node", "2", "--master-port", "0",
           str(ROOT / "examples/pretrain_gpt/pretrain_gpt.py"), *MODEL, "--lr", str(args.lr), "--min-lr", str(args.lr / 10),
           "--seed", str(args.seed), "--global-batch-size", str(args.global_batch_size), "--train-iters", str(args.iters),
           "--eval-interval", str(args.iters), "--eval-iters", "4", "--log-interval", "50", "--save", str(save)]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True, timeout=1800)


def measure(args, ckpt: Path) -> dict:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT / "examples" / "pretrain_gpt"))
    import pretrain_gpt as pg

    from megatron_mecefo.approx.projector import input_subspace, top_right_singular_vectors
    from megatron_mecefo.config import cache_root
    from megatron_mecefo.data.corpus import stdlib_corpus
    from megatron_mecefo.data.gpt import build_gpt_datasets, collate
    from megatron_mecefo.layers.linear import lowrank_linears
    from megatron_mecefo.layers.model import init_model_parallel

    pargs = pg.parse_args([*MODEL, "--seed", str(args.seed), "--global-batch-size", str(args.global_batch_size),
                           "--train-iters", str(args.iters)])
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        init_model_parallel(1, 1, seed=args.seed)
    model = pg.build_model(pargs)
    state = torch.load(next(ckpt.glob("global_step*/mp_rank_00_model_states.pt")), weights_only=False)
    missing, unexpected = model.load_state_dict({k: v for k, v in state["module"].items() if v is not None}, strict=False)
    if unexpected or any(not k.endswith("_extra_state") for k in missing):  # only the empty extra states are left out
        raise RuntimeError(f"checkpoint does not fit the model: missing {missing}, unexpected {unexpected}")
    mb, gbs = 2, args.global_batch_size
    train_ds, _ = build_gpt_datasets(stdlib_corpus(), seq_length=128, split="98,2,0", seed=args.seed,
                                     train_samples=(args.iters + args.batches + 1) * gbs, valid_samples=16,
                                     cache_dir=str(Path(cache_root()) / "index-cache"))
    linears = dict(lowrank_linears(model))
    inputs, grads = {}, {}

    def capture(name):
        def hook(module, inp, out):
            x = inp[0].detach()
            inputs[name] = x.reshape(-1, x.shape[-1]).float()
            y = out[0] if isinstance(out, tuple) else out
            y.register_hook(lambda g: grads.__setitem__(name, g.detach().reshape(-1, g.shape[-1]).float()))
        return hook

    for name, m in linears.items():
        m.register_forward_hook(capture(name))

    def micro_batch_grads(step):
        """Per micro-batch: {linear: (x, exact G)} (G of the mean loss, as the fold sums them)."""
        out = []
        for j in range(gbs // mb):
            lo = step * gbs + j * mb
            tokens, pos, labels, mask = collate(train_ds, range(lo, lo + mb))
            model.zero_grad(set_to_none=True)
            loss = (model(tokens, pos, None, labels=labels).float() * mask).sum() / mask.sum()
            loss.backward()
            out.append({n: (inputs[n], grads[n].t() @ inputs[n]) for n in linears})
        return out

    def rel(a, b):
        return (torch.linalg.norm(a - b) / torch.linalg.norm(b)).item()

    ranks = [r for r in args.ranks]
    per = {n: {b: {str(r): [] for r in ranks} for b in BASES} for n in linears}
    batch_err = {n: {b: {str(r): [] for r in ranks} for b in BASES} for n in linears}
    previous = None
    for step in range(args.iters - 1, args.iters + args.batches):
        mbs = micro_batch_grads(step)
        total = {n: sum(m[n][1] for m in mbs) for n in linears}
        if previous is not None:
            for n, lin in linears.items():
                w = lin.weight.detach().float()
                for r in ranks:
                    if not r < min(w.shape):
                        continue
                    fixed = {"weight": top_right_singular_vectors(w, r, method="exact"),
                             "gradient": top_right_singular_vectors(previous[n], r, method="exact")}
                    approx_sum = {b: torch.zeros_like(total[n]) for b in BASES}
                    for m in mbs:
                        x, g = m[n]
                        bases = {**fixed, "activation": input_subspace(x, r, seed=step),
                                 "activation_svd": top_right_singular_vectors(x, r, method="exact"),
                                 "optimal": top_right_singular_vectors(g, r, method="exact")}
                        for b, v in bases.items():
                            a = (g @ v) @ v.t()
                            approx_sum[b] += a
                            per[n][b][str(r)].append(rel(a, g))
                    for b in BASES:
                        batch_err[n][b][str(r)].append(rel(approx_sum[b], total[n]))
        previous = total
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    shapes = {n: list(lin.weight.shape) for n, lin in linears.items()}
    return {
        "shapes": shapes,
        "micro_batch_rel_error": {n: {b: {r: mean(v) for r, v in rs.items() if v} for b, rs in bs.items()} for n, bs in per.items()},
        "global_batch_rel_error": {n: {b: {r: mean(v) for r, v in rs.items() if v} for b, rs in bs.items()} for n, bs in batch_err.items()},
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=300, help="training steps before measuring")
    p.add_argument("--batches", type=int, default=3, help="global batches measured (after the training)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--global-batch-size", type=int, default=16)
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 32, 64])
    p.add_argument("--ckpt", type=Path, default=None, help="a trained checkpoint of the same model (skips training)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "lowrank_basis.json")
    args = p.parse_args(argv)
    t0 = time.time()
    with tempfile.TemporaryDirectory() as d:
        ckpt = args.ckpt
        if ckpt is None:
            ckpt = Path(d) / "ckpt"
            train(args, ckpt)
        result = measure(args, ckpt)
    out = {"date": time.strftime("%Y-%m-%d"), "command": "python benchmarks/lowrank_basis.py",
           "setup": {"job": "examples/pretrain_gpt/pretrain_gpt.py " + " ".join(MODEL), "iters": args.iters,
                     "lr": args.lr, "seed": args.seed, "global_batch_size": args.global_batch_size, "micro_batch": 2,
                     "batches": args.batches, "wall_s": round(time.time() - t0, 1)},
           **result}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    for n, bs in out["micro_batch_rel_error"].items():
        print(n, out["shapes"][n])
        for b, rs in bs.items():
            print(f"  {b:10s}", "  ".join(f"r={r}: {v:.3f}" for r, v in rs.items()),
                  " | global batch:", "  ".join(f"{v:.3f}" for v in out["global_batch_rel_error"][n][b].values()))


if __name__ == "__main__":
    main()
