"""Running chaos schedules against the toy runtime job, examples/pretrain_gpt and the patched
upstream checkouts (tests + benchmark).

The toy job runs MeCeFO's runtime with the approximations off, so a run
that finishes must also equal the fault-free reference (`megatron_mecefo/testing/toy_train.py --reference`).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import List, Optional

import torch

from megatron_mecefo.testing import chaos

from megatron_mecefo.testing.launch import ROOT

TOY_SCRIPT = Path(__file__).resolve().parent / "toy_train.py"

# Short timeouts so that a schedule takes seconds; the invariants hold for any values.
TOY_TIMEOUTS = dict(collective_timeout_s=3.0, heartbeat_interval_s=0.2, heartbeat_timeout_s=1.2, agree_timeout_s=8.0)
TOY = dict(steps=24, k=2, mb=4, step_sleep=0.04)
EXACT = ["--mecefo", "--no-mecefo-skip-attention", "--no-mecefo-lowrank-ffn", "--mecefo-recompute-ffn", "never"]


def timeout_flags(t: dict) -> List[str]:
    return [x for key, v in t.items() for x in (f"--mecefo-{key.replace('_', '-')}", str(v))]


def toy_reference(out: Path, world: int) -> dict:
    from megatron_mecefo.testing import toy_train

    out.mkdir(parents=True, exist_ok=True)
    toy_train.reference(argparse.Namespace(steps=TOY["steps"], k=TOY["k"], mb=TOY["mb"], world=world, out=out))
    return torch.load(out / "reference.pt", weights_only=False)


def toy_bound(schedule: chaos.Schedule, timeouts: Optional[dict] = None, startup_s: float = 8.0,
              fault_free_s: float = 20.0) -> float:
    return chaos.time_bound(faults=len(schedule.faults), restart_after=schedule.restart_after, startup_s=startup_s,
                            fault_free_s=fault_free_s,
                            **{k: v for k, v in (timeouts or TOY_TIMEOUTS).items() if k != "heartbeat_interval_s"})


def run_toy(schedule: chaos.Schedule, out: Path, reference: Optional[dict], step_sleep: float = TOY["step_sleep"],
            sharded: bool = False, cover: str = "neighbour", rebalance: bool = False, timeouts: Optional[dict] = None,
            startup_s: float = 8.0, fault_free_s: float = 20.0) -> tuple:
    """Run one schedule on the toy job (`sharded`: the Adam state sharded with neighbour copies;
    `cover`: the cover policy; `rebalance`: fail-slow on, a window of 2 steps; `timeouts`,
    `startup_s`, `fault_free_s`: for many ranks on few cores); returns (outcome, violations, result)."""
    timeouts = timeouts or TOY_TIMEOUTS
    script = [str(TOY_SCRIPT), "--out", str(out), "--steps", str(schedule.steps),
              "--k", str(TOY["k"]), "--mb", str(TOY["mb"]), "--step-sleep", str(step_sleep),
              *EXACT, *timeout_flags(timeouts), *(["--sharded"] if sharded else []), "--mecefo-cover", cover,
              *(["--mecefo-rebalance", "--mecefo-rebalance-window", "2"] if rebalance else [])]
    slowest = max([f.factor for f in schedule.faults if f.kind == "slow"], default=1.0)
    bound = toy_bound(schedule, timeouts, startup_s, fault_free_s) + 2 * slowest * step_sleep * TOY["k"] * schedule.steps
    result = chaos.run_schedule(schedule, script, out, limit_s=bound + 60, cwd=str(ROOT))
    outcome, bad = chaos.check_run(result, out, schedule, k=TOY["k"], bound_s=bound)
    if outcome == "finished" and reference is not None:
        bad += _toy_finals(out, schedule, reference)
        outcome = "finished" if not bad else "failed"
    return outcome, bad, result


def _toy_finals(out: Path, schedule: chaos.Schedule, reference: dict) -> List[str]:
    """Every rank that finished holds the same parameters and Adam state, equal to fault-free."""
    finals = {p: torch.load(p, weights_only=False) for p in sorted(out.glob("final_rank*.pt"))}
    if not finals:
        return ["finished but no rank wrote its final state"]
    bad = []
    first = next(iter(finals.values()))
    for path, f in finals.items():
        if f["step"] != schedule.steps:
            bad.append(f"{path.name} ended at step {f['step']}")
        if not all(torch.equal(a, b) for a, b in zip(first["params"], f["params"])):
            bad.append(f"{path.name} differs from the other finished ranks")
        for sa, sb in zip(first["opt"]["state"].values(), f["opt"]["state"].values()):
            if not all(torch.equal(sa[key], sb[key]) for key in ("exp_avg", "exp_avg_sq", "step")):
                bad.append(f"{path.name}: Adam state differs")
                break
    for a, b in zip(reference["params"], first["params"]):
        if not torch.allclose(a, b, rtol=1e-5, atol=1e-6):
            bad.append(f"final parameters differ from the fault-free run (max abs diff {(a - b).abs().max():.3g})")
            break
    if first.get("shards") is not None:
        bad += _sharded_finals(finals, reference)
    return bad


def _sharded_finals(finals: dict, reference: dict) -> List[str]:
    """A sharded run: every element of the Adam state is held by a finished rank (the job never
    loses a range and goes on: give_up is the policy here), and every held copy equals the
    fault-free run's state there."""
    ref_state = list(reference["opt"]["state"].values())
    flat = {k: torch.cat([s[k].reshape(-1) for s in ref_state]) for k in ("exp_avg", "exp_avg_sq")}
    step = float(ref_state[0]["step"])
    numel = flat["exp_avg"].numel()
    covered, bad = torch.zeros(numel, dtype=torch.bool), []
    for path, f in finals.items():
        for start, end, state, steps in f["shards"]:
            covered[start:end] = True
            for k in flat:
                if not torch.allclose(state[k], flat[k][start:end], rtol=1e-5, atol=1e-7):
                    bad.append(f"{path.name}: its {k} of [{start}, {end}) differs from the fault-free run")
            if not bool((steps == step).all()):
                bad.append(f"{path.name}: step counts of [{start}, {end}) are not the fault-free {step:g}")
    if not bool(covered.all()):
        bad.append(f"{int((~covered).sum())} of {numel} elements of the Adam state are held by no finished rank")
    return bad


