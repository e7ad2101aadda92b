"""The exposed gradient reduction in Megatron-LM with --mecefo: `--overlap-grad-reduce` on vs off.

Runs Megatron-LM's own pretrain_gpt.py (the snapshot in ../shared/upstream, extracted once and
patched by mecefo-patch) under mecefo-launch with and without `--overlap-grad-reduce`, interleaved
per repeat, no failure. Each step record (`--mecefo-log-dir`) holds `exposed_reduce_s`: the time
from the end of the step's backward to its optimizer step spent on the cross-replica reduction
(without overlap: the whole all-reduce of the gradient buffers; with overlap: the wait for the
buckets still in flight when the backward ends, plus the statistics' all-reduce). Reports the
median per run (the first two steps left out: warm-up and upstream's first-batch counting), the
median time per iteration, and the final validation loss (the same with and without overlap).

    python benchmarks/overlap.py                 # ~6 min on 2 cores: benchmarks/results/overlap.{json,png}
    python benchmarks/overlap.py --gpu --ranks 2 # on a node with 2 GPUs: NCCL, bf16, no CPU shim (untested)

On 2 CPU cores the backward's compute and gloo's communication threads share the cores, so the
overlap hides less than it would on a GPU, where the all-reduce runs on the network while the SMs
compute. Needs the "mlm" extra and triton (scripts/test.sh installs them into .venv/mlm-deps).
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


def model_args(a, log_dir: Path, overlap: bool) -> list:
    extra = ["--log-interval", "5", "--eval-interval", str(a.iters), "--eval-iters", "2", "--mecefo",
             "--mecefo-rank", "16", "--mecefo-log-dir", str(log_dir), "--ddp-bucket-size", str(a.bucket)]
    extra += ["--overlap-grad-reduce"] if overlap else []
    args = mds.resize(mlm.args(dp=a.ranks, iters=a.iters, micro_batches=a.micro_batches, extra=extra),
                      layers=a.layers, hidden=a.hidden, seq=a.seq)
    if a.gpu:
        args = [x if x != "gloo" else "nccl" for x in args] + ["--bf16"]
    return args


def exposed_ms(log_dir: Path) -> float:
    steps = [json.loads(line) for line in (log_dir / "steps_rank0.jsonl").read_text().splitlines()]
    return 1000 * statistics.median(s["exposed_reduce_s"] for s in steps if s["step"] >= 2)


def run(root: Path, a, log_dir: Path, overlap: bool) -> dict:
    env = None
    if a.gpu:  # the real CUDA stack: no shim
        env = lambda: dict(os.environ, PYTHONPATH=os.pathsep.join([os.environ["MECEFO_MLM_DEPS"], str(ROOT)]),  # noqa: E731
                           CUDA_DEVICE_MAX_CONNECTIONS="1")
    res = mds.mecefo_launch(root, a.ranks, model_args(a, log_dir, overlap), timeout=1800, env_of=env or mlm.env)
    if res.returncode != 0:
        raise SystemExit(f"run (overlap={overlap}) failed:\n{res.stdout[-4000:]}")
    times = [float(ms) for it, ms in _ELAPSED.findall(res.stdout) if int(it) > 5]
    return {"exposed_ms": exposed_ms(log_dir), "step_ms": statistics.median(times),
            "val": mds.val_losses(res.stdout)[a.iters]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--bucket", type=int, default=400000, help="--ddp-bucket-size (parameters per bucket)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--gpu", action="store_true", help="real CUDA and NCCL, bf16 (a GPU node; not run in CI)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "overlap"))
    a = p.parse_args()
    os.environ.setdefault("MECEFO_MLM_DEPS", str(ROOT / ".venv" / "mlm-deps"))
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        root = mlm.extract(mlm.SNAPSHOT_GLOB, Path(tmp) / "Megatron-LM")
        patch.apply(str(root))
        if not a.gpu:
            mlm.prepare(root)
        for r in range(a.repeats):
            t0 = time.time()
            off = run(root, a, Path(tmp) / f"off{r}", overlap=False)
            on = run(root, a, Path(tmp) / f"on{r}", overlap=True)
            row = {"repeat": r, "off": off, "on": on, "exposed_ratio": on["exposed_ms"] / off["exposed_ms"],
                   "step_ratio": on["step_ms"] / off["step_ms"], "wall_s": round(time.time() - t0, 1)}
            runs.append(row)
            print(json.dumps(row), flush=True)
    result = {
        "what": "Megatron-LM core_v0.16.1 pretrain_gpt.py with --mecefo, no failure: --overlap-grad-reduce on vs off; "
                "exposed_ms = median per step of the reduction time not hidden by the backward (steps >= 2), "
                "step_ms = median time per iteration",
        "device": "gpu (NCCL, bf16)" if a.gpu else "cpu (tests' CUDA shim, gloo)",
        "config": vars(a), "runs": runs,
        "exposed_ratio_median": statistics.median(r["exposed_ratio"] for r in runs),
        "step_ratio_median": statistics.median(r["step_ratio"] for r in runs),
        "val_loss_rel_diff_max": max(abs(r["on"]["val"] - r["off"]["val"]) / r["off"]["val"] for r in runs),
    }
    Path(a.out + ".json").write_text(json.dumps(result, indent=2) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    xs = range(len(runs))
    for ax, key, label in ((left, "exposed_ms", "exposed reduction (ms/step)"), (right, "step_ms", "ms per iteration")):
        ax.bar([x - 0.2 for x in xs], [r["off"][key] for r in runs], 0.4, label="overlap off")
        ax.bar([x + 0.2 for x in xs], [r["on"][key] for r in runs], 0.4, label="--overlap-grad-reduce")
        ax.set_xticks(list(xs), [f"repeat {r['repeat']}" for r in runs])
        ax.set_ylabel(label)
        ax.legend(fontsize=7)
    fig.suptitle(f"Megatron-LM --mecefo, {a.ranks} replicas, {result['device']}: exposed reduction "
                 f"×{result['exposed_ratio_median']:.2f}, step ×{result['step_ratio_median']:.3f}", fontsize=10)
    fig.tight_layout()
    fig.savefig(a.out + ".png", dpi=120)
    print(json.dumps({k: result[k] for k in ("exposed_ratio_median", "step_ratio_median", "val_loss_rel_diff_max")}))


if __name__ == "__main__":
    main()
