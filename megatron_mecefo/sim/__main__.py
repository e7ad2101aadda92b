"""python -m megatron_mecefo.sim: every system on the same seeded failure traces.

    python -m megatron_mecefo.sim --systems mecefo,checkpoint_restart,torchft --scenario high \\
        --hours 720 --seeds 20 --out result.json

The JSON holds, per system, `throughput_drop` (against the same system without failures; mean over
seeds), `throughput_drop_ci95`, `ettr` (training progress per wall second of the provisioned GPUs),
`approx_fraction`, `dropped_fraction`, `fatal_events`, `breakdown` (hours lost per cause, in hours
of the failure-free job), `idle_spares_hours` (systems with spares) and, with --token-budget,
`time_to_budget_hours` (at the system's mean rate over the runs).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from megatron_mecefo.sim.presets import SCENARIOS
from megatron_mecefo.sim.run import SYSTEMS, Setup, run_all


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m megatron_mecefo.sim", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default="mecefo,checkpoint_restart", help=f"comma-separated: {', '.join(SYSTEMS)}")
    p.add_argument("--scenario", choices=list(SCENARIOS), help="low / medium / high: the paper's (32 GPUs, a failure "
                   "every 2 / 1 / 0.5 h, repair 4 / 3 / 2 h); llama3 / meta-rsc1 / meta-rsc2: 16,384 / 16,384 / 8,192 "
                   "GPUs in 8-GPU nodes at 3.79 / 6.50 / 2.34 failures per 1000 node-days, repair 4 h; flags override")
    p.add_argument("--gpus", type=int, default=None)
    p.add_argument("--gpus-per-node", type=int, default=None, help="GPUs per failure domain (default: 1, or the scenario's)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--spares", type=int, default=None, help="spare domains of the spare-based systems (default: P99 of the concurrent failures)")
    p.add_argument("--mtbf-hours", type=float, default=None, help="cluster-wide mean time between failures")
    p.add_argument("--failures-per-1000-node-days", type=float, default=None, help="per failure domain (Meta's r_f)")
    p.add_argument("--repair-hours", type=float, default=None)
    p.add_argument("--repair", choices=["fixed", "exponential", "lognormal"], default="fixed")
    p.add_argument("--weibull-shape", type=float, default=None, help="Weibull inter-failure times of this shape (< 1: bursts)")
    p.add_argument("--lemons", type=int, default=0, help="this many failure domains fail --lemon-factor times as often")
    p.add_argument("--lemon-factor", type=float, default=10.0)
    p.add_argument("--trace-csv", type=Path, default=None, help="a trace (t_s,domain,repair_s) instead of a generated one")
    p.add_argument("--model", choices=["350M", "1B", "7B"], default="1B",
                   help="size of the model (the baselines' size-dependent constants, the re-shard volume)")
    p.add_argument("--micro-batches", type=int, default=8, help="micro-batches per replica and step")
    p.add_argument("--hours", type=float, default=720.0, help="simulated wall time")
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--cover-time-ratio", type=float, default=None, help="MeCeFO's covering step over a normal one "
                   "(default: benchmarks/results/covering_cost.json, LLaMA-1B layer size)")
    p.add_argument("--step-s", type=float, default=1.0, help="a normal step's wall time")
    p.add_argument("--checkpoint-write-s", type=float, default=None)
    p.add_argument("--restart-s", type=float, default=None)
    p.add_argument("--token-budget", type=float, default=None, help="tokens to train (with --tokens-per-s): "
                   "adds each system's time_to_budget_hours")
    p.add_argument("--tokens-per-s", type=float, default=None, help="the job's failure-free throughput")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--plot", type=Path, default=None, help="PNG: seed 0's first day, GPUs down, covering replicas "
                   "and each system's useful throughput")
    return p.parse_args(argv)


def plot_timeline(setup: Setup, systems, path: Path, hours: float = 24.0) -> None:
    """Seed 0's first `hours`: domains down and replicas covering (MeCeFO), and each system's useful
    throughput (1 = failure-free; checkpoint-restart keeps its own clock and is left out)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    horizon = min(hours, setup.hours) * 3600
    trace = setup.trace(0)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 6), sharex=True)
    for name in systems:
        run = SYSTEMS[name](setup)[0]
        if name in ("checkpoint_restart", "inmemory_checkpoint"):
            continue
        marks = run(trace, horizon, timeline=True).timeline
        ts = [0.0] + [m["t"] / 3600 for m in marks]
        bottom.step(ts, [1.0] + [m["speed"] for m in marks], where="post", label=name, lw=1)
        if name == "mecefo":
            top.step(ts, [0] + [m["approx"] * setup.grid.dp / 2 for m in marks], where="post", label="replicas covering (mecefo)", ls="--", lw=1.5)
        if name == systems[0]:
            top.step(ts, [0] + [m["down"] for m in marks], where="post", label="failure domains down", color="k", lw=0.8)
    top.set_ylabel("count")
    top.legend(fontsize=8)
    bottom.set_ylabel("useful throughput")
    bottom.set_xlabel("hours")
    bottom.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def main(argv=None) -> int:
    args = parse(argv)
    try:
        if (args.token_budget is None) != (args.tokens_per_s is None):
            raise ValueError("--token-budget and --tokens-per-s go together")
        if args.tokens_per_s is not None and not (args.tokens_per_s > 0 and args.token_budget > 0):
            raise ValueError("--token-budget and --tokens-per-s must be > 0")
        budget = args.token_budget / args.tokens_per_s / 3600 if args.token_budget else None
        setup = Setup.from_args(args)
        systems = [s.strip() for s in args.systems.split(",") if s.strip()]
        result = run_all(setup, systems, seeds=args.seeds, budget_hours=budget)
        if args.plot:
            plot_timeline(setup, systems, args.plot)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    if any(n.startswith("mecefo") for n in result["systems"]):
        print(f"MeCeFO's covering step: {setup.cover_time_ratio:.3f} x a normal one ({setup.cover_time_ratio_source}); "
              "measure yours with benchmarks/covering_cost.py and pass --cover-time-ratio")
    for name, r in result["systems"].items():
        print(f"{name:28s} drop {100 * r['throughput_drop']:6.2f} % (95 % CI ± {100 * r['throughput_drop_ci95']:.2f})"
              f"  ETTR {r['ettr']:.4f}  approx {100 * r['approx_fraction']:5.2f} %  dropped {100 * r['dropped_fraction']:5.2f} %"
              f"  fatal {r['fatal_events']:.1f}"
              + (f"  to budget {r['time_to_budget_hours']:.1f} h" if "time_to_budget_hours" in r else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
