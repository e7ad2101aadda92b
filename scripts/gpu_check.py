"""One-GPU check of MeCeFO's NCCL path: what CI (CPU, gloo) cannot run. docs/testing.md, "On a GPU".

    python scripts/gpu_check.py [--out benchmarks/results/gpu_check.json] [--skip-covering]

One process per case, each under a timeout (a hazard may hang or kill it); about 7-9 minutes on one
GPU (at most 10). Without CUDA it says so and exits 0. It prints each result and writes them all to --out
(the covering-cost runs write their own JSON beside it). Cases (docs/design.md, "NCCL"):

  versions      torch, CUDA, NCCL (build and runtime), whether the backend supports shrinking
  generations   20 x: build a generation's group as the runtime does (groups.build_dp_group:
                non-blocking, connected eagerly) -> every collective the runtime issues (all-reduce,
                broadcast, the sharded state's reduce-scatter and all-to-all) -> bounded abort.
                Build, first-collective and abort times; free device memory, reserved memory,
                threads and live groups per generation (growth = a communicator not released)
  absent_peer   a group of 2 whose peer never comes: blocking init with the first collective on a
                thread, then abort; and MeCeFO's non-blocking connect with its deadline. Does the
                wait end, does the abort return (hazard (b))
  watchdog      hazard (a): a first NCCL group alive (a replica's "TP" group), a DP group with a
                2 s timeout whose all-reduce waits behind a 10 s torch.cuda._sleep, a 10 s
                heartbeat timeout; under PyTorch's defaults, under TORCH_NCCL_ASYNC_ERROR_HANDLING=2
                alone, and under MeCeFO's environment (nccl_env.py). Does the process survive
                30 s (3x the heartbeat timeout), is CUDA healthy, does a new generation's group work
  abort_pair    two groups, each with an all-reduce queued behind a 3 s torch.cuda._sleep, aborted
                one after another (sequential) or as one (grouped: groups.release, the runtime's
                release of a generation). Does each abort return, how long, does a new group work
                (pytorch#150690: one after another can hang)
  shrink        torch.distributed.shrink_group where torch offers it: whether the NCCL backend
                supports it, the NCCL version's standing (>= 2.27; SHRINK_ABORT hangs from 2.31.2,
                pytorch PR 194775), and a call that must be refused (excluding the only rank).
                Recorded, not used by the runtime: a real shrink needs >= 2 GPUs (the parent
                communicator needs every rank); this tells whether it could replace the rebuild
  covering      benchmarks/covering_cost.py in bf16 at LLaMA-1B and -7B layer sizes: time and peak
                CUDA memory of a covering rank vs a normal one

The versions case also gives the start-up version check (nccl_env.version_warnings): the known
hangs of this NCCL, as each rank logs them in its `started` event.

Nothing here has run on a GPU in CI; a result counts once this script has run on one.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RESULT = "GPU_CHECK_RESULT "
SLEEP_S, DP_TIMEOUT_S, HEARTBEAT_S, SURVIVE_S = 10.0, 2.0, 10, 30.0
COVERING = {  # layer sizes (LLaMA-1B, LLaMA-7B); 2 layers keep a 7B run inside the time budget
    "llama1b": ["--hidden", "2048", "--ffn", "5504", "--heads", "16", "--seq", "2048", "--layers", "2"],
    "llama7b": ["--hidden", "4096", "--ffn", "11008", "--heads", "32", "--seq", "4096", "--layers", "2"],
}


# -- cases (each runs in its own process: `--case NAME`) ---------------------------------------------

def _store(world: int = 1):
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))


def _note(out: dict) -> None:
    """What the case knows so far (the parent keeps the last one if the case then hangs or dies)."""
    print(RESULT + json.dumps(out), flush=True)


def _threads() -> int:
    return len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else threading.active_count()


def case_versions(args) -> dict:
    import torch
    import torch.distributed as dist

    dotted = lambda v: ".".join(map(str, v)) if isinstance(v, (tuple, list)) else str(v)  # noqa: E731
    out = dict(torch=torch.__version__, cuda=torch.version.cuda, device=torch.cuda.get_device_name(0),
               python=platform.python_version(), nccl_build=dotted(torch.cuda.nccl.version()))
    try:
        out["nccl_runtime"] = dotted(dist.ProcessGroupNCCL.get_runtime_nccl_version())
    except Exception as e:  # not in every build
        out["nccl_runtime"] = f"unknown ({type(e).__name__})"
    from megatron_mecefo.elastic.comm import groups

    torch.cuda.set_device(0)
    g = groups.build_dp_group(_store(), 0, [0], 0, timedelta(seconds=60), "nccl")
    out["supports_shrinking"] = bool(getattr(g, "supports_shrinking", False))
    out["shrink_note"] = "torch.distributed.shrink_group hangs in torch 2.13 with NCCL >= 2.31 (pytorch#194679); not used"
    groups.destroy_group(g, 30)
    from megatron_mecefo.elastic.comm import nccl_env

    record = nccl_env.version_record("nccl")
    out.update(record, designed_for=nccl_env.DESIGNED_FOR)
    return out


def case_generations(args) -> dict:
    import torch
    import torch.distributed as dist

    from megatron_mecefo.elastic.comm import groups
    from megatron_mecefo.elastic.comm.shard_grads import _reduce_scatter

    cuda = args.backend == "nccl"
    if cuda:
        torch.cuda.set_device(0)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    store, rows = _store(), []
    never = lambda: False  # noqa: E731 - the runtime's waits poll a peer's abort like this
    for g in range(args.generations):
        t0 = time.monotonic()
        group = groups.build_dp_group(store, g, [0], 0, timedelta(seconds=60), args.backend)
        t1 = time.monotonic()
        x = torch.randn(1 << 20, device=device)
        groups.allreduce_sum_(group, x, should_abort=never)
        if cuda:
            torch.cuda.synchronize()
        t2 = time.monotonic()
        groups.broadcast_(group, x, 0, should_abort=never)
        rs = _reduce_scatter(group, [x.clone()], 0, never)
        got = torch.empty_like(x)
        groups.wait_(group.alltoall_base(got, x, [x.numel()], [x.numel()], dist.AllToAllOptions()), never)
        if cuda:
            torch.cuda.synchronize()
        ok = bool(torch.equal(rs, x) and torch.equal(got, x))
        t3 = time.monotonic()
        groups.destroy_group(group, 30)
        del group
        t4 = time.monotonic()
        row = dict(generation=g, build_s=t1 - t0, first_collective_s=t2 - t1, collectives_s=t3 - t2, abort_s=t4 - t3,
                   results_ok=ok, threads=_threads(), groups_alive=groups.alive())
        if cuda:
            row.update(free_bytes=torch.cuda.mem_get_info()[0], reserved_bytes=torch.cuda.memory_reserved())
        rows.append(row)
        _note(dict(generations=rows))
    first, last = rows[1 if len(rows) > 1 else 0], rows[-1]  # generation 0 pays the one-time CUDA/NCCL set-up
    out = dict(generations=rows, all_results_ok=all(r["results_ok"] for r in rows),
               thread_drift=last["threads"] - first["threads"], groups_alive_last=last["groups_alive"],
               median_build_s=sorted(r["build_s"] for r in rows)[len(rows) // 2],
               median_abort_s=sorted(r["abort_s"] for r in rows)[len(rows) // 2])
    if cuda:
        out["free_bytes_drift"] = first["free_bytes"] - last["free_bytes"]
        out["reserved_bytes_drift"] = last["reserved_bytes"] - first["reserved_bytes"]
    return out


def case_absent_peer(args) -> dict:
    """Rank 0 of a group of 2 whose rank 1 never comes (it died after the agreement)."""
    import torch
    import torch.distributed as dist

    from megatron_mecefo.elastic.comm import groups

    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    store = _store(2)
    prefix = dist.PrefixStore(f"absent/{args.mode}", store)
    out = dict(mode=args.mode)
    t0 = time.monotonic()
    if args.mode == "nonblocking":  # what build_dp_group does: bounded connect, then abort
        pg = dist.ProcessGroupNCCL(prefix, 0, 2, groups.nccl_options(timedelta(seconds=5)))
        try:
            groups.connect(pg, device, timedelta(seconds=5))
            out["connect"] = "returned (unexpected: the peer never came)"
        except groups.AbortHung as e:
            out["connect"], out["abort"] = "deadline", f"hung: {e}"
        except Exception as e:
            out["connect"], out["abort"] = f"{type(e).__name__}: {str(e)[:200]}", "returned"
        out["wait_ended_s"] = time.monotonic() - t0
        _note(out)
    else:  # PyTorch's default: blocking init inside the first collective
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timedelta(seconds=5)
        pg = dist.ProcessGroupNCCL(prefix, 0, 2, opts)
        done = threading.Event()
        error = []

        def first_collective():
            try:
                pg.allreduce([torch.ones(1, device=device)]).wait()
            except Exception as e:
                error.append(f"{type(e).__name__}: {str(e)[:200]}")
            finally:
                done.set()

        threading.Thread(target=first_collective, daemon=True).start()
        out["returned_by_itself_in_3s"] = done.wait(3.0)
        out["abort"] = _timed_abort(pg, 20)
        out["collective_unblocked_after_abort"] = done.wait(10.0)
        out["collective_error"] = error[0] if error else None
        _note(out)
    pg = None  # the communicator goes (a blocked init thread may still hold it)
    out["new_group_works"] = _new_group_works(_store(), 100)
    return out


def _timed_abort(group, deadline_s: float) -> str:
    """The runtime's bounded abort of `group`: how long it took, or that it hung."""
    from megatron_mecefo.elastic.comm import groups

    t0 = time.monotonic()
    try:
        groups.destroy_group(group, deadline_s)
        return f"returned in {time.monotonic() - t0:.1f} s"
    except groups.AbortHung as e:
        return f"hung: {e}"


