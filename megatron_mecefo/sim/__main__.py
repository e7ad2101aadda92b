"""python -m megatron_mecefo.sim: every system on the same seeded failure traces.

    python -m megatron_mecefo.sim --systems mecefo,checkpoint_restart,torchft --scenario high \\
        --hours 720 --seeds 20 --out result.json

The JSON holds, per system, `throughput_drop` (against the same system without failures; mean over
seeds), `throughput_drop_ci95`, `ettr` (training progress per wall second of the provisioned GPUs),
`approx_fraction`, `dropped_fraction`, `fatal_events` and `breakdown` (hours lost per cause).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from megatron_mecefo.sim.run import SYSTEMS, Setup, run_all


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m megatron_mecefo.sim", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default="mecefo,checkpoint_restart", help=f"comma-separated: {', '.join(SYSTEMS)}")
    p.add_argument("--scenario", choices=["low", "medium", "high"], help="the paper's presets (32 GPUs, MTBF, repair)")
    p.add_argument("--gpus", type=int, default=None)
    p.add_argument("--gpus-per-node", type=int, default=1, help="GPUs per failure domain")
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
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    try:
        setup = Setup.from_args(args)
        result = run_all(setup, [s.strip() for s in args.systems.split(",") if s.strip()], seeds=args.seeds)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    for name, r in result["systems"].items():
        print(f"{name:28s} drop {100 * r['throughput_drop']:6.2f} % (95 % CI ± {100 * r['throughput_drop_ci95']:.2f})"
              f"  ETTR {r['ettr']:.4f}  approx {100 * r['approx_fraction']:5.2f} %  dropped {100 * r['dropped_fraction']:5.2f} %"
              f"  fatal {r['fatal_events']:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
