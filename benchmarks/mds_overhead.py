"""Megatron-DeepSpeed healthy overhead: what the patch + --mecefo cost when nothing fails.

Runs Megatron-DeepSpeed's own pretrain_gpt.py (the snapshot in ../shared/upstream, extracted twice:
one copy unpatched, one patched by mecefo-patch) alternately: the unpatched script under torchrun
(DeepSpeed's data-parallel all-reduce) and the patched one with --mecefo under mecefo-launch (the
runtime's all-reduce, the commit vote, the heartbeat thread). Interleaved repeats in one run, so
the machine's noise hits both alike. Reads upstream's log lines: the time per iteration (median
over the logged intervals, the first left out as warm-up) and the final validation loss.

    python benchmarks/mds_overhead.py          # ~6 min on 2 cores: benchmarks/results/mds_overhead.{json,png}
    python benchmarks/mds_overhead.py --pp 2 --ranks 4   # D=2 x P=2, DeepSpeed's pipeline engine: mds_overhead_pp2.*

Needs the "mds" extra (scripts/test.sh installs it into .venv/mds-deps; or pip install -e .[mds]).
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
from megatron_mecefo.testing import mds

_ELAPSED = re.compile(r"elapsed time per iteration \(ms\): ([0-9.]+)")


def model_args(data: Path, ds: Path, a) -> list:
    args = mds.resize(mds.args(data, ds, dp=a.ranks // a.pp, iters=a.iters, micro_batches=a.micro_batches, extra=[
        "--log-interval", "10", "--eval-interval", str(a.iters), "--eval-iters", "2"]), layers=4, hidden=a.hidden, seq=a.seq)
    if a.pp > 1:  # DeepSpeed's pipeline engine (GPTModelPipe), as Megatron-DeepSpeed's GPT recipes run
        args = [x for x in args if x != "--no-pipeline-parallel"] + ["--pipeline-model-parallel-size", str(a.pp)]
    return args


def measure(out: str) -> float:
    times = [float(x) for x in _ELAPSED.findall(out)][1:]
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--iters", type=int, default=60)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--pp", type=int, default=1, help="pipeline stages per replica (DeepSpeed's pipeline engine)")
    p.add_argument("--out", default=None, help="default: benchmarks/results/mds_overhead[_pp2]")
    a = p.parse_args()
    a.out = a.out or str(ROOT / "benchmarks" / "results" / ("mds_overhead" + (f"_pp{a.pp}" if a.pp > 1 else "")))
    if not os.environ.get("MECEFO_MDS_DEPS"):
        os.environ["MECEFO_MDS_DEPS"] = str(ROOT / ".venv" / "mds-deps")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        orig = mds.extract(mds.SNAPSHOT_GLOB, tmp / "orig" / "Megatron-DeepSpeed")
        patched = mds.extract(mds.SNAPSHOT_GLOB, tmp / "patched" / "Megatron-DeepSpeed")
        patch.apply(str(patched))
        data = tmp / "corpus_text_document"
        mds.write_dataset(orig, data, documents=2000)
        mds.prepare(orig)  # the dataset helpers built before the timed runs
        mds.prepare(patched)
        args = model_args(data, tmp / "ds.json", a)
        runs = []
        for r in range(a.repeats):
            t0 = time.time()
            plain = mds.torchrun(orig, a.ranks, args, timeout=900)
            mecefo = mds.mecefo_launch(patched, a.ranks, args + ["--mecefo", "--mecefo-rank", "16"], timeout=900)
            for name, res in (("unpatched", plain), ("mecefo", mecefo)):
                if res.returncode != 0:
                    raise SystemExit(f"{name} run failed:\n{res.stdout[-4000:]}")
            row = {"repeat": r, "unpatched_ms": measure(plain.stdout), "mecefo_ms": measure(mecefo.stdout),
                   "unpatched_val": mds.val_losses(plain.stdout)[a.iters],
                   "mecefo_val": mds.val_losses(mecefo.stdout)[a.iters], "wall_s": time.time() - t0}
            row["ratio"] = row["mecefo_ms"] / row["unpatched_ms"]
            runs.append(row)
            print(json.dumps(row), flush=True)
    result = {
        "what": "Megatron-DeepSpeed 4efb479 pretrain_gpt.py: unpatched under torchrun vs patched with --mecefo under "
                "mecefo-launch, no failure; time per iteration (median of logged intervals); "
                f"{a.pp} pipeline stage(s) per replica" + (" (DeepSpeed's pipeline engine)" if a.pp > 1 else ""),
        "config": vars(a), "runs": runs,
        "ratio_median": statistics.median(r["ratio"] for r in runs),
        "val_loss_rel_diff_max": max(abs(r["mecefo_val"] - r["unpatched_val"]) / r["unpatched_val"] for r in runs),
    }
    Path(a.out + ".json").write_text(json.dumps(result, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = range(len(runs))
    ax.bar([x - 0.2 for x in xs], [r["unpatched_ms"] for r in runs], 0.4, label="unpatched (torchrun)")
    ax.bar([x + 0.2 for x in xs], [r["mecefo_ms"] for r in runs], 0.4, label="patched, --mecefo (mecefo-launch)")
    ax.set_xticks(list(xs), [f"repeat {r['repeat']}\n×{r['ratio']:.3f}" for r in runs])
    ax.set_ylabel("ms per iteration")
    ax.set_title(f"Megatron-DeepSpeed, {a.ranks} ranks, P = {a.pp}, no failure: median ×{result['ratio_median']:.3f}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(a.out + ".png", dpi=120)
    print(json.dumps({k: result[k] for k in ("ratio_median", "val_loss_rel_diff_max")}))


if __name__ == "__main__":
    main()