def _new_group_works(store, generation: int) -> bool:
    import torch

    from megatron_mecefo.elastic.comm import groups

    g = groups.build_dp_group(store, generation, [0], 0, timedelta(seconds=30), "nccl")
    x = torch.full((4,), 3.0, device="cuda")
    groups.allreduce_sum_(g, x, should_abort=lambda: False)
    torch.cuda.synchronize()
    groups.destroy_group(g, 30)
    return bool((x == 3.0).all())


def _cycles_per_s() -> float:
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)  # warm-up
    start.record()
    torch.cuda._sleep(100_000_000)
    end.record()
    end.synchronize()
    return 100_000_000 / (start.elapsed_time(end) / 1000.0)


def case_watchdog(args) -> dict:
    """Hazard (a), with the environment the parent set for args.mode."""
    import torch
    import torch.distributed as dist

    from megatron_mecefo.elastic.comm import groups, nccl_env

    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    store = _store()
    out = dict(mode=args.mode, env={k: os.environ.get(k) for k in (*nccl_env.SETTINGS, "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC",
                                                                     "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC")})
    tp_opts = dist.ProcessGroupNCCL.Options()
    tp_opts._timeout = timedelta(seconds=120)
    tp = dist.ProcessGroupNCCL(dist.PrefixStore("tp", store), 0, 1, tp_opts)  # the process's first NCCL group
    tp.eager_connect_single_device(device)
    tp.allreduce([torch.ones(1, device=device)]).wait()
    dp = groups.build_dp_group(store, 1, [0], 0, timedelta(seconds=DP_TIMEOUT_S), "nccl")
    cycles = _cycles_per_s()
    t0 = time.monotonic()
    torch.cuda._sleep(int(SLEEP_S * cycles))  # the DP all-reduce waits behind it: the watchdog times it out
    work = groups.allreduce_sum_async_(dp, torch.ones(1, device=device))
    deadline = t0 + SLEEP_S + 20
    while not work.is_completed() and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        work.wait()
        out["dp_collective"] = "completed (no timeout seen)"
    except Exception as e:
        out["dp_collective"] = f"{type(e).__name__} after {time.monotonic() - t0:.1f} s: {str(e)[:160]}"
    out["abort"] = _timed_abort(dp, 30)
    del dp, work
    t_err = time.monotonic()
    while time.monotonic() - t_err < SURVIVE_S:  # the heartbeat monitor would end the process in here
        out["alive_s_after_error"] = round(time.monotonic() - t_err, 1)
        _note(out)
        time.sleep(2.0)
    out["alive_s_after_error"] = SURVIVE_S
    torch.cuda.synchronize()
    out["cuda_healthy"] = True
    x = torch.ones(1, device=device)
    tp.allreduce([x]).wait()
    torch.cuda.synchronize()
    out["first_group_works"] = bool(x.item() == 1.0)
    out["new_group_works"] = _new_group_works(store, 2)
    return out


