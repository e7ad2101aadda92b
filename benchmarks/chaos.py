"""Chaos benchmark: many seeded random failure schedules against the toy runtime job and against
examples/pretrain_gpt, each checked against the invariants of megatron_mecefo.testing.chaos.

    python benchmarks/chaos.py                       # 200 toy + 20 pretrain_gpt + 10 layout + 40 sharded
                                                     # + 10 checkout + 60 spread + 30 straggler schedules (~2 h)
    python benchmarks/chaos.py --toy 0 --pretrain 0 --layouts 0 --sharded 0 --spread 0 --stragglers 0   # the checkouts only
    python benchmarks/chaos.py --toy 20 --pretrain 2 # a quick look
    python benchmarks/chaos.py --toy-seeds 17 42 --pretrain 0   # rerun given seeds (a kind with no
                                                     # schedules keeps its results in the JSON)

Writes benchmarks/results/chaos.json: per job kind the number of schedules, how many finished,
how many gave up cleanly, the violations (must be 0; each with its seed and the exact
--mecefo-inject flags), the injected faults that fired, and the slowest recovery observed
(detection to a new working generation, from the ranks' regroup events). "layouts" runs
examples/pretrain_gpt on 4 ranks as D=2 x T=2 (even seeds) and D=2 x P=2 (odd seeds). "sharded"
runs the toy job with its Adam state sharded over the live replicas (ZeRO-1, neighbour copies): on
top of the toy's invariants, every element of the state is held by a finished rank and equals the
fault-free run's, or the job gave up cleanly (a shard whose owner and copy holder failed together).
"checkouts" runs upstream's own pretrain_gpt.py in patched snapshots (../shared/upstream) as
D=2 x P=2: Megatron-DeepSpeed with DeepSpeed's pipeline engine (even seeds) and Megatron-LM with
its 1F1B schedule (odd seeds), each for 40 steps. "spread" runs the toy job on 3 or 4 replicas with
cover "spread" (a lost replica's micro-batches dealt over the survivors): the toy's invariants, with
each generation's plan read from its regroup events. "stragglers" runs the toy job on 3 or 4
replicas with rebalance on (a window of 2 steps) and one or two slow-downs (1.5x to 3x, some
transient) laid over the kills and hangs (chaos.straggler_schedule): the toy's invariants, with
each rebalanced plan read from its rebalance events.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from megatron_mecefo.testing import chaos
from megatron_mecefo.testing import chaos_runs as chaos_util


def slowest_recovery(log_dir: Path, world: int) -> float:
    """Longest detection-to-regrouped time of any regroup after a failure (seconds)."""
    times = [e["detect_to_recover_s"] + e["agree_s"] + e["regroup_s"]
             for e in chaos.events(log_dir, world, "regroup") if e.get("detect_to_recover_s") is not None]
    return max(times, default=0.0)


def layout_schedule(seed: int, world: int, steps: int) -> chaos.Schedule:
    schedule = chaos.random_schedule(seed, world, steps)
    return dataclasses.replace(schedule, **({"tp": 2} if seed % 2 == 0 else {"pp": 2}))


def run_many(kind: str, seeds, work: Path, world_of, steps: int) -> dict:
    refs = {}
    checkouts = chaos_util.Checkouts(work / "checkouts") if kind == "checkouts" else None
    summary = {"schedules": 0, "finished": 0, "gave_up_cleanly": 0, "violations": 0, "faults_fired": 0,
               "rejoins": 0, "slowest_recovery_s": 0.0, "slowest_run_s": 0.0, "failures": []}
    for seed in seeds:
        world = world_of(seed)
        schedule = chaos.random_schedule(seed, world, steps)
        if kind == "stragglers":
            schedule = chaos.straggler_schedule(seed, world, steps)
        elif kind == "layouts":
            schedule = layout_schedule(seed, world, steps)
        elif kind == "checkouts":
            schedule = dataclasses.replace(schedule, pp=2)
        out = work / f"{kind}-{seed}"
        shutil.rmtree(out, ignore_errors=True)
        if kind in ("toy", "sharded", "spread", "stragglers"):
            if world not in refs:
                refs[world] = chaos_util.toy_reference(work / f"ref{world}", world)
            outcome, bad, result = chaos_util.run_toy(schedule, out, refs[world], sharded=kind == "sharded",
                                                      cover="spread" if kind == "spread" else "neighbour",
                                                      rebalance=kind == "stragglers")
        elif kind == "checkouts":
            outcome, bad, result = chaos_util.run_checkout(schedule, out, checkouts, "mds" if seed % 2 == 0 else "mlm")
        else:
            outcome, bad, result = chaos_util.run_pretrain(schedule, out)
        summary["schedules"] += 1
        summary["finished"] += outcome == "finished"
        summary["gave_up_cleanly"] += outcome == "gave_up"
        summary["faults_fired"] += result.stderr.count("[mecefo inject]")
        summary["rejoins"] += len(chaos.events(out, world, "rejoined"))
        if kind == "spread":  # schedules in which some generation dealt a lost replica over several survivors
            plans = chaos.generation_plans(out, world).values()
            summary["spread_over_several"] = summary.get("spread_over_several", 0) + any(
                len({r for r, mbs in plan.items() if any(m[0] == f for m in mbs)}) > 1
                for plan in plans for f in {m[0] for mbs in plan.values() for m in mbs})
        if kind == "stragglers":  # schedules in which a plan was rebalanced, and the re-plans in all
            replans = {(e["generation"], e["step"]) for e in chaos.events(out, world, "rebalance")}
            summary["rebalanced"] = summary.get("rebalanced", 0) + bool(replans)
            summary["replans"] = summary.get("replans", 0) + len(replans)
        summary["slowest_recovery_s"] = max(summary["slowest_recovery_s"], slowest_recovery(out, world))
        summary["slowest_run_s"] = max(summary["slowest_run_s"], result.elapsed_s)
        if bad:
            summary["violations"] += 1
            summary["failures"].append({"seed": seed, "reproduce": schedule.describe(), "violations": bad[:10]})
            keep = ROOT / "benchmarks" / "results" / "chaos_failures" / f"{kind}-{seed}"
            shutil.copytree(out, keep, dirs_exist_ok=True)
        print(f"[{kind}] seed {seed}: {outcome} in {result.elapsed_s:.1f} s, "
              f"{result.stderr.count('[mecefo inject]')}/{len(schedule.faults)} faults fired"
              + (f"\n    VIOLATION {schedule.describe()}\n    " + "\n    ".join(bad[:5]) if bad else ""), flush=True)
        shutil.rmtree(out, ignore_errors=True)
    summary["slowest_recovery_s"] = round(summary["slowest_recovery_s"], 2)
    summary["slowest_run_s"] = round(summary["slowest_run_s"], 1)
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--toy", type=int, default=200, help="toy schedules (seeds 0..N-1)")
    p.add_argument("--pretrain", type=int, default=20, help="pretrain_gpt schedules (seeds 0..N-1)")
    p.add_argument("--toy-seeds", type=int, nargs="*", default=None)
    p.add_argument("--pretrain-seeds", type=int, nargs="*", default=None)
    p.add_argument("--layouts", type=int, default=10, help="pretrain_gpt schedules on T=2 / P=2 layouts")
    p.add_argument("--layout-seeds", type=int, nargs="*", default=None)
    p.add_argument("--sharded", type=int, default=40, help="sharded toy schedules (seeds 1000..1000+N-1)")
    p.add_argument("--sharded-seeds", type=int, nargs="*", default=None)
    p.add_argument("--checkouts", type=int, default=10, help="schedules on the patched checkouts (seeds 2000..)")
    p.add_argument("--checkout-seeds", type=int, nargs="*", default=None)
    p.add_argument("--spread", type=int, default=60, help='toy schedules with cover "spread" (seeds 3000..)')
    p.add_argument("--spread-seeds", type=int, nargs="*", default=None)
    p.add_argument("--stragglers", type=int, default=30, help="toy schedules with slow-downs and rebalance (seeds 4000..)")
    p.add_argument("--straggler-seeds", type=int, nargs="*", default=None)
    p.add_argument("--pretrain-steps", type=int, default=150)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "chaos.json")
    args = p.parse_args(argv)
    toy_seeds = args.toy_seeds if args.toy_seeds is not None else range(args.toy)
    pre_seeds = args.pretrain_seeds if args.pretrain_seeds is not None else range(args.pretrain)
    layout_seeds = args.layout_seeds if args.layout_seeds is not None else range(args.layouts)
    sharded_seeds = args.sharded_seeds if args.sharded_seeds is not None else range(1000, 1000 + args.sharded)
    checkout_seeds = args.checkout_seeds if args.checkout_seeds is not None else range(2000, 2000 + args.checkouts)
    spread_seeds = args.spread_seeds if args.spread_seeds is not None else range(3000, 3000 + args.spread)
    straggler_seeds = args.straggler_seeds if args.straggler_seeds is not None else range(4000, 4000 + args.stragglers)
    t0 = time.monotonic()
    # a kind run with 0 schedules keeps its results from an earlier run (to rerun one kind only)
    old = json.loads(args.out.read_text()) if args.out.exists() else {}
    results = {"settings": old.get("settings", {})}
    with tempfile.TemporaryDirectory(prefix="mecefo-chaos-") as tmp:
        work = Path(tmp)
        if len(toy_seeds) or "toy" not in old:
            results["toy"] = run_many("toy", toy_seeds, work, lambda s: 2 + s % 3, chaos_util.TOY["steps"])
            results["settings"]["toy"] = {**chaos_util.TOY, **chaos_util.TOY_TIMEOUTS, "ranks": "2-4",
                                          "approximations": "off (exact fold)", "wall_s": round(time.monotonic() - t0, 1)}
        else:
            results["toy"] = old["toy"]
        t1 = time.monotonic()
        if len(pre_seeds) or "pretrain_gpt" not in old:
            results["pretrain_gpt"] = run_many("pretrain", pre_seeds, work, lambda s: 4 if s % 2 == 0 else 2,
                                               args.pretrain_steps)
            results["settings"]["pretrain_gpt"] = {
                "steps": args.pretrain_steps, "ranks": "2 or 4", "args": chaos_util.PRETRAIN,
                **chaos_util.PRETRAIN_TIMEOUTS, "approximations": "on (defaults)", "wall_s": round(time.monotonic() - t1, 1)}
        else:
            results["pretrain_gpt"] = old["pretrain_gpt"]
        t2 = time.monotonic()
        if len(layout_seeds) or "layouts" not in old:
            results["layouts"] = run_many("layouts", layout_seeds, work, lambda s: 4, args.pretrain_steps)
            results["settings"]["layouts"] = {
                "steps": args.pretrain_steps, "ranks": 4, "layout": "D=2 x T=2 (even seeds), D=2 x P=2 (odd seeds)",
                "args": chaos_util.PRETRAIN, **chaos_util.PRETRAIN_TIMEOUTS, "approximations": "on (defaults)",
                "wall_s": round(time.monotonic() - t2, 1)}
        else:
            results["layouts"] = old["layouts"]
        t3 = time.monotonic()
        if len(sharded_seeds) or "sharded" not in old:
            results["sharded"] = run_many("sharded", sharded_seeds, work, lambda s: 2 + s % 3, chaos_util.TOY["steps"])
            results["settings"]["sharded"] = {**chaos_util.TOY, **chaos_util.TOY_TIMEOUTS, "ranks": "2-4",
                                              "optimizer": "Adam sharded over the live replicas, neighbour copies, "
                                              "on_shard_loss give_up", "approximations": "off (exact fold)",
                                              "wall_s": round(time.monotonic() - t3, 1)}
        else:
            results["sharded"] = old["sharded"]
        t4 = time.monotonic()
        if len(checkout_seeds) or "checkouts" not in old:
            import os

            os.environ.setdefault("MECEFO_UPSTREAM_DIR", str(ROOT.parent / "shared" / "upstream"))
            os.environ.setdefault("MECEFO_MDS_DEPS", str(ROOT / ".venv" / "mds-deps"))
            os.environ.setdefault("MECEFO_MLM_DEPS", str(ROOT / ".venv" / "mlm-deps"))
            results["checkouts"] = run_many("checkouts", checkout_seeds, work, lambda s: 4, chaos_util.CHECKOUT_STEPS)
            results["settings"]["checkouts"] = {
                "steps": chaos_util.CHECKOUT_STEPS, "ranks": 4,
                "layout": "D=2 x P=2: Megatron-DeepSpeed 4efb479, DeepSpeed's pipeline engine (even seeds); "
                          "Megatron-LM core_v0.16.1, 1F1B (odd seeds)",
                **chaos_util.PRETRAIN_TIMEOUTS, "approximations": "on (defaults, --mecefo-rank 16)",
                "wall_s": round(time.monotonic() - t4, 1)}
        else:
            results["checkouts"] = old["checkouts"]
        t5 = time.monotonic()
        if len(spread_seeds) or "spread" not in old:
            results["spread"] = run_many("spread", spread_seeds, work, lambda s: 3 + s % 2, chaos_util.TOY["steps"])
            results["settings"]["spread"] = {**chaos_util.TOY, **chaos_util.TOY_TIMEOUTS, "ranks": "3-4",
                                             "cover": "spread", "approximations": "off (exact fold)",
                                             "wall_s": round(time.monotonic() - t5, 1)}
        else:
            results["spread"] = old["spread"]
        t6 = time.monotonic()
        if len(straggler_seeds) or "stragglers" not in old:
            results["stragglers"] = run_many("stragglers", straggler_seeds, work, lambda s: 3 + s % 2,
                                             chaos_util.TOY["steps"])
            results["settings"]["stragglers"] = {**chaos_util.TOY, **chaos_util.TOY_TIMEOUTS, "ranks": "3-4",
                                                 "rebalance": "on, window 2", "slow-downs": "1-2, 1.5x-3x",
                                                 "approximations": "off (exact fold)",
                                                 "wall_s": round(time.monotonic() - t6, 1)}
        else:
            results["stragglers"] = old["stragglers"]
    results["settings"].pop("wall_s", None)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    total = sum(results[kind]["violations"]
                for kind in ("toy", "pretrain_gpt", "layouts", "sharded", "checkouts", "spread", "stragglers"))
    print(json.dumps({k: {x: v for x, v in r.items() if x != "failures"} for k, r in results.items() if k != "settings"},
                     indent=2))
    print(f"wrote {args.out}")
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main())
