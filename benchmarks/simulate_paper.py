"""The paper's throughput table and beyond, from the cluster simulator (megatron_mecefo/sim).

1. `paper_table`: the MeCeFO paper's high failure scenario (32 GPUs, a failure every 0.5 h,
   repaired in 2 h) for 350M / 1B / 7B: Bamboo and Oobleck predicted with the constants of
   sim/presets.py (fixed before this comparison), MeCeFO from this project's measured covering
   costs (covering_cost.json: the paper's rule at LLaMA-1B layer size, CPU fp32, and at the small
   setup A), beside the paper's drops. Also the covering ratio the paper's drop implies
   (drop = 1 - 1 / (P0 + (1 - P0) c), P0 = share of the time with nothing down) and, for Bamboo,
   the re-rendezvous time at which the model would meet the paper (the one named parameter).
2. `scale`: 1,024 and 16,384 GPUs (8 per node, TP 8 in a node; PP 1 and PP 16 x DP 128 as Llama 3
   405B), failures at Llama 3's and Meta RSC-1's rates, repair 4 h: every system, including MeCeFO's
   neighbour rule against spreading the lost micro-batches (the runtime's cover planner, at its
   default target and at covering budgets 1.05 and 1.0) and the sharded optimizer,
   MeCeFO at both measured covering ratios (`@setup_a`: the small setup's 1.21x), and the covering
   ratio below which MeCeFO beats each other system (`break_even_cover_ratio`).
3. `no_neighbour`: 32 replicas at rising failure rates: where the ring runs out of neighbours and
   MeCeFO falls back to a checkpoint restart.
4. `failslow`: the same two layouts under fail-slow episodes (megatron_mecefo/sim/failslow.py:
   FALCON's durations, a rate calibrated to FALCON's 1.34x delay at 1,024 GPUs, assumed severities),
   the job's throughput with and without rebalancing (threshold 1.2, window 5); writes also
   simulate_paper_failslow.png.

    python benchmarks/simulate_paper.py                   # ~4 min; writes benchmarks/results/simulate_paper.{json,png}
    python benchmarks/simulate_paper.py --only failslow   # redo section 4 alone, keeping the rest of the JSON
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import statistics
from pathlib import Path

from megatron_mecefo.elastic.plan.topology import Grid
from megatron_mecefo.sim import failslow as fs, presets, trace as tr
from megatron_mecefo.sim.baselines import Reconfigure
from megatron_mecefo.sim.engine import simulate
from megatron_mecefo.sim.run import SYSTEMS, Setup, measured_costs, recovery_at, run_all

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MODELS = ("350M", "1B", "7B")


def implied_ratio(drop: float, p0: float) -> float:
    """The covering ratio c with 1 - 1 / (p0 + (1 - p0) c) = drop."""
    return (1 / (1 - drop) - p0) / (1 - p0)


def bamboo_reconfig_to_match(setup: Setup, traces, target: float) -> float:
    """Bisect Bamboo's re-rendezvous time so the model's mean drop equals `target` (None: not reachable)."""
    horizon = setup.hours * tr.HOUR

    def drop(reconfig_s: float) -> float:
        return statistics.mean(1 - simulate(Reconfigure(setup.domains, reconfig_s, setup.step_s,
                                                        min_domains=presets.BAMBOO_PIPELINE_STAGES,
                                                        pipeline_stages=presets.BAMBOO_PIPELINE_STAGES),
                                            t, horizon).ettr for t in traces)
    lo, hi = 0.0, 1000.0
    if drop(lo) > target:
        return None
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if drop(mid) < target else (lo, mid)
    return (lo + hi) / 2


def paper_table(args, costs):
    ratios = {"measured_llama1b_layer_cpu": max(costs["ratio_1b"], 1.0), "measured_small_setup_a_cpu": costs["ratio_a"]}
    rows = {}
    for model in MODELS:
        base = dict(gpus=32, mtbf_hours=0.5, repair_hours=2.0, hours=args.hours, model=model,
                    recovery_s=recovery_at(32, costs["measured"]))
        setup = Setup(cover_time_ratio=ratios["measured_llama1b_layer_cpu"], **base)
        res = run_all(setup, ["mecefo", "bamboo", "oobleck"], seeds=args.seeds)["systems"]
        res_a = run_all(Setup(cover_time_ratio=ratios["measured_small_setup_a_cpu"], **base), ["mecefo"], seeds=args.seeds)
        traces = [setup.trace(seed) for seed in range(args.seeds)]
        p0 = statistics.mean(tr.concurrency(t, setup.hours * tr.HOUR)[1] for t in traces)
        rows[model] = {
            "mecefo_drop_at_llama1b_ratio": res["mecefo"]["throughput_drop"],
            "mecefo_drop_at_setup_a_ratio": res_a["systems"]["mecefo"]["throughput_drop"],
            "mecefo_approx_fraction": res["mecefo"]["approx_fraction"],
            "bamboo_drop": res["bamboo"]["throughput_drop"], "oobleck_drop": res["oobleck"]["throughput_drop"],
            "ci95": {k: res[k]["throughput_drop_ci95"] for k in res},
            "paper": {"mecefo": presets.PAPER_DROP[model], "bamboo": presets.PAPER_BAMBOO_DROP[model],
                      "oobleck": presets.PAPER_OOBLECK_DROP[model]},
            "share_of_time_nothing_down": p0,
            "cover_ratio_the_papers_drop_implies": implied_ratio(presets.PAPER_DROP[model], p0),
            "bamboo_reconfig_s_used": presets.BAMBOO_RECONFIG_S[model],
            "bamboo_reconfig_s_to_match_paper": bamboo_reconfig_to_match(setup, traces[:5], presets.PAPER_BAMBOO_DROP[model]),
            "oobleck_reconfig_s_used": presets.OOBLECK_RECONFIG_S[model],
        }
    # every system on the same traces (1B constants), both measured covering ratios
    base = dict(gpus=32, mtbf_hours=0.5, repair_hours=2.0, hours=args.hours, model="1B",
                recovery_s=recovery_at(32, costs["measured"]))
    everyone = [n for n in SYSTEMS if n != "recycle"]  # ReCycle needs pipelines
    res = run_all(Setup(cover_time_ratio=ratios["measured_llama1b_layer_cpu"], **base), everyone, seeds=args.seeds)["systems"]
    res_a = run_all(Setup(cover_time_ratio=ratios["measured_small_setup_a_cpu"], **base), SPREAD, seeds=args.seeds)["systems"]
    res.update({f"{k}@setup_a": v for k, v in res_a.items()})
    all_1b = {k: {m: v[m] for m in ("throughput_drop", "throughput_drop_ci95", "ettr", "approx_fraction", "dropped_fraction",
                                    "fatal_events", "breakdown")} for k, v in res.items()}
    return {"scenario": "high: 32 GPUs (1 per failure domain), a failure every 0.5 h, repair 2 h",
            "cover_time_ratios": ratios, "models": rows, "all_systems_1b": all_1b,
            "break_even_cover_ratio_1b": break_even(res, ratios["measured_small_setup_a_cpu"])}


SPREAD = ["mecefo", "mecefo_spread", "mecefo_spread_budget1.05", "mecefo_spread_budget1"]
SCALE_SYSTEMS = [*SPREAD, *(f"{s}@setup_a" for s in SPREAD), "mecefo_sharded", "checkpoint_restart", "inmemory_checkpoint",
                 "nvrx_local_checkpoint", "replicated_optimizer_spares", "torchft", "recover", "oobleck"]


def scale(args, costs):
    out = {}
    layouts = {"1024_gpus_tp8_dp128": dict(gpus=1024, tp=8, pp=1),
               "16384_gpus_tp8_pp16_dp128": dict(gpus=16_384, tp=8, pp=16)}
    rates = {"llama3": presets.LLAMA3_PER_1000_NODE_DAYS, "meta_rsc1": presets.META_RSC1_PER_1000_NODE_DAYS}
    for lname, layout in layouts.items():
        for rname, rate in rates.items():
            systems = [s for s in SCALE_SYSTEMS if "@" not in s] + (["recycle"] if layout["pp"] > 1 else [])
            common = dict(**layout, gpus_per_node=8, failures_per_1000_node_days=rate, repair_hours=4.0,
                          hours=args.hours, model="7B", recovery_s=recovery_at(layout["gpus"], costs["measured"]))
            setup = Setup(cover_time_ratio=max(costs["ratio_1b"], 1.0), **common)
            res = run_all(setup, systems, seeds=args.seeds)
            # the same traces with the covering ratio of the small setup A
            res_a = run_all(Setup(cover_time_ratio=costs["ratio_a"], **common), SPREAD, seeds=args.seeds)
            res["systems"].update({f"{k}@setup_a": v for k, v in res_a["systems"].items()})
            out[f"{lname}/{rname}"] = {
                "failures_per_run": res["setup"]["failures_per_run"], "spares": setup.spares,
                "break_even_cover_ratio": break_even(res["systems"], costs["ratio_a"]),
                "systems": {k: {m: v[m] for m in ("throughput_drop", "throughput_drop_ci95", "ettr", "approx_fraction",
                                                  "dropped_fraction", "fatal_events", "shard_losses", "breakdown") if m in v}
                            for k, v in res["systems"].items()}}
    return out


def break_even(systems, ratio_a):
    """The covering ratio below which MeCeFO's drop stays under each other system's. MeCeFO's drop is
    its events (the run at c = 1) plus the degraded share of the time x (1 - 1/c); that share comes
    from the run at `ratio_a`. None: not even a free covering step beats it."""
    events = systems["mecefo"]["throughput_drop"]
    degraded = (systems["mecefo@setup_a"]["throughput_drop"] - events) / (1 - 1 / ratio_a)
    out = {}
    for name, r in systems.items():
        if name.startswith("mecefo"):
            continue
        margin = (r["throughput_drop"] - events) / degraded
        out[name] = 1 / (1 - margin) if 0 < margin < 1 else (None if margin <= 0 else float("inf"))
    return out


def no_neighbour(args, costs):
    rows = []
    for mtbf in (0.5, 0.25, 0.125, 0.0625):
        setup = Setup(gpus=32, mtbf_hours=mtbf, repair_hours=2.0, hours=args.hours,
                      cover_time_ratio=costs["ratio_a"], recovery_s=recovery_at(32, costs["measured"]))
        r = run_all(setup, ["mecefo", "mecefo_spread", "recover"], seeds=args.seeds)["systems"]
        rows.append({"mtbf_hours": mtbf, "mean_domains_down": 2.0 / mtbf,
                     **{f"{k}_drop": v["throughput_drop"] for k, v in r.items()},
                     "mecefo_fallbacks_per_run": r["mecefo"]["fatal_events"]})
    return {"gpus": 32, "repair_hours": 2.0, "cover_time_ratio": costs["ratio_a"], "rows": rows}


def timeline(args, costs):
    setup = Setup(gpus=32, mtbf_hours=0.5, repair_hours=2.0, hours=24, cover_time_ratio=costs["ratio_a"],
                  recovery_s=recovery_at(32, costs["measured"]))
    trace = setup.trace(0)
    out = {}
    for name in ("mecefo", "recover", "torchft", "oobleck", "bamboo"):
        run, _, _ = SYSTEMS[name](setup)
        out[name] = run(trace, 24 * tr.HOUR, timeline=True).timeline
    return out


FAILSLOW_LAYOUTS = {"1024_gpus_tp8_dp128": Grid(tp=8, pp=1, dp=128), "16384_gpus_tp8_pp16_dp128": Grid(tp=8, pp=16, dp=128)}


def failslow(args):
    """Throughput under fail-slows with and without rebalancing. The rate is calibrated once per
    job-wide share at 1,024 GPUs and applied per GPU at 16,384 (16x the episodes). At the same rate
    per job, 16,384 GPUs in 128 replicas of 8 micro-batches is the 1,024-GPU job: the model sees
    replicas, not GPUs."""
    ref, policy, out = FAILSLOW_LAYOUTS["1024_gpus_tp8_dp128"], fs.Rebalance(threshold=1.2, window=5), {}
    seeds = max(1, min(args.seeds, 5))
    for share in (0.5, 0.0):
        model = fs.calibrate(ref, args.hours, seeds, job_wide_share=share)
        for name, grid in FAILSLOW_LAYOUTS.items():
            m = model
            gpus = grid.tp * grid.pp * grid.dp
            rows = []
            for seed in range(seeds):
                trace = m.trace(gpus, args.hours, seed)
                rows.append((len(trace), fs.run(trace, grid, args.hours), fs.run(trace, grid, args.hours, policy=policy)))
            without = statistics.mean(r[1]["slowdown"] for r in rows)
            with_ = statistics.mean(r[2]["slowdown"] for r in rows)
            out[f"{name}/job_wide_share_{share}"] = {
                "per_gpu_per_hour": m.per_gpu_per_hour, "episodes_per_run": statistics.mean(r[0] for r in rows),
                "slow_time_share": statistics.mean(r[1]["slow_time_share"] for r in rows),
                "slowdown_without": without, "slowdown_with": with_,
                "throughput_without": statistics.mean(r[1]["throughput"] for r in rows),
                "throughput_with": statistics.mean(r[2]["throughput"] for r in rows),
                "slowdown_removed": (without - with_) / (without - 1) if without > 1 else 0.0,
                "replans_per_day": statistics.mean(r[2]["replans"] for r in rows) / (args.hours / 24)}
    return {"model": {"duration_s": list(fs.FailSlowModel(1.0).duration_s), "severity": list(fs.FailSlowModel(1.0).severity),
                      "calibrated_to": f"unmitigated slowdown {fs.FALCON_JCT_DELAY} at 1,024 GPUs (FALCON's average JCT delay)",
                      "rebalance": dataclasses.asdict(policy), "micro_batches": 8, "step_s": 10.0, "seeds": seeds,
                      "sources": "durations and the 1.34x delay: FALCON / Greyhound (arXiv 2410.12588, USENIX ATC '25); "
                                 "severity and job-wide share: assumed (not reachable); docs/results.md"},
            "runs": out}


def plot_failslow(section, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    keys = list(section["runs"])
    xs = range(len(keys))
    for off, key, label in ((-0.2, "throughput_without", "without rebalancing"), (0.2, "throughput_with", "with rebalancing")):
        ys = [section["runs"][k][key] for k in keys]
        ax.bar([x + off for x in xs], ys, 0.4, label=label)
        for x, y in zip(xs, ys):
            ax.annotate(f"{y:.2f}", (x + off, y), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(list(xs), [k.replace("_gpus", " GPUs").replace("/", "\n") for k in keys], fontsize=6)
    ax.set_ylabel("throughput (1 = no fail-slow)")
    ax.set_title("fail-slows: FALCON durations, rate calibrated to 1.34x at 1,024 GPUs, severity 1.1-3x (assumed)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot(result, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(14, 9))
    ax = axes[0][0]
    rows = result["paper_table"]["models"]
    x = range(len(MODELS))
    bars = [("MeCeFO (ours, 1B-layer ratio)", [rows[m]["mecefo_drop_at_llama1b_ratio"] for m in MODELS], "tab:blue", ""),
            ("MeCeFO (ours, setup-A ratio)", [rows[m]["mecefo_drop_at_setup_a_ratio"] for m in MODELS], "tab:blue", "//"),
            ("MeCeFO (paper)", [rows[m]["paper"]["mecefo"] for m in MODELS], "lightblue", ""),
            ("Oobleck (model)", [rows[m]["oobleck_drop"] for m in MODELS], "tab:orange", ""),
            ("Oobleck (paper)", [rows[m]["paper"]["oobleck"] for m in MODELS], "moccasin", ""),
            ("Bamboo (model)", [rows[m]["bamboo_drop"] for m in MODELS], "tab:green", ""),
            ("Bamboo (paper)", [rows[m]["paper"]["bamboo"] for m in MODELS], "lightgreen", "")]
    w = 0.8 / len(bars)
    for i, (label, ys, color, hatch) in enumerate(bars):
        ax.bar([j + i * w for j in x], [100 * y for y in ys], w, label=label, color=color, hatch=hatch, edgecolor="k", lw=0.3)
        for j, y in zip(x, ys):
            ax.annotate(f"{100 * y:.1f}", (j + i * w, 100 * y), ha="center", va="bottom", fontsize=6)
    ax.set_xticks([j + 0.4 - w / 2 for j in x], MODELS)
    ax.set_ylabel("throughput drop (%)")
    ax.set_title("paper's high scenario, 32 GPUs: model vs paper")
    ax.legend(fontsize=7)

    ax = axes[0][1]
    keys = list(result["scale"])
    systems = SCALE_SYSTEMS + ["recycle"]
    w = 0.8 / len(keys)
    for i, k in enumerate(keys):
        ys = [100 * result["scale"][k]["systems"].get(s, {}).get("throughput_drop", float("nan")) for s in systems]
        ax.bar([j + i * w for j in range(len(systems))], ys, w, label=k)
    ax.set_xticks([j + 0.4 - w / 2 for j in range(len(systems))], systems, rotation=45, ha="right", fontsize=7)
    ax.set_ylabel("throughput drop (%)")
    ax.set_yscale("symlog", linthresh=1)
    ax.set_title("at scale (8 GPUs per node, repair 4 h, 7B constants)")
    ax.legend(fontsize=7)

    ax = axes[1][0]
    rows = result["no_neighbour"]["rows"]
    xs = [r["mean_domains_down"] for r in rows]
    for key, label in (("mecefo_drop", "MeCeFO (neighbour)"), ("mecefo_spread_drop", "MeCeFO spread (cover planner)"),
                       ("recover_drop", "ReCoVer (exact spread)")):
        ax.plot(xs, [100 * r[key] for r in rows], "o-", label=label)
    for r in rows:
        ax.annotate(f"{r['mecefo_fallbacks_per_run']:.0f} fallbacks", (r["mean_domains_down"], 100 * r["mecefo_drop"]), fontsize=7)
    ax.set_xlabel("mean GPUs down of 32 (lambda R)")
    ax.set_ylabel("throughput drop (%)")
    ax.set_title("running out of neighbours (32 replicas, repair 2 h)")
    ax.legend(fontsize=7)

    ax = axes[1][1]
    styles = {"mecefo": "-", "recover": "-", "torchft": "--", "oobleck": ":", "bamboo": "-."}
    for name, marks in result["timeline"].items():
        ts = [0.0] + [m["t"] / tr.HOUR for m in marks]
        ys = [1.0] + [m["speed"] for m in marks]
        ax.step(ts, ys, where="post", label=name, lw=1.2, ls=styles.get(name, "-"))
    down = result["timeline"]["mecefo"]
    ax2 = ax.twinx()
    ax2.fill_between([0.0] + [m["t"] / tr.HOUR for m in down], [0] + [m["down"] for m in down], step="post",
                     color="gray", alpha=0.15, lw=0)
    ax2.set_ylabel("GPUs down (shaded)")
    ax.set_xlabel("hours")
    ax.set_ylabel("useful throughput (1 = failure-free)")
    ax.set_title("one day of the high scenario (seed 0)")
    ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def print_failslow(section) -> None:
    for k, r in section["runs"].items():
        print(f"{k}: slowdown {r['slowdown_without']:.3f} -> {r['slowdown_with']:.3f} ({100 * r['slowdown_removed']:.0f} % removed), "
              f"{r['replans_per_day']:.1f} re-plans/day, {r['episodes_per_run']:.0f} episodes")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--hours", type=float, default=720.0)
    ap.add_argument("--out", type=Path, default=RESULTS / "simulate_paper.json")
    ap.add_argument("--replot", action="store_true", help="only redraw the PNG from the JSON")
    ap.add_argument("--only", choices=["failslow"], help="redo this section alone, keeping the rest of --out")
    args = ap.parse_args()
    failslow_png = args.out.with_name(args.out.stem + "_failslow.png")
    if args.replot:
        result = json.loads(args.out.read_text())
        plot(result, args.out.with_suffix(".png"))
        plot_failslow(result["failslow"], failslow_png)
        return
    if args.only == "failslow":
        result = json.loads(args.out.read_text())
        result["failslow"] = {"date": datetime.date.today().isoformat(),
                              "command": "python benchmarks/simulate_paper.py --only failslow", **failslow(args)}
        args.out.write_text(json.dumps(result, indent=1))
        plot_failslow(result["failslow"], failslow_png)
        print_failslow(result["failslow"])
        return
    measured = measured_costs()
    cc = json.loads((RESULTS / "covering_cost.json").read_text())
    costs = {"ratio_1b": measured["cover_time_ratio"], "ratio_a": cc["time_ratio_covering_vs_normal_paper"],
             "recovery_s": measured["recovery_s"], "measured": measured,
             "recovery_s_at": {n: recovery_at(n, measured) for n in (32, 1024, 16_384)}}
    result = {
        "date": datetime.date.today().isoformat(),
        "command": "python benchmarks/simulate_paper.py",
        "seeds": args.seeds, "hours": args.hours,
        "measured_costs": {**costs, "source": "benchmarks/results/covering_cost.json (time_ratio_covering_vs_normal_paper_1b: "
                           "LLaMA-1B layer size, CPU fp32; time_ratio_covering_vs_normal_paper: setup A, small model, CPU), "
                           "recovery.json (crash_to_degraded_step_s, CPU loopback, a few ranks) plus, at N ranks, the "
                           "agreement's store calls per rank beyond those at the store's measured rate "
                           "(control_plane.json; megatron_mecefo.sim.run.recovery_at)"},
        "paper_table": paper_table(args, costs),
        "scale": scale(args, costs),
        "no_neighbour": no_neighbour(args, costs),
        "timeline": timeline(args, costs),
        "failslow": failslow(args),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    plot(result, args.out.with_suffix(".png"))
    plot_failslow(result["failslow"], failslow_png)
    print_failslow(result["failslow"])
    for m, r in result["paper_table"]["models"].items():
        print(f"{m:5s} mecefo {100 * r['mecefo_drop_at_llama1b_ratio']:.2f} % (setup A {100 * r['mecefo_drop_at_setup_a_ratio']:.2f} %, "
              f"paper {100 * r['paper']['mecefo']:.2f} %, implied c {r['cover_ratio_the_papers_drop_implies']:.3f})  "
              f"oobleck {100 * r['oobleck_drop']:.2f} % (paper {100 * r['paper']['oobleck']:.2f})  "
              f"bamboo {100 * r['bamboo_drop']:.2f} % (paper {100 * r['paper']['bamboo']:.2f}; "
              f"reconfig to match {r['bamboo_reconfig_s_to_match_paper']})")
    for k, v in result["scale"].items():
        print(k, {s: round(100 * x["throughput_drop"], 2) for s, x in v["systems"].items()})
        print("   break-even c:", {s: (round(c, 4) if c else c) for s, c in v["break_even_cover_ratio"].items()})
    for r in result["no_neighbour"]["rows"]:
        print(r)


if __name__ == "__main__":
    main()