def case_abort_pair(args) -> dict:
    """Two groups with collectives pending on the device, aborted one after another or as one
    (`--backend gloo`: the same path on CPU, nothing pending)."""
    import torch

    from megatron_mecefo.elastic.comm import groups, nccl_env

    cuda = args.backend == "nccl"
    if cuda:
        torch.cuda.set_device(0)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    store = _store()
    pair = [groups.build_dp_group(store, g, [0], 0, timedelta(seconds=30), args.backend, tag=f"pair{g}") for g in (0, 1)]
    for group in pair:  # both communicators exist and work
        groups.allreduce_sum_(group, torch.ones(4, device=device), should_abort=lambda: False)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda._sleep(int(3.0 * _cycles_per_s()))  # the next collectives wait behind it, still pending
    pending = [groups.allreduce_sum_async_(g, torch.ones(1 << 20, device=device)) for g in pair]
    out = dict(mode=args.mode, backend=args.backend, nccl=nccl_env.version_record(args.backend)["nccl_version"],
               grouped_by_release=groups._bracket(pair, None) is not None)
    t0 = time.monotonic()
    try:
        if args.mode == "grouped":
            groups.release(pair, 30)
            out["abort"] = f"returned in {time.monotonic() - t0:.2f} s"
        else:
            out["abort"] = [_timed_abort(g, 30) for g in pair]
    except groups.AbortHung as e:
        out["abort"] = f"hung: {e}"
    _note(out)
    del pair, pending, group  # the last references: the communicators go with them
    if cuda:
        torch.cuda.synchronize()
        out["new_group_works"] = _new_group_works(store, 10)
    out["groups_alive"] = groups.alive()
    return out


