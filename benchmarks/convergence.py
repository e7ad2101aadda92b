"""Convergence parity: fault-free vs the paper's failure scenarios, same data, seed and model.

Trains examples/pretrain_gpt/pretrain_gpt.py (LLaMA-style GPT, stdlib corpus, byte tokens) with 4
ranks under mecefo-launch, once without failures and once per scenario with trace-driven kills
and rejoins (MeCeFO defaults: skip attention + low-rank FFN on the covering ranks).

Scaling (stated in the output): the paper's rates, read as cluster-wide on 32 GPUs (a failure every
2 / 1 / 0.5 h lasting 4 / 3 / 2 h), keep 2 / 3 / 4 of 32 nodes, 6.25 % / 9.4 % / 12.5 %, down on
average. With n ranks and T steps we keep the same fraction: round(T x fraction x n / R) failures,
evenly spaced, each keeping a rank down for R steps (R = --recovery-steps, a restarted process's
start-up included). The measured time-averaged fraction is reported beside the target.

Also measured: the relative error of the aggregated MeCeFO gradient (all replicas, fold weights,
one replica failed and covered) against the exact data-parallel gradient, on the trained model, for
a few global batches (one process simulates the 4 replicas with the runtime's own fold).

    python benchmarks/convergence.py          # ~12 min on 2 cores; writes benchmarks/results/convergence.{json,png}
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# recovery / MTBF = nodes down on average: 4h/2h = 2, 3h/1h = 3, 2h/0.5h = 4 of the paper's 32
FRACTION = {"low": 2 / 32, "medium": 3 / 32, "high": 4 / 32}
MODEL = ["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128",
         "--micro-batch-size", "2", "--lr", "2e-3", "--min-lr", "2e-4",
         "--lr-decay-style", "cosine", "--lr-warmup-iters", "20", "--normalization", "RMSNorm", "--swiglu",
         "--position-embedding-type", "rope", "--seed", "1234"]


def run(args, out: Path, extra):
    cmd = [sys.executable, "-m", "megatron_mecefo.elastic.launch", "--nproc-per-node", str(args.ranks), "--master-port", "0",
           "--restart-failed-after", "0.5", "--max-restarts", "20", str(ROOT / "examples/pretrain_gpt/pretrain_gpt.py"),
           *MODEL, "--global-batch-size", str(args.global_batch_size), "--train-iters", str(args.iters), "--eval-interval", str(args.iters), "--eval-iters", str(args.eval_iters),
           "--log-interval", "10", "--mecefo", "--mecefo-rank", "32", "--mecefo-log-dir", str(out), *extra]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    val = [float(x) for x in re.findall(r"validation loss at iteration \d+ \| lm loss value: (\S+) \|", proc.stdout)]
    steps = {}
    for p in out.glob("steps_rank*.jsonl"):
        for r in map(json.loads, p.read_text().splitlines()):
            steps.setdefault(r["step"], r)
    curve = [steps[s]["loss"] for s in sorted(steps)]
    down = sum(args.ranks - len(steps[s]["live"]) for s in steps) / (len(steps) * args.ranks)
    return {"val_loss": val[-1], "loss_curve": curve, "fraction_down": down, "wall_s": time.time() - t0,
            "failures": proc.stderr.count("[mecefo inject]")}


def evenly_spaced_failures(args, fraction):
    """[rank, fail, rejoin] events keeping `fraction` of the ranks down on average: each failure
    keeps a rank down for --recovery-steps (the trace asks for recovery-steps minus the measured
    restart lag, so that the rank is really back then), failures evenly spaced, victims rotating."""
    count = max(1, round(args.iters * fraction * args.ranks / args.recovery_steps))
    lag = args.restart_lag_steps
    return [[1 + i % (args.ranks - 1), round((i + 0.5) * args.iters / count),
             round((i + 0.5) * args.iters / count) + max(1, args.recovery_steps - lag)] for i in range(count)]


def aggregated_grad_error(args, ckpt: Path, batches=3, approximate="all"):
    """Exact data-parallel gradient vs MeCeFO's (replica 1 failed, covered by 2), on the trained model.

    Returns per batch {"all": error over every parameter, "mha": attention parameters only,
    "other": the rest}."""
    import torch
    import torch.distributed as dist

    sys.argv = ["pretrain_gpt.py", *MODEL, "--global-batch-size", str(args.global_batch_size), "--train-iters", str(args.iters)]
    sys.path.insert(0, str(ROOT / "examples" / "pretrain_gpt"))
    import pretrain_gpt as pg

    from megatron_mecefo import MeCeFOConfig, covering
    from megatron_mecefo.config import cache_root
    from megatron_mecefo.data.corpus import stdlib_corpus
    from megatron_mecefo.data.gpt import build_gpt_datasets, collate
    from megatron_mecefo.elastic import Grid, fold_neighbor, plan_cover, sample_range
    from megatron_mecefo.layers.model import init_model_parallel
    from megatron_mecefo.params import GradGroup, grad_group

    pargs = pg.parse_args(sys.argv[1:])
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        init_model_parallel(1, 1, seed=pargs.seed)
    model = pg.build_model(pargs)
    state = torch.load(ckpt, weights_only=False)
    model.load_state_dict(state["module"])
    n, k, mb = args.ranks, args.global_batch_size // (2 * args.ranks), 2
    train, _ = build_gpt_datasets(stdlib_corpus(), seq_length=128, split="98,2,0", seed=pargs.seed,
                                  train_samples=(args.iters + batches) * args.global_batch_size, valid_samples=16,
                                  cache_dir=str(Path(cache_root()) / "index-cache"))
    cfg = MeCeFOConfig(enable=True, rank=32, approximate=approximate)
    fold = fold_neighbor(plan_cover(Grid(dp=n), [r for r in range(n) if r != 1]), k, approximate=approximate)

    def grads(step, approximate):
        model.zero_grad(set_to_none=True)
        for replica, mbs in fold.assignments.items():
            for m in mbs:
                batch = collate(train, sample_range(step, m.replica, m.index, micro_batch_size=mb, dp=n, k=k))
                policy = cfg.cover_policy(step) if (approximate and m.covering) else None
                with covering(model, policy):
                    tokens, pos, labels, mask = batch
                    loss = (model(tokens, pos, None, labels=labels).float() * mask).sum() / mask.sum()
                loss.backward()
        out = {"mha": [], "other": []}
        for p in model.parameters():
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            mha = grad_group(p) is GradGroup.MHA
            div = (fold.divisor_mha if approximate else fold.divisor) if mha else fold.divisor
            out["mha" if mha else "other"].append((g / div).flatten())
        return {key: torch.cat(v) for key, v in out.items()}

    def rel(a, b):
        return (torch.linalg.norm(a - b) / torch.linalg.norm(b)).item()

    errors = []
    for step in range(args.iters, args.iters + batches):
        exact, approx = grads(step, False), grads(step, True)
        errors.append({"all": rel(torch.cat([approx["mha"], approx["other"]]), torch.cat([exact["mha"], exact["other"]])),
                       "mha": rel(approx["mha"], exact["mha"]), "other": rel(approx["other"], exact["other"])})
    return errors


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--global-batch-size", type=int, default=16, help="sequences per step (micro-batch 2)")
    p.add_argument("--eval-iters", type=int, default=16)
    p.add_argument("--recovery-steps", type=int, default=40)
    p.add_argument("--restart-lag-steps", type=int, default=20,
                   help="steps a restarted rank needs to come back (process start), subtracted from the trace")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "convergence.json")
    args = p.parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        results["fault_free"] = run(args, d / "ff", ["--save", str(d / "ckpt")])
        print(f"fault_free: val {results['fault_free']['val_loss']:.4f}", flush=True)
        for name, frac in FRACTION.items():
            events = evenly_spaced_failures(args, frac)
            results[name] = run(args, d / name, ["--mecefo-trace", json.dumps({"events": events})])
            results[name].update(target_fraction_down=frac, events=events,
                                 mtbf_steps=args.iters / len(events), recovery_steps=args.recovery_steps)
            print(f"{name}: val {results[name]['val_loss']:.4f}, failures {results[name]['failures']}, "
                  f"down {results[name]['fraction_down']:.3f} (target {frac:.3f})", flush=True)
        # the same high-rate trace with the covering rank's own micro-batches exact ("adopted")
        events = evenly_spaced_failures(args, FRACTION["high"])
        results["high_adopted"] = run(args, d / "high_adopted", ["--mecefo-trace", json.dumps({"events": events}),
                                                                 "--mecefo-approximate", "adopted"])
        results["high_adopted"].update(target_fraction_down=FRACTION["high"], events=events)
        print(f"high_adopted: val {results['high_adopted']['val_loss']:.4f}", flush=True)
        ckpt = d / "ckpt" / f"iter_{args.iters:07d}" / "model_optim.pt"
        errors = aggregated_grad_error(args, ckpt)
        errors_adopted = aggregated_grad_error(args, ckpt, approximate="adopted")
    ff = results["fault_free"]["val_loss"]
    out = {
        "setup": {"job": "examples/pretrain_gpt/pretrain_gpt.py " + " ".join(MODEL), "ranks": args.ranks,
                  "global_batch_size": args.global_batch_size,
                  "iters": args.iters, "scaling": "time-averaged fraction of ranks down = the paper's cluster-wide "
                  "fraction (6.25 / 9.4 / 12.5 %); each failure lasts recovery_steps; mean steps between failures "
                  "= recovery_steps / (fraction x ranks)"},
        "val_loss_fault_free": ff,
        **{f"val_loss_{n}": results[n]["val_loss"] for n in FRACTION},
        **{f"rel_diff_{n}": (results[n]["val_loss"] - ff) / ff for n in FRACTION},
        "rel_grad_error_aggregated": max(e["all"] for e in errors),
        "rel_grad_error_aggregated_per_batch": errors,
        "val_loss_high_adopted": results["high_adopted"]["val_loss"],
        "rel_diff_high_adopted": (results["high_adopted"]["val_loss"] - ff) / ff,
        "rel_grad_error_aggregated_adopted": max(e["all"] for e in errors_adopted),
        "rel_grad_error_aggregated_adopted_per_batch": errors_adopted,
        "runs": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    plot(out, args.out.with_suffix(".png"))
    print(json.dumps({k: v for k, v in out.items() if k not in ("runs", "setup")}, indent=2))


def plot(out, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for name, run in out["runs"].items():
        curve = run["loss_curve"]
        smooth = [sum(curve[max(0, i - 9):i + 1]) / len(curve[max(0, i - 9):i + 1]) for i in range(len(curve))]
        label = f"{name}: val {run['val_loss']:.3f}" + (f", {run['failures']} failures, {100 * run['fraction_down']:.1f} % down"
                                                          if name != "fault_free" else "")
        ax.plot(range(1, len(curve) + 1), smooth, label=label, lw=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (10-step mean)")
    ax.set_title("MeCeFO convergence: fault-free vs the paper's failure rates (scaled to 4 ranks)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
