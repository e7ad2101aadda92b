"""Many real ranks on one machine: the toy runtime job at 32 processes (gloo), fault-free and with a
rank killed (SIGKILL) and restarted, under mecefo-launch.

It checks what the chaos harness checks (megatron_mecefo.testing.chaos.check_run: every committed
step consumed the whole global batch exactly once, one generation per step, no hang), and:
  * every rank that finished holds bit-identical parameters and Adam state, in each run;
  * the faulty run's final state against the fault-free run's (bit-identical or not, max abs diff)
    and against the single-process fault-free reference (within rtol 1e-5, as the tests);
  * the store calls of each step in the whole job (the ranks' step records count them; heartbeats
    run on their own connections and are not counted): healthy steps must stay <= 4;
  * the recovery: detection to the regrouped generation, from the ranks' regroup events.

The timeouts are raised for 32 processes on 2 cores (a starved heartbeat thread must not look dead).

    python benchmarks/many_ranks.py                # ~6 min on 2 cores; benchmarks/results/many_ranks.json
    python benchmarks/many_ranks.py --ranks 16     # a quicker look
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

from megatron_mecefo.testing import chaos
from megatron_mecefo.testing import chaos_runs as chaos_util, toy_train
from megatron_mecefo.testing.chaos import Fault, Schedule

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
TIMEOUTS = dict(collective_timeout_s=20.0, heartbeat_interval_s=1.0, heartbeat_timeout_s=8.0, agree_timeout_s=40.0)
HEALTHY_GOAL = 4


def store_calls(out: Path, world: int) -> dict:
    """step -> store calls of that step's records in the whole job."""
    per_step = defaultdict(int)
    for r in range(world):
        for rec in chaos.read_jsonl(out / f"steps_rank{r}.jsonl"):
            per_step[rec["step"]] += rec["store_calls"]
    return dict(sorted(per_step.items()))


def finals(out: Path) -> dict:
    return {int(p.stem.removeprefix("final_rank")): torch.load(p, weights_only=False) for p in out.glob("final_rank*.pt")}


def tensors(final: dict) -> list:
    opt = [s[k] for s in final["opt"]["state"].values() for k in ("exp_avg", "exp_avg_sq", "step")]
    return list(final["params"]) + opt


def identical(a: dict, b: dict) -> bool:
    return all(torch.equal(x, y) for x, y in zip(tensors(a), tensors(b)))


def max_diff(a: dict, b: dict) -> float:
    return max(float((x.double() - y.double()).abs().max()) for x, y in zip(a["params"], b["params"]))


def run(name: str, schedule: Schedule, work: Path, reference: dict, args) -> dict:
    out = work / name
    t_startup = 10.0 + 2.0 * schedule.world  # torch imports and gloo rendezvous of `world` processes on few cores
    outcome, bad, result = chaos_util.run_toy(schedule, out, reference, step_sleep=args.step_sleep, timeouts=TIMEOUTS,
                                              startup_s=t_startup, fault_free_s=20.0 + 3.0 * schedule.steps)
    calls = store_calls(out, schedule.world)
    regroups = [e for e in chaos.events(out, schedule.world, "regroup") if e["generation"] > 0]
    recoveries = [e["detect_to_recover_s"] + e["agree_s"] + e["regroup_s"] for e in regroups
                  if e.get("detect_to_recover_s") is not None]
    # not healthy: a step redone in a new generation, a step whose commit admitted a restarted rank (the
    # step before its generation), and a step the injection holds until the restart asks to rejoin
    changed = {e["step"] for e in regroups}
    held = {f.step for f in schedule.faults if f.kind == "hold"}
    excluded = changed | {s - 1 for s in changed} | held
    healthy = {s: n for s, n in calls.items() if s not in excluded}
    f = finals(out)
    first = f[min(f)] if f else None
    row = {"schedule": schedule.describe(), "outcome": outcome, "violations": bad, "elapsed_s": round(result.elapsed_s, 1),
           "faults_fired": sum(line.startswith("[mecefo inject]") for line in result.stderr.splitlines()),
           "ranks_finished": sorted(f),
           "finished_ranks_bit_identical": bool(f) and all(identical(first, x) for x in f.values()),
           "max_abs_diff_vs_single_process_reference": max_diff(first, reference) if first else None,
           "store_calls_per_step": calls,
           "healthy_steps": len(healthy), "healthy_store_calls_max": max(healthy.values(), default=None),
           "healthy_store_calls_total_mean": round(sum(healthy.values()) / max(1, len(healthy)), 2),
           "generation_changes_at_steps": sorted(changed), "held_steps": sorted(held),
           "store_calls_of_steps_not_healthy": {s: calls.get(s) for s in sorted(excluded)},
           "recovery_s": [round(x, 3) for x in sorted(set(recoveries))]}
    if bad:
        row["stderr_tail"] = result.stderr[-3000:]
    return row, first


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=32)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--step-sleep", type=float, default=0.02, help="fake compute per micro-batch (s)")
    p.add_argument("--out", type=Path, default=RESULTS / "many_ranks.json")
    args = p.parse_args(argv)
    n, victim = args.ranks, args.ranks // 2 - 3
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        toy_train.reference(argparse.Namespace(steps=args.steps, k=chaos_util.TOY["k"], mb=chaos_util.TOY["mb"],
                                               world=n, out=work))
        reference = torch.load(work / "reference.pt", weights_only=False)
        fault_free = Schedule(0, n, args.steps, (), None)
        # the victim is killed in a backward, restarted 1 s later; the job holds at a later step until its
        # restart asks to rejoin (keyed to the event, not the clock), so every run rejoins at that step
        faulty = Schedule(1, n, args.steps, (Fault("kill", victim, 4, "backward"),
                                             Fault("hold", victim, args.steps // 2 + 2, "forward", 1)), 1.0)
        rows = {}
        rows["fault_free"], clean = run("fault_free", fault_free, work, reference, args)
        rows["kill_and_rejoin"], after = run("kill_and_rejoin", faulty, work, reference, args)
    rows["kill_and_rejoin"]["bit_identical_to_fault_free_run"] = (
        clean is not None and after is not None and identical(clean, after))
    rows["kill_and_rejoin"]["max_abs_diff_vs_fault_free_run"] = max_diff(clean, after) if clean and after else None
    ok = all(not r["violations"] and r["outcome"] == "finished" and r["finished_ranks_bit_identical"]
             and (r["healthy_store_calls_max"] or 0) <= HEALTHY_GOAL for r in rows.values())
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    result = {"date": datetime.date.today().isoformat(), "commit": commit,
              "command": f"python benchmarks/many_ranks.py --ranks {n} --steps {args.steps}",
              "ranks": n, "steps": args.steps, "k": chaos_util.TOY["k"], "mb": chaos_util.TOY["mb"],
              "timeouts": TIMEOUTS, "healthy_goal": HEALTHY_GOAL, "ok": ok, "runs": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for name, r in rows.items():
        print(f"{name}: {r['outcome']} in {r['elapsed_s']} s, violations {len(r['violations'])}, "
              f"healthy store calls <= {r['healthy_store_calls_max']} (mean {r['healthy_store_calls_total_mean']}), "
              f"recovery {r['recovery_s']}, bit-identical {r['finished_ranks_bit_identical']}")
        for v in r["violations"]:
            print("   ", v)
    print("ok" if ok else "NOT OK", "->", args.out)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