def case_shrink(args) -> dict:
    """What torch and NCCL offer for shrinking a group (recorded; the runtime rebuilds instead)."""
    import torch
    import torch.distributed as dist

    from megatron_mecefo.elastic.comm import nccl_env

    torch.cuda.set_device(0)
    version = nccl_env.runtime_version()
    out = dict(offered=hasattr(dist, "shrink_group"), nccl=".".join(map(str, version)) if version else None,
               nccl_has_shrink=bool(version and version >= (2, 27, 0)),
               shrink_abort_hangs=bool(version and version >= (2, 31, 2)),  # pytorch#194679 / PR 194775
               one_gpu_limit="a real shrink needs >= 2 GPUs: the parent communicator needs every rank")
    if not out["offered"]:
        return out
    dist.init_process_group("nccl", store=_store(), rank=0, world_size=1, device_id=torch.device("cuda", 0))
    backend = dist.group.WORLD._get_backend(torch.device("cuda", 0))
    out["supports_shrinking"] = bool(getattr(backend, "supports_shrinking", False))
    _note(out)
    try:  # must be refused before any communicator is touched
        dist.shrink_group([0])
        out["refuses_excluding_every_rank"] = False
    except (ValueError, TypeError, RuntimeError) as e:
        out["refuses_excluding_every_rank"] = f"{type(e).__name__}: {str(e)[:160]}"
    dist.destroy_process_group()  # every rank is alive here: a normal shutdown
    return out


CASES = {"versions": case_versions, "generations": case_generations, "absent_peer": case_absent_peer,
         "watchdog": case_watchdog, "abort_pair": case_abort_pair, "shrink": case_shrink}


# -- the parent ---------------------------------------------------------------------------------

def _environment(mode: str) -> dict:
    """The child's environment: MeCeFO's NCCL settings (as its launchers set them), or, for the
    watchdog case, PyTorch's defaults / ASYNC_ERROR_HANDLING=2 alone, with a short heartbeat."""
    from megatron_mecefo.elastic.comm import nccl_env

    if mode in ("torch_defaults", "async_only"):
        env = {k: v for k, v in os.environ.items() if k not in nccl_env.SETTINGS}
        if mode == "async_only":  # what MeCeFO set before nccl_env.py
            env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"
    else:
        env = dict(os.environ)
        nccl_env.apply(env, log=lambda w: print(f"gpu_check: {w}", flush=True))
    env.update(TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC=str(HEARTBEAT_S), TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC="500",
               PYTHONUNBUFFERED="1")
    return env


