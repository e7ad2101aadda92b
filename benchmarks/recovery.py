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

    python benchmarks/recovery.py            # ~2 min; writes benchmarks/results/recovery.{json,png}
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tiny_gpt" / "train.py"


def run_job(out: Path, world: int, steps: int, extra):
    cmd = [sys.executable, "-m", "megatron_mecefo.elastic.launch", "--nproc-per-node", str(world), "--master-port", "0",
           str(EXAMPLE), "--out", str(out), "--steps", str(steps), *extra]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"job failed:\n{proc.stderr[-3000:]}")
    return t0


def read(path: Path):
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def measure(kind: str, args, victim: int = 1, at_step: int = 3):
    with tempfile.TemporaryDirectory() as d:
        out = Path(d)
        run_job(out, args.world, args.steps, [
            "--mecefo-inject", f"{kind}:{victim}:{at_step}:backward", "--step-sleep", str(args.step_sleep),
            "--mecefo-collective-timeout-s", str(args.collective_timeout),
            "--mecefo-heartbeat-interval-s", str(args.heartbeat_interval),
            "--mecefo-heartbeat-timeout-s", str(args.heartbeat_timeout),
        ])
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
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "recovery.json")
    args = p.parse_args(argv)

    results = {}
    for kind, label in (("kill", "crash"), ("hang", "hang")):
        runs = [measure(kind, args) for _ in range(args.repeats)]
        results[label] = {"runs": runs, **{k: statistics.median(r[k] for r in runs) for k in runs[0]}}
        print(f"{label}: " + ", ".join(f"{k} {results[label][k]:.3f}" for k in runs[0]), flush=True)
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
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    plot(out, args.out.with_suffix(".png"))
    print(f"crash -> degraded step {out['crash_to_degraded_step_s']:.2f} s, hang -> {out['hang_to_degraded_step_s']:.2f} s, "
          f"cold start -> first step {cold:.2f} s; wrote {args.out}")


def plot(out, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = ("detect_s", "agree_s", "regroup_s", "redo_s")
    colors = ("tab:red", "tab:orange", "tab:blue", "tab:green")
    fig, ax = plt.subplots(figsize=(9, 3.2))
    rows = [("crash (SIGKILL)", out["crash"]), ("hang (SIGSTOP)", out["hang"])]
    for y, (label, r) in enumerate(rows):
        left = 0.0
        for ph, c in zip(phases, colors):
            ax.barh(y, r[ph], left=left, color=c, label=ph[:-2] if y == 0 else None)
            left += r[ph]
        ax.text(left, y, f" {r['failure_to_degraded_step_s']:.2f} s", va="center")
    ax.barh(2, out["cold_start_to_first_step_s"], color="tab:gray", label="cold start (restart floor)")
    ax.text(out["cold_start_to_first_step_s"], 2, f" {out['cold_start_to_first_step_s']:.2f} s", va="center")
    ax.set_yticks([0, 1, 2], ["crash (SIGKILL)", "hang (SIGSTOP)", "cold start of the job"])
    ax.invert_yaxis()
    ax.set_xlabel("seconds from the failure to the first completed degraded step")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
