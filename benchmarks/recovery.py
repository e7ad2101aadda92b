"""Recovery latency: from a rank's failure to the first completed degraded step.

Runs examples/tiny_gpt/train.py (a Megatron-Core GPT in a DeepSpeed engine with the MeCeFO hook)
under mecefo-launch on this machine's loopback, kills (SIGKILL) or hangs (SIGSTOP) one rank, and
reads the ranks' JSONL logs:

  detect   failure -> a survivor's collective fails (crash: connection reset; hang: the
           collective timeout, --collective-timeout)
  agree    survivors agree on the new generation (crash: the launcher reports the exit at once;
           hang: the heartbeat timeout)
  regroup  new data-parallel group built
  redo     the interrupted step redone by the survivors, with the neighbour covering

For comparison it also measures a cold start of the same job (launch -> first completed step),
the floor of any restart-based recovery before a checkpoint is even loaded.

Tensor and pipeline parallelism: the same crash breakdown for examples/pretrain_gpt/pretrain_gpt.py
on 4 ranks, D=2 x T=2 and D=2 x P=2, one rank of replica 1 killed (its replica retires; replica 0
covers on every stage).

    python benchmarks/recovery.py            # ~4 min; writes benchmarks/results/recovery.{json,png}
    python benchmarks/recovery.py --baseline efb62c9   # + that commit's, each case run in turn (~8 min)
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from megatron_mecefo.testing import baseline

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tiny_gpt" / "train.py"


def run_job(out: Path, world: int, steps: int, extra, tree: Path = ROOT):
    """The example under mecefo-launch, from this tree or from a baseline's (`tree`)."""
    cmd = [sys.executable, "-m", "megatron_mecefo.elastic.launch", "--nproc-per-node", str(world), "--master-port", "0",
           str(tree / EXAMPLE.relative_to(ROOT)), "--out", str(out), "--steps", str(steps), *extra]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=tree, env=baseline.env_for(tree), capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"job failed:\n{proc.stderr[-3000:]}")
    return t0


def read(path: Path):
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def measure(kind: str, args, victim: int = 1, at_step: int = 3, tree: Path = ROOT):
    with tempfile.TemporaryDirectory() as d:
        out = Path(d)
        run_job(out, args.world, args.steps, [
            "--mecefo-inject", f"{kind}:{victim}:{at_step}:backward", "--step-sleep", str(args.step_sleep),
            "--mecefo-collective-timeout-s", str(args.collective_timeout),
            "--mecefo-heartbeat-interval-s", str(args.heartbeat_interval),
            "--mecefo-heartbeat-timeout-s", str(args.heartbeat_timeout),
        ], tree)
        (inject,) = [e for e in read(out / f"events_rank{victim}.jsonl") if e["event"] == "inject"]
        leader = min(r for r in range(args.world) if r != victim)
        (regroup,) = [e for e in read(out / f"events_rank{leader}.jsonl") if e["event"] == "regroup" and e["generation"] == 1]
        first_degraded = min(s["time"] for s in read(out / f"steps_rank{leader}.jsonl") if s["generation"] == 1)
        t_fail = inject["time"]
        return {
            "detect_s": regroup["detected_at"] - t_fail,
            "agree_s": regroup["agreed_at"] - regroup["detected_at"],
            "regroup_s": regroup["regrouped_at"] - regroup["agreed_at"],
            "redo_s": first_degraded - regroup["regrouped_at"],
            "failure_to_degraded_step_s": first_degraded - t_fail,
        }


LAYOUTS = {"tp2": (["--tensor-model-parallel-size", "2"], 2), "pp2": (["--pipeline-model-parallel-size", "2"], 3)}
"""layout -> (flags, the rank of replica 1 that is killed)"""


def measure_layout(name: str, args, at_step: int = 4, tree: Path = ROOT):
    flags, victim = LAYOUTS[name]
    with tempfile.TemporaryDirectory() as d:
        out = Path(d)
        cmd = [sys.executable, "-m", "megatron_mecefo.elastic.launch", "--nproc-per-node", "4", "--master-port", "0",
               str(tree / "examples" / "pretrain_gpt" / "pretrain_gpt.py"), *flags, "--mecefo", "--mecefo-rank", "8",
               "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
               "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "10", "--eval-interval", "10",
               "--eval-iters", "1", "--log-interval", "10", "--mecefo-log-dir", str(out),
               "--mecefo-inject", f"kill:{victim}:{at_step}:backward",
               "--mecefo-collective-timeout-s", str(args.collective_timeout),
               "--mecefo-heartbeat-interval-s", str(args.heartbeat_interval),
               "--mecefo-heartbeat-timeout-s", str(args.heartbeat_timeout)]
        proc = subprocess.run(cmd, cwd=tree, env=baseline.env_for(tree), capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"{name} job failed:\n{proc.stderr[-3000:]}")
        (inject,) = [e for e in read(out / f"events_rank{victim}.jsonl") if e["event"] == "inject"]
        (regroup,) = [e for e in read(out / "events_rank0.jsonl") if e["event"] == "regroup" and e["generation"] == 1]
        first_degraded = min(s["time"] for s in read(out / "steps_rank0.jsonl") if s["generation"] == 1)
        return {
            "detect_s": regroup["detected_at"] - inject["time"],
            "agree_s": regroup["agreed_at"] - regroup["detected_at"],
            "regroup_s": regroup["regrouped_at"] - regroup["agreed_at"],
            "redo_s": first_degraded - regroup["regrouped_at"],
            "failure_to_degraded_step_s": first_degraded - inject["time"],
        }


