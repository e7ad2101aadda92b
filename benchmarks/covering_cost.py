"""What a covering rank costs: normal rank vs naive neighbor-does-both vs MeCeFO, with the ablation.

A Megatron-Core LLaMA-style GPT (RMSNorm, SwiGLU, rotary, MeCeFO layer spec) in one process, on
CPU unless CUDA is present. For the same data, side by side in one run:

  normal     a healthy rank: its own micro-batch A, exact backward
  naive      neighbor-does-both without MeCeFO: A and the adopted micro-batch B as ONE doubled
             batch, exact (the most activation memory; how a fixed pipeline schedule would run it)
  covering   the MeCeFO covering rank: A then B one after the other (gradient accumulation, as the
             runtime processes them), each in covering mode; every subset of the three techniques
             (skip attention backward, FFN recompute, low-rank FFN weight gradient)

Measured per configuration: median forward+backward time (optimizer step excluded: it is the same
for all), peak bytes saved for backward (saved-tensor hooks, parameters excluded; on CUDA also
`torch.cuda.max_memory_allocated`, whole and above what the case started with), and the relative
error of the non-attention gradients ||g - g_exact|| / ||g_exact|| against exact A+B. Plus the
low-rank weight-gradient kernel alone vs the exact one on the FFN matrices, and the SVD refresh.

    python benchmarks/covering_cost.py                 # full size (~5 min on 2 cores)
    python benchmarks/covering_cost.py --quick         # small model, ~30 s
    python benchmarks/covering_cost.py --device cuda --dtype bf16 --hidden 2048 --ffn 5504 \
        --heads 16 --layers 4 --seq 2048 --micro-batch 1      # LLaMA-1B layer size on a GPU

Writes benchmarks/results/covering_cost.json and covering_cost.png (or --out).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import platform
import statistics
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
# megatron-core's import-time notices about optional CUDA extensions (apex, Transformer Engine)
warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*not installed", category=UserWarning)
warnings.filterwarnings("ignore", category=DeprecationWarning)
warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", message="full scope is deprecated", category=UserWarning)

from megatron_mecefo import MeCeFOConfig, covering  # noqa: E402
from megatron_mecefo.approx import CoverPolicy  # noqa: E402
from megatron_mecefo.approx.memory import SavedTensorMeter  # noqa: E402
from megatron_mecefo.params import GradGroup, grad_group  # noqa: E402

TECHNIQUES = ("skip", "recompute", "lowrank")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--ffn", type=int, default=None, help="FFN size (default: LLaMA 8/3 x hidden, multiple of 64)")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--tau", type=int, default=200)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--quick", action="store_true", help="small model and 3 repeats (smoke run)")
    p.add_argument("--also-into", type=Path, default=None, metavar="JSON",
                   help="also record this run's time ratios in JSON (an earlier run's results) with the suffix _1b: "
                        "how the LLaMA-1B layer-size run lands beside the default size's")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "covering_cost.json")
    args = p.parse_args(argv)
    if args.quick:
        args.hidden, args.heads, args.layers, args.seq, args.micro_batch, args.repeats = 256, 4, 2, 128, 4, 3
        args.rank = min(args.rank, 32)
        if args.out == p.get_default("out"):
            args.out = ROOT / "benchmarks" / "results" / "covering_cost_quick.json"
    return args


def setup(args):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    torch.set_num_threads(args.threads)
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    from megatron_mecefo.layers.model import build_gpt, init_model_parallel, llama_config

    init_model_parallel(1, 1, seed=0)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    config = llama_config(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        ffn_hidden_size=args.ffn, dtype=dtype,
    )
    model = build_gpt(config, vocab_size=args.vocab, seq_length=args.seq, seed=0).to(args.device)
    g = torch.Generator().manual_seed(0)

    def batch(n):
        tokens = torch.randint(0, args.vocab, (n, args.seq), generator=g).to(args.device)
        labels = torch.randint(0, args.vocab, (n, args.seq), generator=g).to(args.device)
        pos = torch.arange(args.seq, device=args.device).expand(n, args.seq)
        return tokens, pos, labels

    a, b = batch(args.micro_batch), batch(args.micro_batch)
    ab = tuple(torch.cat([x, y]) for x, y in zip(a, b))
    return model, config, a, b, ab


def loss_of(model, batch, micro_batch):
    """Mean token loss of a micro-batch; a merged batch of k micro-batches counts k times, so every
    case accumulates the gradient of the same objective (the sum over micro-batches)."""
    tokens, pos, labels = batch
    return model(tokens, pos, None, labels=labels).float().mean() * (tokens.shape[0] / micro_batch)


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def policy_for(name: str, args, step: int = 0):
    """CoverPolicy of an ablation entry ('exact' = None)."""
    if name == "exact":
        return None
    on = set(name.split("+"))
    return CoverPolicy(
        step=step, skip_attention="skip" in on, recompute_ffn="recompute" in on, lowrank_ffn="lowrank" in on,
        rank=args.rank, tau=args.tau,
    )


def run_case(model, case, micro_batch, meter_exclude=None):
    """case: list of (batch, policy). Forward+backward each in turn; returns peak saved bytes."""
    model.zero_grad(set_to_none=True)
    peak = 0
    for batch, policy in case:
        meter = SavedTensorMeter(meter_exclude or ())
        with covering(model, policy), meter:
            loss = loss_of(model, batch, micro_batch)
        peak = max(peak, meter.total)
        loss.backward()
        del loss
    return peak


def flat_grads(model, group=GradGroup.DEFAULT):
    parts = []
    for p in model.parameters():
        if grad_group(p) is group:
            parts.append((p.grad if p.grad is not None else torch.zeros_like(p)).float().flatten())
    return torch.cat(parts)


def ffn_grads(model):
    return torch.cat([p.grad.float().flatten() for n, p in model.named_parameters() if ".mlp.linear_fc" in n])


def lowrank_kernel_ratio(model, args, tokens: int):
    """Median time of the low-rank dW (x V in forward + (G_y^T xV) V^T) over the exact G_y^T x."""
    from megatron_mecefo.layers import lowrank_linears
    from megatron_mecefo.approx.projector import top_right_singular_vectors

    rows, exact_total, low_total = [], 0.0, 0.0
    shapes = sorted({tuple(m.weight.shape) for _, m in lowrank_linears(model)})
    for out_f, in_f in shapes:
        w = torch.randn(out_f, in_f, device=args.device, dtype=model.config.params_dtype)
        x = torch.randn(tokens, in_f, device=args.device, dtype=w.dtype)
        gy = torch.randn(tokens, out_f, device=args.device, dtype=w.dtype)
        v = top_right_singular_vectors(w, args.rank)

        def exact():
            return gy.t() @ x

        def low():
            return (gy.t() @ (x @ v)) @ v.t()

        times = {}
        for name, fn in (("exact", exact), ("lowrank", low)):
            for _ in range(3):
                fn()
            samples = []
            for _ in range(25):
                sync(args.device)
                t0 = time.perf_counter()
                fn()
                sync(args.device)
                samples.append(time.perf_counter() - t0)
            times[name] = statistics.median(samples)
        flop_ratio = (tokens * in_f * args.rank + tokens * out_f * args.rank + out_f * in_f * args.rank) / (tokens * out_f * in_f)
        rows.append(dict(weight=[out_f, in_f], tokens=tokens, exact_s=times["exact"], lowrank_s=times["lowrank"],
                         ratio=times["lowrank"] / times["exact"], flop_ratio=flop_ratio))
        exact_total += times["exact"]
        low_total += times["lowrank"]
    return low_total / exact_total, rows


def svd_refresh_time(model, args):
    from megatron_mecefo.layers import lowrank_linears
    from megatron_mecefo.approx import LowRankProjector

    sync(args.device)
    t0 = time.perf_counter()
    for _, m in lowrank_linears(model):
        LowRankProjector(args.rank, args.tau).maybe_refresh(m.weight, 0)
    sync(args.device)
    return time.perf_counter() - t0


def main(argv=None):
    args = parse_args(argv)
    model, config, a, b, ab = setup(args)
    params = list(model.parameters())
    default_cfg = MeCeFOConfig(enable=True, rank=args.rank, tau=args.tau)
    default_policy = default_cfg.cover_policy(0, live_microbatches=1)
    default_name = "+".join(t for t, on in zip(TECHNIQUES, (default_policy.skip_attention, default_policy.recompute_ffn, default_policy.lowrank_ffn)) if on)
    doubled_policy = default_cfg.cover_policy(0, live_microbatches=2)
    activation_policy = dataclasses.replace(default_policy, basis="activation")

    ablation = ["+".join(c) for r in range(1, 4) for c in itertools.combinations(TECHNIQUES, r)]
    cases = {
        "normal": [(a, None)],
        "naive": [(ab, None)],
        "naive_sequential": [(a, None), (b, None)],
        **{name: [(a, policy_for(name, args)), (b, policy_for(name, args))] for name in ablation},
        "default_doubled_batch": [(ab, doubled_policy)],
        # approximate: "adopted": the covering rank's own micro-batch exact, the adopted one approximated
        "default_adopted_only": [(a, None), (b, default_policy)],
        # basis "activation": the low-rank FFN gradient on each micro-batch's own input directions
        "default_activation_basis": [(a, activation_policy), (b, activation_policy)],
        # attention_floor: the own micro-batch keeps its attention backward, the adopted one skips it
        "default_floor_own_attention": [(a, dataclasses.replace(default_policy, skip_attention=False)), (b, default_policy)],
    }

    # exact reference gradients of A+B (sequential accumulation)
    mb = args.micro_batch
    run_case(model, cases["naive_sequential"], mb)
    ref_default, ref_ffn = flat_grads(model), ffn_grads(model)

    results = {}
    for name, case in cases.items():
        if args.device == "cuda":  # the device's own peak, beside the saved-tensor count
            sync(args.device)
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        peak = run_case(model, case, mb, params)  # also the warm-up (first covering call computes the bases)
        err = (torch.linalg.norm(flat_grads(model) - ref_default) / torch.linalg.norm(ref_default)).item()
        err_ffn = (torch.linalg.norm(ffn_grads(model) - ref_ffn) / torch.linalg.norm(ref_ffn)).item()
        if name == "normal":  # one micro-batch: no A+B gradient to compare with
            err = err_ffn = None
        results[name] = dict(saved_bytes=peak, rel_grad_error=err, rel_grad_error_ffn=err_ffn, times=[])
        if args.device == "cuda":  # parameters and the bases held before the case: `base`
            results[name].update(cuda_max_allocated=torch.cuda.max_memory_allocated(),
                                 cuda_peak_over_base=torch.cuda.max_memory_allocated() - base)
        print(f"  prepared {name:28s} saved {peak / 2**20:8.1f} MiB  grad err {_fmt(err)}", flush=True)

    for rep in range(args.repeats):  # round-robin so drift hits every case alike
        for name, case in cases.items():
            sync(args.device)
            t0 = time.perf_counter()
            run_case(model, case, mb)
            sync(args.device)
            results[name]["times"].append(time.perf_counter() - t0)
        print(f"  repeat {rep + 1}/{args.repeats} done", flush=True)

    normal_t = statistics.median(results["normal"]["times"])
    normal_m = results["normal"]["saved_bytes"]
    for name, r in results.items():
        r["median_s"] = statistics.median(r["times"])
        r["time_ratio"] = r["median_s"] / normal_t
        r["mem_ratio"] = r["saved_bytes"] / normal_m
        if "cuda_peak_over_base" in r:
            r["cuda_peak_ratio"] = r["cuda_peak_over_base"] / results["normal"]["cuda_peak_over_base"]

    tokens = args.micro_batch * args.seq
    kernel_ratio, kernel_rows = lowrank_kernel_ratio(model, args, tokens)
    svd_s = svd_refresh_time(model, args)
    paper = "skip+recompute+lowrank"
    out = {
        "setup": dict(
            model=f"LLaMA-style GPT (Megatron-Core, MeCeFO spec): {args.layers} layers, hidden {args.hidden}, "
                  f"ffn {config.ffn_hidden_size} (SwiGLU), {args.heads} heads, seq {args.seq}, vocab {args.vocab}",
            micro_batch=args.micro_batch, rank=args.rank, tau=args.tau, device=args.device, dtype=args.dtype,
            threads=args.threads, repeats=args.repeats, torch=torch.__version__, machine=platform.machine(),
            processing="covering rank runs its own and the adopted micro-batch one after the other "
                       "(gradient accumulation); naive runs them as one doubled batch",
            time="median forward+backward wall time, optimizer step excluded",
            memory="peak bytes saved for backward (saved-tensor hooks), parameters excluded",
        ),
        "default_config": f"{default_name} (MeCeFOConfig defaults: recompute_ffn='auto' -> off when micro-batches run one at a time)",
        "time_ratio_covering_vs_normal": results[default_name]["time_ratio"],
        "mem_ratio_covering_vs_normal": results[default_name]["mem_ratio"],
        "time_ratio_naive_vs_normal": results["naive"]["time_ratio"],
        "mem_ratio_naive_vs_normal": results["naive"]["mem_ratio"],
        "cuda_peak_ratio_covering_vs_normal": results[default_name].get("cuda_peak_ratio"),
        "cuda_peak_ratio_naive_vs_normal": results["naive"].get("cuda_peak_ratio"),
        "lowrank_dw_time_ratio": kernel_ratio,
        "rel_grad_error": results[default_name]["rel_grad_error"],
        "paper_faithful": summary(results, paper, paper),
        "default_doubled_batch": summary(results, "default_doubled_batch", "default with adopted micro-batch merged "
                                         "into one doubled batch: recompute_ffn='auto' -> on"),
        "adopted_only": summary(results, "default_adopted_only", 'default with approximate: "adopted" (own micro-batch '
                                "exact, adopted one approximated)"),
        "activation_basis": summary(results, "default_activation_basis", 'default with basis: "activation" (range '
                                    "finder on each micro-batch's FFN input)"),
        "floor_own_attention": summary(results, "default_floor_own_attention", "default with the own micro-batch's "
                                       "attention backward kept (what attention_floor does to it)"),
        # the names: the paper's rule (the default) and the candidate, side by side in this run
        "time_ratio_covering_vs_normal_paper": results[default_name]["time_ratio"],
        "time_ratio_covering_vs_normal_best": results["default_activation_basis"]["time_ratio"],
        "lowrank_dw_kernel": kernel_rows,
        "svd_refresh_s_all_ffn_weights": svd_s,
        "svd_refresh_amortized_time_ratio": svd_s / args.tau / normal_t,
        "cases": {k: {kk: vv for kk, vv in v.items()} for k, v in results.items()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    if args.also_into is not None:
        other = json.loads(args.also_into.read_text())
        for key in ("time_ratio_covering_vs_normal", "time_ratio_covering_vs_normal_paper", "time_ratio_covering_vs_normal_best"):
            other[key + "_1b"] = out[key]
        other["runs_1b"] = f"{out['setup']['model']}, {args.device} {args.dtype} ({args.out.name})"
        args.also_into.write_text(json.dumps(other, indent=2))
    plot(out, args.out.with_suffix(".png"))
    print_table(out)
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return out


def summary(results, name, config):
    """A case's ratios and errors under the description of its configuration."""
    r = results[name]
    return {"config": config, "time_ratio_vs_normal": r["time_ratio"], "mem_ratio_vs_normal": r["mem_ratio"],
            "rel_grad_error": r["rel_grad_error"], "rel_grad_error_ffn": r["rel_grad_error_ffn"]}


