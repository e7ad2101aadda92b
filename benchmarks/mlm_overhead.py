"""Megatron-LM (core_v0.16.1) on CPU: what the patch + --mecefo cost when nothing fails, and a step
while a replica is covered.

Runs Megatron-LM's own pretrain_gpt.py (the snapshot in ../shared/upstream, extracted once and
patched by mecefo-patch, with upstream's unpatched script beside it) three ways, interleaved per
repeat so the machine's noise hits all alike: the unpatched script under torchrun (Megatron's DDP
all-reduce), the patched one with --mecefo under mecefo-launch (the runtime's all-reduce of the
gradient buffers, the commit vote, the heartbeat thread), and the same with rank 1 SIGKILLed at
step 10 (rank 0 covers its micro-batches with the MeCeFO backward to the end). Upstream's training
loop needs CUDA: the runs go through the tests' CPU shim (megatron_mecefo/testing/fake_cuda), so the
times are CPU times of upstream's code path, not GPU figures. Reads upstream's log lines: the time
per iteration (median over the logged intervals, the first left out as warm-up; for the killed
run, the intervals after the kill) and the final validation loss.

    python benchmarks/mlm_overhead.py          # ~5 min on 2 cores: benchmarks/results/mlm_overhead.{json,png}
    python benchmarks/mlm_overhead.py --pp 2 --ranks 4   # D=2 x P=2 (1F1B): mlm_overhead_pp2.{json,png};
                                                         # the last stage of replica 1 is the one killed

Needs the "mlm" extra and triton (scripts/test.sh installs them into .venv/mlm-deps).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from megatron_mecefo import patch
from megatron_mecefo.testing import mds, mlm

_ELAPSED = re.compile(r"iteration\s+(\d+)/.*?elapsed time per iteration \(ms\): ([0-9.]+)")


def model_args(a) -> list:
    return mds.resize(mlm.args(dp=a.ranks // a.pp, iters=a.iters, micro_batches=a.micro_batches, extra=[
        "--log-interval", "10", "--eval-interval", str(a.iters), "--eval-iters", "2",
        "--pipeline-model-parallel-size", str(a.pp)]), layers=4, hidden=a.hidden, seq=a.seq)


def measure(out: str, after: int = 10) -> float:
    """Median ms per iteration over the intervals logged after iteration `after`."""
    times = [float(ms) for it, ms in _ELAPSED.findall(out) if int(it) > after]
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--iters", type=int, default=60)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--pp", type=int, default=1, help="pipeline stages per replica (upstream's 1F1B)")
    p.add_argument("--out", default=None, help="default: benchmarks/results/mlm_overhead[_pp2]")
    a = p.parse_args()
    a.out = a.out or str(ROOT / "benchmarks" / "results" / ("mlm_overhead" + (f"_pp{a.pp}" if a.pp > 1 else "")))
    victim = (a.ranks // a.pp) * (a.pp - 1) + 1  # replica 1's last stage (Megatron's rank order: dp before pp)
    os.environ.setdefault("MECEFO_MLM_DEPS", str(ROOT / ".venv" / "mlm-deps"))
    with tempfile.TemporaryDirectory() as tmp:
        root = mlm.extract(mlm.SNAPSHOT_GLOB, Path(tmp) / "Megatron-LM")
        patch.apply(str(root))
        (root / "pretrain_gpt_upstream.py").write_text(mlm.original_script())
        mlm.prepare(root)
        args = model_args(a)
        on = args + ["--mecefo", "--mecefo-rank", "16"]
        runs = []
        for r in range(a.repeats):
            t0 = time.time()
            plain = mlm.torchrun(root, a.ranks, args, script="pretrain_gpt_upstream.py", timeout=900)
            mecefo = mlm.mecefo_launch(root, a.ranks, on, timeout=900)
            covered = mlm.mecefo_launch(root, a.ranks, on + ["--mecefo-inject", f"kill:{victim}:10"], timeout=900)
            for name, res in (("unpatched", plain), ("mecefo", mecefo), ("covered", covered)):
                if res.returncode != 0:
                    raise SystemExit(f"{name} run failed:\n{res.stdout[-4000:]}")
            row = {"repeat": r, "unpatched_ms": measure(plain.stdout), "mecefo_ms": measure(mecefo.stdout),
                   "covered_ms": measure(covered.stdout, after=20),
                   "unpatched_val": mds.val_losses(plain.stdout)[a.iters],
                   "mecefo_val": mds.val_losses(mecefo.stdout)[a.iters],
                   "covered_val": mds.val_losses(covered.stdout)[a.iters], "wall_s": time.time() - t0}
            row["ratio"] = row["mecefo_ms"] / row["unpatched_ms"]
            row["covered_ratio"] = row["covered_ms"] / row["mecefo_ms"]
            runs.append(row)
            print(json.dumps(row), flush=True)
    result = {
        "what": "Megatron-LM core_v0.16.1 pretrain_gpt.py on CPU (tests' CUDA shim): unpatched under torchrun vs "
                "patched with --mecefo under mecefo-launch, no failure; and with replica 1 lost at step 10 (rank "
                f"{victim} killed; replica 0 covers: 2k micro-batches, MeCeFO backward on k); time per iteration "
                f"(median of logged intervals); {a.pp} pipeline stage(s) per replica",
        "config": vars(a), "runs": runs,
        "ratio_median": statistics.median(r["ratio"] for r in runs),
        "covered_ratio_median": statistics.median(r["covered_ratio"] for r in runs),
        "val_loss_rel_diff_max": max(abs(r["mecefo_val"] - r["unpatched_val"]) / r["unpatched_val"] for r in runs),
    }
    Path(a.out + ".json").write_text(json.dumps(result, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.8))
    xs = range(len(runs))
    ax.bar([x - 0.27 for x in xs], [r["unpatched_ms"] for r in runs], 0.27, label="unpatched (torchrun)")
    ax.bar(list(xs), [r["mecefo_ms"] for r in runs], 0.27, label="patched, --mecefo, no failure")
    ax.bar([x + 0.27 for x in xs], [r["covered_ms"] for r in runs], 0.27, label="--mecefo, replica 1 killed (covered)")
    ax.set_xticks(list(xs), [f"repeat {r['repeat']}\n×{r['ratio']:.3f} / ×{r['covered_ratio']:.2f}" for r in runs])
    ax.set_ylabel("ms per iteration")
    ax.set_title(f"Megatron-LM on CPU, {a.ranks} ranks, P = {a.pp}: healthy ×{result['ratio_median']:.3f}, "
                 f"covered ×{result['covered_ratio_median']:.2f}", fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(a.out + ".png", dpi=120)
    print(json.dumps({k: result[k] for k in ("ratio_median", "covered_ratio_median", "val_loss_rel_diff_max")}))


if __name__ == "__main__":
    main()
