"""Healthy overhead: what --mecefo costs when nothing fails.

Runs examples/pretrain_gpt/pretrain_gpt.py under mecefo-launch as plain DeepSpeed data parallelism
and with --mecefo, alternately (interleaved repeats in one run, so the machine's noise hits both
alike), and reads the Megatron-style log lines: the time per iteration (the median over the logged
intervals, the first one left out as warm-up) and the final validation loss. Each --mecefo run is
compared with the plain run just before it.

Where the difference comes from: per step, the runtime's own all-reduce of one flat buffer after
the backward (DeepSpeed's reduction is bucketed; on a GPU Megatron overlaps it with the backward),
the confirmation all-reduce of the step's statistics (a few floats), two store calls in the whole
job (the lowest rank's join-count read and progress mark), and a heartbeat thread.

    python benchmarks/healthy_overhead.py      # ~8 min on 2 cores; benchmarks/results/healthy_overhead.{json,png}
    python benchmarks/healthy_overhead.py --tp 2 --ranks 4     # D=2 x T=2: healthy_overhead_tp2.{json,png}
    python benchmarks/healthy_overhead.py --pp 2 --ranks 4     # D=2 x P=2: healthy_overhead_pp2.{json,png}
    python benchmarks/healthy_overhead.py --ranks 4 --baseline efb62c9   # + that commit's --mecefo in each repeat
    python benchmarks/healthy_overhead.py --ranks 4 --rebalance --baseline HEAD   # --mecefo-rebalance beside --mecefo

With tensor or pipeline parallelism both runs go through Megatron-Core's schedule; the plain run
reduces with DeepSpeed's allreduce_gradients, the MeCeFO run with one all-reduce per (tp, pp)
position group.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from megatron_mecefo.testing import baseline

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "pretrain_gpt" / "pretrain_gpt.py"


def model_args(args) -> list:
    return ["--num-layers", "2", "--hidden-size", str(args.hidden), "--num-attention-heads", "4",
            "--seq-length", str(args.seq), "--micro-batch-size", "4", "--global-batch-size", str(8 * args.ranks // (args.tp * args.pp)),
            "--train-iters", str(args.iters), "--eval-interval", str(args.iters), "--eval-iters", "4",
            "--log-interval", str(args.log_interval), "--lr", "1e-3", "--lr-decay-style", "constant",
            "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope", "--mecefo-rank", "16",
            "--tensor-model-parallel-size", str(args.tp), "--pipeline-model-parallel-size", str(args.pp)]


def run(args, mecefo: bool, tree: Path = ROOT) -> dict:
    """One job, from this tree or from a baseline's (`tree`); this tree's --mecefo run with
    --mecefo-rebalance when asked (`--rebalance`)."""
    flags = (["--mecefo"] + (["--mecefo-rebalance"] if args.rebalance and tree == ROOT else [])) if mecefo else []
    cmd = [sys.executable, "-m", "megatron_mecefo.elastic.launch", "--nproc-per-node", str(args.ranks),
           "--master-port", "0", str(tree / EXAMPLE.relative_to(ROOT)), *model_args(args), *flags]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=tree, env=baseline.env_for(tree), capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        raise RuntimeError(f"{'mecefo' if mecefo else 'plain'} run from {tree} failed:\n{proc.stderr[-3000:]}")
    ms = [float(x) for x in re.findall(r"elapsed time per iteration \(ms\):\s+(\S+)", proc.stdout)]
    valid = [float(x) for x in re.findall(r"validation loss at iteration \d+ \| lm loss value: (\S+) \|", proc.stdout)]
    return {"mecefo": mecefo, "step_ms": statistics.median(ms[1:]), "intervals_ms": ms, "valid_loss": valid[-1],
            "wall_s": round(time.monotonic() - t0, 1)}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    pairs = result["pairs"]
    x = range(1, len(pairs) + 1)
    a.plot(x, [p["plain"]["step_ms"] for p in pairs], "o-", label="plain DeepSpeed")
    a.plot(x, [p["mecefo"]["step_ms"] for p in pairs], "s-", label="--mecefo")
    if "baseline" in pairs[0]:
        a.plot(x, [p["baseline"]["step_ms"] for p in pairs], "^--", label=f"--mecefo at {result['baseline_commit']}")
    a.set_xlabel("repeat")
    a.set_ylabel("time per iteration (ms, median)")
    a.legend()
    if "baseline" in pairs[0]:
        b.bar([i - 0.2 for i in x], [p["ratio"] for p in pairs], width=0.4, label="this tree")
        b.bar([i + 0.2 for i in x], [p["baseline_ratio"] for p in pairs], width=0.4, label=result["baseline_commit"])
    else:
        b.bar(x, [p["ratio"] for p in pairs])
    b.axhline(1.01, color="red", linestyle="--", label="target 1.01")
    b.set_ylim(min(0.9, min(p["ratio"] for p in pairs) - 0.02), max(1.1, max(p["ratio"] for p in pairs) + 0.02))
    b.set_xlabel("repeat")
    b.set_ylabel("--mecefo / plain")
    b.legend()
    fig.suptitle(f"no failure, {result['settings']['ranks']} ranks ({result['settings']['layout']}), hidden {result['settings']['hidden']}, "
                 f"seq {result['settings']['seq']}: median ratio {result['ratio_median']:.3f}"
                 + (f" ({result['baseline_commit']}: {result['baseline_ratio_median']:.3f})" if "baseline_commit" in result else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--iters", type=int, default=60)
    p.add_argument("--log-interval", type=int, default=5)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--baseline", default=None, metavar="COMMIT",
                   help="also run --mecefo from this earlier commit, in each repeat beside this tree's")
    p.add_argument("--rebalance", action="store_true",
                   help="this tree's --mecefo run with --mecefo-rebalance (the baseline's without): "
                        "healthy_overhead_rebalance.json")
    p.add_argument("--out", type=Path, default=None, help="default: results/healthy_overhead[_tp2|_pp2].json")
    args = p.parse_args(argv)
    with contextlib.ExitStack() as stack:
        base_tree = stack.enter_context(baseline.checkout(args.baseline)) if args.baseline else None
        return measure(args, base_tree)


def measure(args, base_tree) -> int:
    suffix = "".join(f"_{n}{v}" for n, v in (("tp", args.tp), ("pp", args.pp)) if v > 1)
    args.out = args.out or ROOT / "benchmarks" / "results" / \
        f"healthy_overhead{suffix}{'_rebalance' if args.rebalance else ''}.json"
    layout = f"D={args.ranks // (args.tp * args.pp)} x T={args.tp} x P={args.pp}" if suffix else "dp only (tp = pp = 1)"
    pairs = []
    for i in range(args.repeats):
        plain, mecefo = run(args, False), run(args, True)
        ratio = mecefo["step_ms"] / plain["step_ms"]
        pairs.append({"plain": plain, "mecefo": mecefo, "ratio": round(ratio, 4),
                      "valid_loss_rel_diff": abs(mecefo["valid_loss"] - plain["valid_loss"]) / plain["valid_loss"]})
        if base_tree is not None:
            old = run(args, True, base_tree)
            pairs[-1].update(baseline=old, baseline_ratio=round(old["step_ms"] / plain["step_ms"], 4))
        print(f"repeat {i}: plain {plain['step_ms']:.1f} ms, mecefo {mecefo['step_ms']:.1f} ms, ratio {ratio:.3f}, "
              + (f"baseline {pairs[-1]['baseline_ratio']:.3f}, " if base_tree is not None else "")
              + f"validation loss {plain['valid_loss']:.6f} / {mecefo['valid_loss']:.6f}", flush=True)
    ratios = [p["ratio"] for p in pairs]
    result = {
        "settings": {"ranks": args.ranks, "iters": args.iters, "log_interval": args.log_interval, "hidden": args.hidden,
                     "seq": args.seq, "layers": 2, "micro_batch": 4, "layout": layout, "rebalance": args.rebalance},
        "pairs": pairs,
        "ratio_median": round(statistics.median(ratios), 4), "ratio_min": min(ratios), "ratio_max": max(ratios),
        "target_ratio": 1.01,
        "valid_loss_max_rel_diff": max(p["valid_loss_rel_diff"] for p in pairs),
        "date": datetime.date.today().isoformat(),
    }
    if base_tree is not None:
        result.update(baseline_commit=args.baseline,
                      baseline_ratio_median=round(statistics.median(p["baseline_ratio"] for p in pairs), 4))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out.with_suffix(".png"))
    print(json.dumps({k: v for k, v in result.items() if k != "pairs"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
