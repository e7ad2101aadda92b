"""The sharded optimizer state (ds_config "zero_optimization.stage": 1) in examples/pretrain_gpt:
memory per rank, healthy step time, and recovery with a re-shard.

- Optimizer-state bytes on one rank at D = 2, 4, 8, from the live tensors: replicated (stage 0:
  AdamW's moments after a step; the fp32 model is its own master), sharded (shard_redundancy "none":
  an fp32 master and the moments of 1/D) and sharded with the neighbour copy ("neighbour", the
  default: 2/D); each job prints what its rank holds. In this fp32 model the sharded master is a
  second fp32 copy of the rank's range; with bf16 parameters the master exists in every mode.
- Healthy step time at D = 4, stage 0 against stage 1, side by side (median of the logged steps).
- Recovery at D = 4 with stage 1: a rank SIGKILLed in the backward of step 4; the survivors'
  detect -> regroup (agreement, group, re-shard) from the event log, beside the same kill at stage 0.
- The per-parameter formula applied to 7B at D = 32 (AdamW, bf16 parameters, fp32 master + moments:
  12 bytes of optimizer state per parameter), beside Megatron's two distributed-optimizer instances,
  which is what this implementation holds with bf16 parameters in every host (the fp32 masters
  sharded with the moments), beside a mixed-precision wrapper's whole fp32 copy next to sharded
  moments (4 + 16/D), which it avoids.
- Bytes each rank receives per step per gradient element (formula): replicated all-reduce, sharded
  with an all-reduce, sharded with NCCL's reduce-scatter and the copy's range (shard_grads.py), each
  with the parameters' all-gather where sharded.

    python benchmarks/sharded_optimizer.py   # ~5 min on 2 cores; writes benchmarks/results/sharded_optimizer.json
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = ["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "64",
         "--micro-batch-size", "2", "--lr-decay-style", "constant", "--normalization", "RMSNorm", "--swiglu",
         "--position-embedding-type", "rope", "--mecefo-rank", "16", "--eval-iters", "1", "--log-interval", "1",
         "--mecefo-heartbeat-timeout-s", "2", "--mecefo-collective-timeout-s", "10"]


def run(tmp: Path, d: int, stage: int, *extra, iters=8):
    cfg = tmp / f"ds{stage}.json"
    cfg.write_text(json.dumps({"optimizer": {"type": "AdamW", "params": {"betas": [0.9, 0.95], "torch_adam": True}},
                               "gradient_clipping": 1.0, "zero_optimization": {"stage": stage}}))
    cmd = [sys.executable, "-m", "megatron_mecefo.elastic.launch", "--nproc-per-node", str(d), "--master-port", "0",
           str(ROOT / "examples/pretrain_gpt/pretrain_gpt.py"), *MODEL, "--global-batch-size", str(2 * d),
           "--train-iters", str(iters), "--eval-interval", str(iters), "--deepspeed_config", str(cfg), "--mecefo", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(proc.stdout[-2000:] + proc.stderr[-2000:])
    return proc.stdout


def held_mib(out: str):
    m = re.search(r"sharded over \d+ replicas .*?: ([\d.]+) MiB on this rank, replicated ([\d.]+) MiB", out)
    return float(m.group(1)), float(m.group(2))


def step_ms(out: str):
    times = [float(x) for x in re.findall(r"elapsed time per iteration \(ms\):\s+([\d.]+)", out)]
    return statistics.median(times[2:])  # past the first steps' warm-up


def replicated_bytes():
    """Live bytes of a replicated AdamW's state over the example's model after one step (its moments;
    the fp32 parameters are the model itself and every rank holds them in every mode), and the
    parameter count."""
    sys.path.insert(0, str(ROOT / "examples/pretrain_gpt"))
    import torch

    from megatron_mecefo.layers.model import init_model_parallel
    import pretrain_gpt

    args = pretrain_gpt.parse_args(MODEL)
    import os
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    init_model_parallel(1, 1, seed=1)
    model = pretrain_gpt.build_model(args)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if t.dim() > 0)
    return state, sum(p.numel() for p in model.parameters())


def recovery(out_dir: Path):
    ev = [json.loads(line) for line in (out_dir / "events_rank0.jsonl").read_text().splitlines()]
    regroup = [e for e in ev if e["event"] == "regroup" and e["generation"] == 1][0]
    return {"detect_to_recover_s": regroup["detect_to_recover_s"], "agree_s": regroup["agree_s"],
            "regroup_s": regroup["regroup_s"]}


def main():
    result = {"date": time.strftime("%Y-%m-%d"), "command": "python benchmarks/sharded_optimizer.py",
              "model": "examples/pretrain_gpt, 2 layers, hidden 128, AdamW fp32, gloo on CPU"}
    live, numel = replicated_bytes()
    result["parameters"] = numel
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for d in (2, 4, 8):
            neighbour, formula = held_mib(run(tmp, d, 1, iters=3))
            none, _ = held_mib(run(tmp, d, 1, "--mecefo-shard-redundancy", "none", iters=3))
            result[f"d{d}"] = {"replicated_bytes": live, "sharded_bytes": int(none * 2**20),
                               "neighbour_bytes": int(neighbour * 2**20)}
            print(d, result[f"d{d}"], flush=True)
        plain = run(tmp, 4, 0, iters=12)
        sharded = run(tmp, 4, 1, iters=12)
        result["step_ms_d4"] = {"replicated": step_ms(plain), "sharded_neighbour": step_ms(sharded)}
        result["step_ms_d4"]["ratio"] = result["step_ms_d4"]["sharded_neighbour"] / result["step_ms_d4"]["replicated"]
        rec = {}
        for stage in (0, 1):
            logs = tmp / f"rec{stage}"
            run(tmp, 4, stage, "--mecefo-inject", "kill:1:4:backward", "--mecefo-log-dir", str(logs), iters=6)
            rec[f"stage{stage}"] = recovery(logs)
        result["recovery_d4"] = rec
    n, d, gb = 7e9, 32, 1e9
    result["formula_7b_d32"] = {
        "bytes_per_parameter": {"replicated": 12, "zero1": 12 / d, "zero1_neighbour": 24 / d,
                                "megatron_two_instances": 24 / d},
        "gb_per_rank": {"replicated": 12 * n / gb, "zero1": 12 * n / d / gb, "zero1_neighbour": 24 * n / d / gb,
                        "megatron_two_instances": 24 * n / d / gb},
        "note": "optimizer state only (fp32 master + AdamW moments); the neighbour copy costs what Megatron's "
                "second distributed-optimizer instance costs, and it is what the covering rank needs: the "
                "survivors re-shard in place instead of waiting for spares. With bf16 parameters every host "
                "holds zero1_neighbour (the fp32 masters sharded with the moments); wrapper_copy_and_sharded_"
                "moments: what a mixed-precision wrapper's whole fp32 copy beside sharded moments would hold",
    }
    result["formula_7b_d32"]["bytes_per_parameter"]["wrapper_copy_and_sharded_moments"] = 4 + 16 / d
    result["formula_7b_d32"]["gb_per_rank"]["wrapper_copy_and_sharded_moments"] = (4 + 16 / d) * n / gb
    result["bytes_received_per_gradient_element"] = {
        f"d{d}": {"replicated_allreduce": 2 * (d - 1) / d,
                  "sharded_allreduce_and_gather": 3 * (d - 1) / d,
                  "sharded_reduce_scatter_copy_and_gather": 2 * (d - 1) / d + 1 / d,
                  "sharded_reduce_scatter_and_gather_no_copy": 2 * (d - 1) / d}
        for d in (2, 4, 8, 32)}
    result["bytes_note"] = ("NCCL's reduce-scatter runs on GPUs; on gloo (this benchmark's step times) the sharded "
                            "step all-reduces the chunks (gloo's reduce-scatter cannot be waited on with an abort "
                            "check), so the CPU step time carries the all-reduce's bytes plus the gather")
    path = ROOT / "benchmarks/results/sharded_optimizer.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
