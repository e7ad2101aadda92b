"""The covering step under the paper's rule and under "spread", measured side by side.

When replicas fail, every live replica waits at the reduction for the slowest one, so a step takes
as long as its slowest replica's micro-batches. For each model, D (replicas), k (micro-batches per
replica) and number of failed replicas, this builds the plans of elastic/plan/cover_plan.py:

  neighbour      the paper's rule: the failed replica's ring neighbour runs its own k and the
                 failed one's k, all approximated
  spread         the lost micro-batches dealt over the survivors, as few approximated as keep the
                 slowest replica within the paper's time (the default target)
  spread@B       the same within covering_budget B (1.05, and 1.0: no slowdown)

with the costs every rank would agree on once measured (costs.CostMeter: a covering micro-batch's
time over an exact one's, from healthy steps and the paper's covering steps at k = 4, measured first
in this run, medians, round-robin). Then the slowest replica's micro-batch
list runs for real in one process (forward and backward of each in its mode, gradients accumulated,
as a host runs it), timed round-robin beside a healthy replica's k exact micro-batches:
slowest_ratio = median(slowest) / median(healthy). The planner's prediction (predicted_ratio) is
its time model with the measured costs. A list is run once per composition (how many exact and
covering micro-batches) and shared by the rows that have it.

    python benchmarks/covering_spread.py --model A        # setup A (covering_cost.py's size), ~10 min
    python benchmarks/covering_spread.py --model 1b --dp 8 --k 1 2 4 --repeats 3   # LLaMA-1B layer size, ~10 min
    python benchmarks/covering_spread.py --model A --quick

Writes benchmarks/results/covering_spread.json (a run replaces the rows it measures and keeps the
others; each row says the covering/exact ratio it was planned with) and covering_spread.png.

    python benchmarks/covering_spread.py --model 1b --dp 8 --k 4 --failures 1 --budgets 1.06 1.08   # more budgets
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from covering_cost import loss_of, setup, sync  # noqa: E402

from megatron_mecefo import MeCeFOConfig, covering  # noqa: E402
from megatron_mecefo.elastic.plan.costs import CostMeter, agreed_costs  # noqa: E402
from megatron_mecefo.elastic.plan.cover_plan import plan_cover  # noqa: E402
from megatron_mecefo.elastic.plan.topology import Grid, ring_cover  # noqa: E402

MODELS = {
    # covering_cost.py's default size (setup A of docs/results.md)
    "A": dict(hidden=512, ffn=None, heads=8, layers=4, seq=256, micro_batch=4),
    # LLaMA-1B's layer (hidden 2048, SwiGLU 5504, 16 heads) at seq 1024 as covering_cost.py's 1B run,
    # one layer instead of two to fit a 2-core CPU
    "1b": dict(hidden=2048, ffn=5504, heads=16, layers=1, seq=1024, micro_batch=1),
}
BUDGETS = (1.05, 1.0)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="A")
    p.add_argument("--dp", type=int, nargs="+", default=[4, 8])
    p.add_argument("--k", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--failures", type=int, nargs="+", default=[1, 2])
    p.add_argument("--budgets", type=float, nargs="+", default=list(BUDGETS), help='"spread" rows at these budgets')
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--cost-repeats", type=int, default=5, help="round-robin runs of a healthy and a covering step (k = 4)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--quick", action="store_true", help="a small model, D = 8 and k = 4 only, 3 repeats")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "covering_spread.json")
    args = p.parse_args(argv)
    for key, value in MODELS[args.model].items():
        setattr(args, key, value)
    args.vocab, args.dtype, args.tau = 1024, "fp32", 200
    args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.quick:
        args.hidden, args.ffn, args.heads, args.layers, args.seq, args.micro_batch = 256, None, 4, 2, 128, 2
        args.dp, args.k, args.repeats, args.cost_repeats = [8], [4], 3, 3
        args.rank = 32
        if args.out == p.get_default("out"):
            args.out = ROOT / "benchmarks" / "results" / "covering_spread_quick.json"
    return args


def failed_replicas(dp: int, failures: int) -> list:
    """Failed replicas as far apart as the ring allows (each keeps a live neighbour)."""
    return [1 + i * (dp // failures) for i in range(failures)]


def main(argv=None):
    args = parse_args(argv)
    model, _, a, b, _ = setup(args)
    policy = MeCeFOConfig(enable=True, rank=args.rank, tau=args.tau).cover_policy(0, live_microbatches=1)
    batches = [a, b]

    def run(n_exact: int, n_covering: int) -> float:
        """A replica's step: its exact micro-batches, then its covering ones; seconds."""
        model.zero_grad(set_to_none=True)
        sync(args.device)
        t0 = time.perf_counter()
        for i in range(n_exact + n_covering):
            with covering(model, policy if i >= n_exact else None):
                loss = loss_of(model, batches[i % 2], args.micro_batch)
            loss.backward()
            del loss
        sync(args.device)
        return time.perf_counter() - t0

    run(1, 1)  # warm-up; the first covering micro-batch computes the projection bases
    # the costs as the runtime measures them (costs.CostMeter): healthy steps of k exact micro-batches
    # and the paper's covering steps of 2k covering ones, k = 4
    meter = CostMeter(window=args.cost_repeats)
    for _ in range(args.cost_repeats):
        meter.observe(4, 0, run(4, 0))
        meter.observe(0, 8, run(0, 8))
    e, c = meter.exact_cost(), meter.covering_cost()
    costs = agreed_costs({0: meter.info()})
    print(f"[{args.model}] exact micro-batch {e * 1e3:.0f} ms, covering {c * 1e3:.0f} ms: ratio {c / e:.3f}", flush=True)

    plans = []
    for dp in args.dp:
        for k in args.k:
            for failures in args.failures:
                failed = failed_replicas(dp, failures)
                cover = ring_cover(Grid(dp=dp), [r for r in range(dp) if r not in failed])
                for name, budget in (("neighbour", None), ("spread", None), *(("spread", b) for b in args.budgets)):
                    plan = plan_cover(cover, k, costs, policy=name, target=None if budget is None else budget * k)
                    slowest = max(plan.predicted, key=lambda r: (plan.predicted[r], r))
                    mbs = plan.fold.assignments[slowest]
                    n_cov = sum(m.covering for m in mbs)
                    plans.append(dict(policy=name, budget=budget, D=dp, k=k, failures=failures, model=args.model,
                                      covering_over_exact_planned=costs.covering,
                                      composition=(len(mbs) - n_cov, n_cov),
                                      predicted_ratio=plan.slowest / k, approximated=plan.approximated,
                                      adopting_replicas=len({r for rs in plan.runners().values() for r in rs}),
                                      counts=dict(Counter(len(m) for m in plan.fold.assignments.values()))))
    compositions = sorted({p["composition"] for p in plans} | {(k, 0) for k in args.k}, key=sum)
    print(f"[{args.model}] {len(plans)} plans, {len(compositions)} distinct replica steps to time", flush=True)
    times = {comp: [] for comp in compositions}
    for rep in range(args.repeats):  # round-robin so drift hits every composition alike
        for comp in compositions:
            times[comp].append(run(*comp))
        print(f"  repeat {rep + 1}/{args.repeats} done", flush=True)
    median = {comp: statistics.median(ts) for comp, ts in times.items()}
    rows = []
    for p in plans:
        comp, k = p.pop("composition"), p["k"]
        healthy = median[(k, 0)]
        p["counts"] = {str(n): v for n, v in sorted(p["counts"].items())}
        rows.append({**p, "slowest": {"exact": comp[0], "covering": comp[1]},
                     "slowest_ratio": median[comp] / healthy,
                     "slowest_ratio_spread": [t / healthy for t in sorted(times[comp])],
                     "predicted_ratio": p["predicted_ratio"]})
    out = json.loads(args.out.read_text()) if args.out.exists() else {}
    described = (f"LLaMA-style GPT (Megatron-Core, MeCeFO spec): {args.layers} layers, hidden {args.hidden}, "
                 f"ffn {args.ffn or 'default'} (SwiGLU), {args.heads} heads, seq {args.seq}, micro-batch {args.micro_batch}")
    if out.get("setup", {}).get(args.model, {}).get("model") != described:  # another model under the name
        out["rows"] = [r for r in out.get("rows", []) if r["model"] != args.model]
    out.setdefault("setup", {})[args.model] = dict(
        model=described,
        device=args.device, threads=args.threads, repeats=args.repeats, torch=torch.__version__,
        machine=platform.machine(), date=time.strftime("%Y-%m-%d"),
        exact_micro_batch_s=e, covering_micro_batch_s=c, covering_over_exact=c / e,
        costs_planned_with=dict(exact=costs.exact, covering=costs.covering),
        command=f"python benchmarks/covering_spread.py --model {args.model}" + (" --quick" if args.quick else ""))
    key = lambda r: (r["model"], r["D"], r["k"], r["failures"], r["policy"], r["budget"])  # noqa: E731
    new = {key(r) for r in rows}
    out["rows"] = sorted([r for r in out.get("rows", []) if key(r) not in new] + rows,
                         key=lambda r: (r["model"], r["D"], r["k"], r["failures"], r["policy"], -(r["budget"] or 9)))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print_table(rows)
    plot(out, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return out


def label(row) -> str:
    return row["policy"] if row["budget"] is None else f"{row['policy']}@{row['budget']:g}"


def print_table(rows) -> None:
    print(f"{'model':5s} {'D':>2s} {'k':>2s} {'f':>2s} {'policy':12s} {'slowest':>8s} {'predicted':>9s} {'approx':>6s}")
    for r in rows:
        print(f"{r['model']:5s} {r['D']:2d} {r['k']:2d} {r['failures']:2d} {label(r):12s} {r['slowest_ratio']:8.3f} "
              f"{r['predicted_ratio']:9.3f} {r['approximated']:6d}")


def plot(out, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in out["rows"]})
    fig, axes = plt.subplots(len(models), 1, figsize=(13, 3.6 * len(models)), squeeze=False)
    names = sorted({label(r) for r in out["rows"]}, key=lambda n: (n != "neighbour", n != "spread", n))
    for ax, m in zip(axes[:, 0], models):
        rows = [r for r in out["rows"] if r["model"] == m]
        groups = sorted({(r["D"], r["k"], r["failures"]) for r in rows})
        width = 0.8 / len(names)
        for i, name in enumerate(names):
            ys = [next((r["slowest_ratio"] for r in rows if (r["D"], r["k"], r["failures"]) == g and label(r) == name),
                       float("nan")) for g in groups]
            ax.bar([j + (i - (len(names) - 1) / 2) * width for j in range(len(groups))], ys, width, label=name)
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xticks(range(len(groups)), [f"D={d} k={k}\n{f} failed" for d, k, f in groups], fontsize=7)
        ax.set_ylabel("slowest replica / healthy step")
        ax.set_title(f"model {m}: {out['setup'][m]['model']}; covering / exact micro-batch "
                     f"{out['setup'][m]['covering_over_exact']:.2f}", fontsize=9)
        ax.legend(fontsize=7, ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