# -- examples/pretrain_gpt -------------------------------------------------------------------------

PRETRAIN_TIMEOUTS = dict(collective_timeout_s=5.0, heartbeat_interval_s=0.3, heartbeat_timeout_s=2.0, agree_timeout_s=20.0)
PRETRAIN = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
            "--micro-batch-size", "2", "--global-batch-size", "16", "--lr", "1e-3", "--log-interval", "20",
            "--eval-iters", "2", "--mecefo", "--mecefo-rank", "8", "--mecefo-log-param-hash"]


def run_pretrain(schedule: chaos.Schedule, out: Path, *, fault_free_s: float = 60.0) -> tuple:
    """Run one schedule on examples/pretrain_gpt (global batch 16 in micro-batches of 2), on the
    schedule's layout (T = schedule.tp, P = schedule.pp)."""
    k = 16 // (2 * schedule.grid.dp)
    script = [str(ROOT / "examples/pretrain_gpt/pretrain_gpt.py"), "--deepspeed_config",
              str(ROOT / "examples/pretrain_gpt/ds_config.json"), *PRETRAIN, "--train-iters", str(schedule.steps),
              "--tensor-model-parallel-size", str(schedule.tp), "--pipeline-model-parallel-size", str(schedule.pp),
              "--eval-interval", str(schedule.steps), "--save", str(out / "ckpt"), "--mecefo-log-dir", str(out),
              *timeout_flags(PRETRAIN_TIMEOUTS)]
    bound = chaos.time_bound(faults=len(schedule.faults), restart_after=schedule.restart_after, startup_s=15.0,
                             fault_free_s=fault_free_s,
                             **{k_: v for k_, v in PRETRAIN_TIMEOUTS.items() if k_ != "heartbeat_interval_s"})
    result = chaos.run_schedule(schedule, script, out, limit_s=bound + 60, cwd=str(ROOT))
    outcome, bad = chaos.check_run(result, out, schedule, k=k, bound_s=bound)
    if outcome == "finished":
        if f"validation loss at iteration {schedule.steps} " not in result.stdout:
            bad.append("finished without the final validation loss")
    return ("failed" if bad else outcome), bad, result