def run_case(name: str, timeout_s: float, mode: str = "mecefo", extra=()) -> dict:
    cmd = [sys.executable, __file__, "--case", name, "--mode", mode, *extra]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, env=_environment(mode), capture_output=True, text=True, timeout=timeout_s)
        stdout, stderr, code = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        text = lambda b: b.decode(errors="replace") if isinstance(b, bytes) else (b or "")  # noqa: E731
        stdout, stderr, code = text(e.stdout), text(e.stderr), None
    elapsed = time.monotonic() - t0
    last = [json.loads(line[len(RESULT):]) for line in stdout.splitlines() if line.startswith(RESULT)]
    result = dict(elapsed_s=round(elapsed, 1), **(last[-1] if last else {}))
    if code == 0 and last:
        status = dict(status="ok")
    elif code is None:
        status = dict(status="hung", detail=f"no end within {timeout_s:g} s (killed); the last note is kept")
    else:
        how = f"killed by signal {-code}" if code < 0 else f"exit {code}"
        status = dict(status="died", detail=f"{how} after {elapsed:.1f} s; the last note is kept")
    if status["status"] != "ok":
        status["stderr_tail"] = stderr[-1500:]
    print(f"gpu_check: {name} ({mode}): {status['status']}", flush=True)
    return {**status, **result}


def run_covering(size: str, out_dir: Path, timeout_s: float) -> dict:
    out = out_dir / f"covering_cost_{size}_bf16_cuda.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "covering_cost.py"), "--device", "cuda", "--dtype", "bf16",
           "--micro-batch", "1", "--repeats", "3", *COVERING[size], "--out", str(out)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return dict(status="hung", detail=f"no result within {timeout_s:g} s")
    if proc.returncode != 0 or not out.exists():
        return dict(status="died", detail=f"exit {proc.returncode}", stderr_tail=proc.stderr[-1500:])
    r = json.loads(out.read_text())
    keys = ("time_ratio_covering_vs_normal", "mem_ratio_covering_vs_normal", "cuda_peak_ratio_covering_vs_normal",
            "time_ratio_naive_vs_normal", "cuda_peak_ratio_naive_vs_normal", "lowrank_dw_time_ratio", "default_config")
    return dict(status="ok", json=str(out), **{k: r.get(k) for k in keys})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "gpu_check.json")
    p.add_argument("--skip-covering", action="store_true")
    p.add_argument("--case", choices=sorted(CASES), help=argparse.SUPPRESS)
    p.add_argument("--mode", default="mecefo", help=argparse.SUPPRESS)
    p.add_argument("--backend", default="nccl", help=argparse.SUPPRESS)  # gloo: the generations loop on CPU
    p.add_argument("--generations", type=int, default=20, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.case:  # a child
        print(RESULT + json.dumps(CASES[args.case](args)), flush=True)
        return 0
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available() or not dist.is_nccl_available():
        print("gpu_check: no CUDA (or a torch without NCCL) here: nothing to check; run it on a GPU machine")
        return 0
    t0 = time.monotonic()
    report = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "host": platform.node()}
    report["versions"] = run_case("versions", 120)
    report["generations"] = run_case("generations", 180)
    report["absent_peer"] = {m: run_case("absent_peer", 90, m) for m in ("nonblocking", "blocking")}
    report["watchdog"] = {m: run_case("watchdog", 120, m) for m in ("mecefo", "async_only", "torch_defaults")}
    report["abort_pair"] = {m: run_case("abort_pair", 60, m) for m in ("sequential", "grouped")}
    report["shrink"] = run_case("shrink", 60)
    report["nccl_warnings"] = report["versions"].get("nccl_warnings")
    if not args.skip_covering:
        report["covering"] = {s: run_covering(s, args.out.parent, 150) for s in COVERING}
    report["elapsed_s"] = time.monotonic() - t0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