def cold_start(args):
    with tempfile.TemporaryDirectory() as d:
        out = Path(d)
        t0 = run_job(out, args.world, 2, [])
        first = min(s["time"] for s in read(out / "steps_rank0.jsonl"))
        return first - t0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--collective-timeout", type=float, default=5.0)
    p.add_argument("--heartbeat-interval", type=float, default=0.5)
    p.add_argument("--heartbeat-timeout", type=float, default=2.0)
    p.add_argument("--baseline", default=None, metavar="COMMIT",
                   help="also measure every case on this earlier commit, each run beside this tree's")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "recovery.json")
    args = p.parse_args(argv)
    with contextlib.ExitStack() as stack:
        base_tree = stack.enter_context(baseline.checkout(args.baseline)) if args.baseline else None
        run_all(args, base_tree)


def run_all(args, base_tree):
    results, base = {}, {}
    for kind, label in (("kill", "crash"), ("hang", "hang")):
        runs, old = [], []
        for _ in range(args.repeats):
            runs.append(measure(kind, args))
            if base_tree is not None:
                old.append(measure(kind, args, tree=base_tree))
        results[label] = {"runs": runs, **{k: statistics.median(r[k] for r in runs) for k in runs[0]}}
        print(f"{label}: " + ", ".join(f"{k} {results[label][k]:.3f}" for k in runs[0]), flush=True)
        if old:
            base[label] = {"runs": old, **{k: statistics.median(r[k] for r in old) for k in old[0]}}
            print(f"{label} at {args.baseline}: " + ", ".join(f"{k} {base[label][k]:.3f}" for k in old[0]), flush=True)
    for name in LAYOUTS:
        runs, old = [], []
        for _ in range(args.repeats):
            runs.append(measure_layout(name, args))
            if base_tree is not None:
                old.append(measure_layout(name, args, tree=base_tree))
        results[name] = {"runs": runs, **{k: statistics.median(r[k] for r in runs) for k in runs[0]}}
        print(f"{name} crash: " + ", ".join(f"{k} {results[name][k]:.3f}" for k in runs[0]), flush=True)
        if old:
            base[name] = {"runs": old, **{k: statistics.median(r[k] for r in old) for k in old[0]}}
            print(f"{name} crash at {args.baseline}: " + ", ".join(f"{k} {base[name][k]:.3f}" for k in old[0]), flush=True)
    cold = statistics.median(cold_start(args) for _ in range(args.repeats))
    out = {
        "setup": {"job": "examples/tiny_gpt/train.py (Megatron-Core GPT, DeepSpeed engine, MeCeFO hook), gloo on loopback",
                  "world": args.world, "collective_timeout_s": args.collective_timeout,
                  "heartbeat_interval_s": args.heartbeat_interval, "heartbeat_timeout_s": args.heartbeat_timeout,
                  "repeats": args.repeats, "statistic": "median"},
        "crash_to_degraded_step_s": results["crash"]["failure_to_degraded_step_s"],
        "hang_to_degraded_step_s": results["hang"]["failure_to_degraded_step_s"],
        "cold_start_to_first_step_s": cold,
        "crash": results["crash"],
        "hang": results["hang"],
        "layouts": {"setup": "examples/pretrain_gpt/pretrain_gpt.py, 4 ranks (D=2), 2 layers, hidden 64, a rank of "
                             "replica 1 killed in its backward at step 4",
                    **{name: results[name] for name in LAYOUTS}},
        "date": datetime.date.today().isoformat(),
    }
    if base:
        out["baseline"] = {"commit": args.baseline, "runs": "interleaved with this tree's, one each in turn", **base}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    plot(out, args.out.with_suffix(".png"))
    print(f"crash -> degraded step {out['crash_to_degraded_step_s']:.2f} s (T=2: {results['tp2']['failure_to_degraded_step_s']:.2f} s, "
          f"P=2: {results['pp2']['failure_to_degraded_step_s']:.2f} s), hang -> {out['hang_to_degraded_step_s']:.2f} s, "
          f"cold start -> first step {cold:.2f} s; wrote {args.out}")


def plot(out, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = ("detect_s", "agree_s", "regroup_s", "redo_s")
    colors = ("tab:red", "tab:orange", "tab:blue", "tab:green")
    fig, ax = plt.subplots(figsize=(9, 4.2))
    rows = [("crash (SIGKILL)", out["crash"]), ("hang (SIGSTOP)", out["hang"]),
            ("crash, D2 x T2", out["layouts"]["tp2"]), ("crash, D2 x P2", out["layouts"]["pp2"])]
    for y, (label, r) in enumerate(rows):
        left = 0.0
        for ph, c in zip(phases, colors):
            ax.barh(y, r[ph], left=left, color=c, label=ph[:-2] if y == 0 else None)
            left += r[ph]
        ax.text(left, y, f" {r['failure_to_degraded_step_s']:.2f} s", va="center")
    n = len(rows)
    ax.barh(n, out["cold_start_to_first_step_s"], color="tab:gray", label="cold start (restart floor)")
    ax.text(out["cold_start_to_first_step_s"], n, f" {out['cold_start_to_first_step_s']:.2f} s", va="center")
    ax.set_yticks(range(n + 1), [label for label, _ in rows] + ["cold start of the job"])
    ax.invert_yaxis()
    ax.set_xlabel("seconds from the failure to the first completed degraded step")
    ax.set_xlim(0, 1.2 * max(out["cold_start_to_first_step_s"], *(r["failure_to_degraded_step_s"] for _, r in rows)))
    ax.legend(loc="center right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