# -- the patched checkouts ---------------------------------------------------------------------------

CHECKOUT_STEPS = 40


class Checkouts:
    """Patched Megatron-DeepSpeed and Megatron-LM snapshots under `work`, each extracted on first use."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self._roots: dict = {}

    def root(self, host: str) -> tuple:
        """(checkout, dataset prefix or None) of host "mds" or "mlm"."""
        if host not in self._roots:
            from megatron_mecefo import patch
            from megatron_mecefo.testing import mds, mlm

            if host == "mds":
                root = mds.extract(mds.SNAPSHOT_GLOB, self.work / "mds" / "Megatron-DeepSpeed")
                patch.apply(str(root))
                data = root.parent / "data" / "corpus_text_document"
                data.parent.mkdir()
                mds.write_dataset(root, data)
                mds.prepare(root)
                self._roots[host] = (root, data)
            else:
                root = mds.extract(mlm.SNAPSHOT_GLOB, self.work / "mlm" / "Megatron-LM")
                patch.apply(str(root))
                mlm.prepare(root)
                self._roots[host] = (root, None)
        return self._roots[host]


def run_checkout(schedule: chaos.Schedule, out: Path, checkouts: Checkouts, host: str, *,
                 fault_free_s: float = 60.0) -> tuple:
    """Run one schedule on upstream's own pretrain_gpt.py in a patched checkout ("mds": DeepSpeed's
    pipeline engine; "mlm": upstream's schedules), 2 micro-batches per replica, on the schedule's
    layout, with the default approximations."""
    from megatron_mecefo.testing import mds, mlm

    root, data = checkouts.root(host)
    out.mkdir(parents=True, exist_ok=True)
    flags = ["--mecefo", "--mecefo-rank", "16", "--mecefo-log-param-hash", "--mecefo-log-dir", str(out),
             "--save", str(out / "ckpt"), "--save-interval", str(schedule.steps), "--log-interval", "10",
             "--eval-interval", str(schedule.steps),
             "--tensor-model-parallel-size", str(schedule.tp), "--pipeline-model-parallel-size", str(schedule.pp),
             *timeout_flags(PRETRAIN_TIMEOUTS)]
    if host == "mds":
        args = [a for a in mds.args(data, out / "ds.json", dp=schedule.grid.dp, iters=schedule.steps, extra=flags)
                if a != "--no-pipeline-parallel" or schedule.pp == 1]
        env = mds.env()
    else:
        args, env = mlm.args(dp=schedule.grid.dp, iters=schedule.steps, extra=flags), mlm.env()
    bound = chaos.time_bound(faults=len(schedule.faults), restart_after=schedule.restart_after, startup_s=30.0,
                             fault_free_s=fault_free_s,
                             **{k_: v for k_, v in PRETRAIN_TIMEOUTS.items() if k_ != "heartbeat_interval_s"})
    result = chaos.run_schedule(schedule, ["pretrain_gpt.py", *args], out, limit_s=bound + 60, cwd=str(root), env=env)
    outcome, bad = chaos.check_run(result, out, schedule, k=2, bound_s=bound)
    if outcome == "finished" and not re.search(rf"iteration\s+{schedule.steps}/\s*{schedule.steps} ", result.stdout):
        bad.append(f"finished without iteration {schedule.steps}'s log line")
    return ("failed" if bad else outcome), bad, result