def _fmt(x, spec=".3f"):
    return "-" if x is None else format(x, spec)


def print_table(out):
    print(f"\n{'case':28s} {'time x':>7s} {'mem x':>7s} {'grad err':>9s} {'ffn err':>8s}")
    for name, r in out["cases"].items():
        print(f"{name:28s} {r['time_ratio']:7.2f} {r['mem_ratio']:7.2f} {_fmt(r['rel_grad_error']):>9s} {_fmt(r['rel_grad_error_ffn']):>8s}")
    print(f"\ndefault covering ({out['default_config'].split(' ')[0]}): time {out['time_ratio_covering_vs_normal']:.2f}x, "
          f"memory {out['mem_ratio_covering_vs_normal']:.2f}x of a normal rank; naive: time "
          f"{out['time_ratio_naive_vs_normal']:.2f}x, memory {out['mem_ratio_naive_vs_normal']:.2f}x; "
          f"low-rank dW kernel {out['lowrank_dw_time_ratio']:.2f}x of exact")


def plot(out, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(out["cases"])
    default = out["default_config"].split(" ")[0]
    colors = ["tab:gray" if n in ("normal",) else "tab:red" if n.startswith("naive") else
              "tab:green" if n == default else "tab:blue" for n in names]
    fig, axes = plt.subplots(1, 3, figsize=(16, 5.5))
    for ax, key, title in zip(axes, ("time_ratio", "mem_ratio", "rel_grad_error"),
                              ("fwd+bwd time / normal rank", "saved activations / normal rank",
                               "rel. error of non-attention grads")):
        vals = [out["cases"][n][key] or 0.0 for n in names]
        ax.barh(names, vals, color=colors)
        if key != "rel_grad_error":
            ax.axvline(1.0, color="k", lw=0.8, ls="--")
        for y, v in enumerate(vals):
            ax.text(v, y, f" {v:.2f}", va="center", fontsize=8)
        ax.set_title(title)
        ax.invert_yaxis()
    axes[1].set_yticklabels([])
    axes[2].set_yticklabels([])
    fig.suptitle("Covering rank (own + adopted micro-batch) vs a normal rank — " + out["setup"]["model"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
