"""Fail-slow: what a slow replica costs the job, with and without `rebalance`.

Runs examples/pretrain_gpt/pretrain_gpt.py under mecefo-launch with --mecefo on D = 4 replicas,
k = 8 micro-batches each, one after another in one run: healthy (rebalance off, and on as a
control: no re-plan may happen), then rank 2 slowed by each factor (an injected slow-down: the rank
sleeps for the extra compute, `--mecefo-inject slow:2:F:FROM`) without and with rebalancing, and a
transient straggler (slowed for 30 steps, then healthy again: the plan must go back to even).

Read from rank 0's step records (steps_rank0.jsonl): the job's step time (the wall time between
consecutive committed steps), as the median over the steps after the slow-down's start plus the
window (the steady state), over the healthy run's; the rebalance events (when, which deal); the
final validation loss (the same micro-batches in the same global batch: equal to the healthy run's
within 1e-5). The slowdown removed is (without - with) / (without - healthy); the least step time
at micro-batch granularity is the planner's own prediction (`slowest_ratio` of its event).

    python benchmarks/stragglers.py        # ~6 min on 2 cores; benchmarks/results/stragglers.{json,png}

On this machine the four ranks share two cores: a sleeping rank frees its core for the others, so
the healthy replicas run a little faster while one is slow than in the healthy run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "pretrain_gpt" / "pretrain_gpt.py"
RANKS, K, SLOW_RANK = 4, 8, 2


def model_args(iters: int) -> list:
    return ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
            "--micro-batch-size", "2", "--global-batch-size", str(2 * K * RANKS), "--train-iters", str(iters),
            "--eval-interval", str(iters), "--eval-iters", "4", "--log-interval", "10", "--lr", "1e-3",
            "--lr-decay-style", "constant", "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type",
            "rope", "--mecefo", "--mecefo-rank", "16"]


def run(name: str, iters: int, extra: list, work: Path) -> dict:
    logs = work / name
    cmd = [sys.executable, "-m", "megatron_mecefo.elastic.launch", "--nproc-per-node", str(RANKS), "--master-port",
           "0", str(EXAMPLE), *model_args(iters), "--mecefo-log-dir", str(logs), *extra]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        raise RuntimeError(f"run {name} failed:\n{proc.stderr[-3000:]}")
    steps = [json.loads(line) for line in (logs / "steps_rank0.jsonl").read_text().splitlines()]
    events = [json.loads(line) for line in (logs / "events_rank0.jsonl").read_text().splitlines()]
    times = [b["time"] - a["time"] for a, b in zip(steps, steps[1:])]
    valid = [float(x) for x in re.findall(r"validation loss at iteration \d+ \| lm loss value: (\S+) \|", proc.stdout)]
    return {"name": name, "flags": extra, "step_s": times, "valid_loss": valid[-1],
            "rebalances": [{k: e[k] for k in ("step", "factors", "micro_batches", "slowest_ratio")}
                           for e in events if e["event"] == "rebalance"],
            "wall_s": round(time.monotonic() - t0, 1)}


def steady(run_: dict, start: int) -> float:
    """Median step time from step `start` on (step_s[i] is the time to commit step i + 1)."""
    return statistics.median(run_["step_s"][start:])


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {r["name"]: r for r in result["runs"]}
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8))
    healthy = steady(runs["healthy"], 1)
    for name, style in (("healthy", "k-"), ("slow2", "r--"), ("slow2+rebalance", "r-"), ("slow1.5", "b--"),
                        ("slow1.5+rebalance", "b-")):
        a.plot(range(2, len(runs[name]["step_s"]) + 2), [t / healthy for t in runs[name]["step_s"]], style,
               label=name, lw=1)
    a.set_xlabel("step")
    a.set_ylabel("step time / healthy median")
    a.set_ylim(0.5, 2.6)
    a.legend(fontsize=7)
    a.set_title(f"rank {SLOW_RANK} slowed from step {result['slow_from']} (D = {RANKS}, k = {K})", fontsize=9)
    t = runs["transient+rebalance"]
    b.plot(range(2, len(t["step_s"]) + 2), [x / healthy for x in t["step_s"]], "g-", lw=1, label="rebalance on")
    t0 = runs["transient"]
    b.plot(range(2, len(t0["step_s"]) + 2), [x / healthy for x in t0["step_s"]], "g--", lw=1, label="off")
    for e in t["rebalances"]:
        b.axvline(e["step"], color="grey", lw=0.6)
    b.axvspan(result["slow_from"], result["slow_from"] + result["transient_steps"], color="orange", alpha=0.15)
    b.set_xlabel("step (grey: a change of plan; shaded: x2 slow)")
    b.set_ylim(0.5, 2.6)
    b.legend(fontsize=7)
    b.set_title(f"transient straggler: {len(t['rebalances'])} re-plans", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=60)
    p.add_argument("--slow-from", type=int, default=10)
    p.add_argument("--transient-steps", type=int, default=30)
    p.add_argument("--factors", type=float, nargs="*", default=[1.25, 1.5, 2.0])
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "stragglers.json")
    args = p.parse_args(argv)
    window = 5  # the default rebalance_window
    result = {"date": datetime.date.today().isoformat(), "ranks": RANKS, "k": K, "slow_rank": SLOW_RANK,
              "slow_from": args.slow_from, "transient_steps": args.transient_steps, "iters": args.iters,
              "rebalance": "defaults (threshold 1.2, window 5)", "runs": [], "factors": {}}
    rebalance = ["--mecefo-rebalance"]
    with tempfile.TemporaryDirectory(prefix="mecefo-stragglers-") as tmp:
        work = Path(tmp)

        def go(name, extra, iters=args.iters):
            r = run(name, iters, extra, work)
            result["runs"].append(r)
            print(f"{name}: median step {statistics.median(r['step_s']) * 1e3:.1f} ms, {len(r['rebalances'])} "
                  f"re-plans, validation loss {r['valid_loss']:.6f} ({r['wall_s']} s)", flush=True)
            return r

        healthy = go("healthy", [])
        control = go("healthy+rebalance", rebalance)
        base = steady(healthy, 1)
        start = args.slow_from + window + 1
        for f in args.factors:
            slow = ["--mecefo-inject", f"slow:{SLOW_RANK}:{f:g}:{args.slow_from}"]
            without = go(f"slow{f:g}", slow)
            with_ = go(f"slow{f:g}+rebalance", slow + rebalance)
            tw, tr = steady(without, start) / base, steady(with_, start) / base
            best = with_["rebalances"][-1]["slowest_ratio"] if with_["rebalances"] else None
            result["factors"][f"{f:g}"] = {
                "without": round(tw, 3), "with": round(tr, 3), "best_at_micro_batch_granularity": best,
                "slowdown_removed": round((tw - tr) / (tw - 1), 3) if tw > 1 else None,
                "detected_at_step": with_["rebalances"][0]["step"] if with_["rebalances"] else None,
                "deal": with_["rebalances"][-1]["micro_batches"] if with_["rebalances"] else None,
                "loss_rel_diff": abs(with_["valid_loss"] - healthy["valid_loss"]) / healthy["valid_loss"]}
            print(f"x{f:g}: {tw:.3f} without, {tr:.3f} with rebalance ({result['factors'][f'{f:g}']})", flush=True)
        slow = ["--mecefo-inject", f"slow:{SLOW_RANK}:2:{args.slow_from}:{args.slow_from + args.transient_steps}"]
        iters = args.slow_from + args.transient_steps + 30
        go("transient", slow, iters)
        transient = go("transient+rebalance", slow + rebalance, iters)
        result["healthy_step_s"] = round(base, 4)
        result["control"] = {"replans": len(control["rebalances"]), "ratio": round(steady(control, 1) / base, 3),
                             "loss_rel_diff": abs(control["valid_loss"] - healthy["valid_loss"]) / healthy["valid_loss"]}
        result["transient"] = {"replans": len(transient["rebalances"]), "plans": transient["rebalances"],
                               "back_to_even": bool(transient["rebalances"]) and not transient["rebalances"][-1]["factors"],
                               "loss_rel_diff": abs(transient["valid_loss"] - healthy["valid_loss"]) / healthy["valid_loss"]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out.with_suffix(".png"))
    print(json.dumps({k: result[k] for k in ("factors", "control", "transient")}, indent=2))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
