"""Running an extracted, patched Megatron-DeepSpeed snapshot in the tests and benchmarks (CPU, gloo).

The snapshot is $MECEFO_UPSTREAM_DIR/Megatron-DeepSpeed-*.tar.gz (default: shared/upstream next to
the checkout); tests skip, naming it, when it is absent. Its processes get on PYTHONPATH: a torchvision stand-in
(stubs/: upstream imports torchvision through its vision code only; the PyPI wheel does not load
with the CPU torch) and the "mds" extra's packages ($MECEFO_MDS_DEPS, installed by
scripts/test.sh), unless this environment already imports transformers.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import tarfile
import unittest
from pathlib import Path
from typing import Callable, Dict, List, Optional

from megatron_mecefo.log import read_jsonl
from megatron_mecefo.testing.launch import ROOT, free_port, run_launcher

STUBS = Path(__file__).resolve().parent / "stubs"
NO_COMPILE = Path(__file__).resolve().parent / "sitehooks"  # first: it runs the next sitecustomize
SNAPSHOT_GLOB = "Megatron-DeepSpeed-*.tar.gz"


def upstream_dir() -> Path:
    return Path(os.environ.get("MECEFO_UPSTREAM_DIR", ROOT.parent / "shared" / "upstream"))


def snapshot(pattern: str) -> Path:
    found = sorted(upstream_dir().glob(pattern))
    if not found:
        raise unittest.SkipTest(f"no upstream snapshot {pattern} in {upstream_dir()} (set MECEFO_UPSTREAM_DIR)")
    return found[-1]


def extract(pattern: str, dest: Path) -> Path:
    """A fresh extract of the snapshot (its top folder stripped) at dest."""
    with tarfile.open(snapshot(pattern)) as tar:
        top = tar.getmembers()[0].name.split("/")[0]
        tar.extractall(dest.parent / ".x", filter="data")
    shutil.move(str(dest.parent / ".x" / top), dest)
    shutil.rmtree(dest.parent / ".x")
    return dest


def original_script(pattern: str = SNAPSHOT_GLOB, name: str = "pretrain_gpt.py") -> str:
    """An upstream file as the snapshot holds it (to run the unpatched script beside the patched one)."""
    with tarfile.open(snapshot(pattern)) as tar:
        member = next(m for m in tar.getmembers() if m.name.split("/", 1)[-1] == name)
        return tar.extractfile(member).read().decode()


def env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    paths = [str(NO_COMPILE), str(STUBS)]
    try:
        import transformers  # noqa: F401  (the mds extra in this environment)
    except ImportError:
        deps = os.environ.get("MECEFO_MDS_DEPS")
        if not deps or not os.path.isdir(deps):
            raise unittest.SkipTest("Megatron-DeepSpeed needs the mds extra: run the tests with scripts/test.sh, or "
                        "pip install -e .[mds]")
        paths.append(deps)
    e = dict(os.environ, PYTHONPATH=os.pathsep.join(paths + [str(ROOT)]), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    e.update(extra or {})
    return e


def prepare(root: Path) -> None:
    """Build upstream's dataset helpers once. Left to the first run, rank 0 compiles them inside
    Megatron's initialisation while the other ranks wait: a 2-rank run then costs ~5x its CPU
    time (54 vs 11 CPU-seconds measured here)."""
    subprocess.run(["make", "-C", str(root / "megatron" / "data")], env=env(), check=True, capture_output=True)
    compile_sources(root)


def compile_sources(root: Path) -> None:
    """Write the checkout's bytecode once, as `pip install` does for a package. Where
    PYTHONDONTWRITEBYTECODE is set (this project's CI machines set it) no process writes it, and
    every one compiled upstream's modules from source again: 0.7 CPU-seconds a Megatron-LM process."""
    import compileall
    import warnings

    with warnings.catch_warnings():  # upstream's SyntaxWarnings ("is" with a literal), once per file
        warnings.simplefilter("ignore")
        compileall.compile_dir(str(root), quiet=2, rx=re.compile(r"[/\\](tests?|examples|tools|docs)[/\\]"))


def write_dataset(checkout: Path, prefix: Path, documents: int = 400) -> None:
    """A tiny learnable corpus (arithmetic sequences) in upstream's own mmap format."""
    code = f"""
import numpy as np, torch
from megatron.data.indexed_dataset import make_builder
b = make_builder("{prefix}.bin", impl="mmap", vocab_size=1000)
rng = np.random.default_rng(0)
for _ in range({documents}):
    n = int(rng.integers(20, 200)); start, stride = int(rng.integers(0, 997)), int(rng.integers(1, 7))
    b.add_item(torch.tensor([(start + i * stride) % 997 + 1 for i in range(n)] + [0], dtype=torch.int64))
    b.end_document()
b.finalize("{prefix}.idx")
"""
    subprocess.run([sys.executable, "-c", code], cwd=checkout, env=env(), check=True, capture_output=True)




def args(data: Path, ds_config: Path, *, dp: int, tp: int = 1, iters: int = 10, micro_batches: int = 2,
         extra: List[str] = (), zero_stage: int = 0, overlap_bucket: Optional[int] = None) -> List[str]:
    """A tiny GPT, the flags a user passes (CPU needs --no-gradient-accumulation-fusion and the fused
    kernels off), and a ds_config for `dp` data-parallel ranks (ZeRO `zero_stage`; `overlap_bucket`:
    "overlap_comm" with buckets of that many elements)."""
    gbs = dp * micro_batches
    zero = {"stage": zero_stage}
    if overlap_bucket is not None:
        zero.update(overlap_comm=True, reduce_bucket_size=overlap_bucket)
    ds_config.write_text(json.dumps({"train_batch_size": gbs, "train_micro_batch_size_per_gpu": 1,
                                     "steps_per_print": 10000, "zero_optimization": zero,
                                     "gradient_clipping": 1.0}))
    return ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "128",
            "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "1",
            "--global-batch-size", str(gbs), "--train-iters", str(iters), "--lr-decay-iters", str(iters),
            "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2",
            "--weight-decay", "0.01", "--clip-grad", "1.0", "--seed", "1234", "--log-interval", "1",
            "--eval-interval", "5", "--eval-iters", "2", "--data-path", str(data), "--split", "98,1,1",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--tensor-model-parallel-size", str(tp),
            "--no-gradient-accumulation-fusion", "--num-workers", "0", "--no-pipeline-parallel",
            "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
            "--deepspeed", "--deepspeed_config", str(ds_config), "--zero-stage", str(zero_stage), "--distributed-backend", "gloo",
            *extra]


def resize(base: List[str], *, layers: int, hidden: int, seq: int) -> List[str]:
    """The tiny GPT flags of `args` at another size (benchmarks): layers, hidden size (FFN 4x), sequence."""
    size = {"--num-layers": str(layers), "--hidden-size": str(hidden), "--ffn-hidden-size": str(4 * hidden),
            "--seq-length": str(seq), "--max-position-embeddings": str(seq)}
    return [size.get(prev, x) if prev in size else x for prev, x in zip([None] + base[:-1], base)]


def torchrun(checkout: Path, nproc: int, script_args: List[str], timeout: float = 240, *,
             script: str = "pretrain_gpt.py", env_of: Callable = None):
    """The user's usual launch (torchrun), from the checkout's root. On CPU upstream counts devices
    from LOCAL_SIZE (the deepspeed launcher sets it). `env_of`: extra env -> the processes' env."""
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
           str(port), script, *script_args]
    try:
        return run_launcher(cmd, timeout, cwd=checkout, env=(env_of or env)({"LOCAL_SIZE": str(nproc)}),
                            merge_output=True)
    finally:
        remove_shm_buffers(port)


def remove_shm_buffers(port: int) -> None:
    """DeepSpeed's CPU shared-memory op (loaded by upstream's processes, not by MeCeFO's) creates
    /dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>, 69 MB each, and never unlinks
    them: a suite would leave gigabytes in /dev/shm (memory) on the machine. Removed after the run."""
    for buffer in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"):
        buffer.unlink(missing_ok=True)


def mecefo_launch(checkout: Path, nproc: int, script_args: List[str], *, restart_after: Optional[float] = None,
                  timeout: float = 240, env_of: Callable = None, script: str = "pretrain_gpt.py",
                  extra_env: Optional[Dict[str, str]] = None):
    # port 0: the launcher binds the store's port itself; a port probed here and bound later can be
    # taken in between (a parallel test's gloo pair picked it once)
    cmd = [sys.executable, "-m", "megatron_mecefo.elastic.launch", "--nproc-per-node", str(nproc), "--master-port", "0"]
    if restart_after is not None:
        cmd += ["--restart-failed-after", str(restart_after)]
    return run_launcher(cmd + [script, *script_args], timeout, cwd=checkout, env=(env_of or env)(extra_env),
                        merge_output=True)


def upstream_reference(checkout: Path, nproc: int, script_args: List[str], *, timeout: float = 240,
                       env_of: Callable = None):
    """A fault-free run of upstream's unpatched script (pretrain_gpt_upstream.py) that a test compares
    against, where the launcher is not what it checks: under mecefo-launch, whose ranks the tests
    fork from a preloaded parent (a spawned Megatron rank under torchrun costs about 4 CPU-seconds
    more), with the environment torchrun gives it (`torchrun` below is the user's own launch)."""
    return mecefo_launch(checkout, nproc, script_args, timeout=timeout, env_of=env_of,
                         script="pretrain_gpt_upstream.py", extra_env={"LOCAL_SIZE": str(nproc)})


_ITER = re.compile(r"iteration\s+(\d+)/\s*\d+ \| consumed samples:\s+(\d+) .*?\| lm loss: ([0-9.E+-]+)")
_VAL = re.compile(r"validation loss at iteration (\d+) \| lm loss value: ([0-9.E+-]+)")


def losses(out: str) -> Dict[int, float]:
    """iteration -> training loss, from upstream's log lines (each iteration once)."""
    found: Dict[int, float] = {}
    for m in _ITER.finditer(out):
        it = int(m.group(1))
        assert it not in found, f"iteration {it} logged twice (more than one replica logs)"
        found[it] = float(m.group(3))
    return found


def consumed(out: str) -> Dict[int, int]:
    return {int(m.group(1)): int(m.group(2)) for m in _ITER.finditer(out)}


def val_losses(out: str) -> Dict[int, float]:
    return {int(m.group(1)): float(m.group(2)) for m in _VAL.finditer(out)}


def assert_same_run(orig, patched, mecefo, iters: int = 10, evals=(5, 10)) -> None:
    """The unpatched script's run (`orig`), the patched one without --mecefo (the same lines) and
    with --mecefo and no failure (every line's fields, `assert_lines`, and the validation losses,
    the losses to 1e-5)."""
    for name, res in (("unpatched", orig), ("patched", patched), ("--mecefo", mecefo)):
        assert res.returncode == 0, f"{name} run failed:\n{res.stdout[-4000:]}"
    want = log_lines(orig.stdout)
    assert sorted(want) == list(range(1, iters + 1))
    assert log_lines(patched.stdout) == want
    assert_lines(mecefo.stdout, want, loss_rel=1e-5)  # every field of every line
    v_want, v_got = val_losses(orig.stdout), val_losses(mecefo.stdout)
    assert sorted(v_got) == sorted(v_want) == list(evals)
    for it in v_want:
        assert math.isclose(v_got[it], v_want[it], rel_tol=1e-5), (it, v_got[it], v_want[it])


_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|(.*)")
LINE_FIELDS = ("consumed samples", "consumed tokens", "skipped samples", "learning rate", "global batch size",
               "lm loss", "loss scale", "grad norm", "num zeros", "params norm", "number of skipped iterations",
               "number of nan iterations")
"""The fields of upstream's iteration line that a run's record must reproduce (not its timings)."""


def log_lines(out: str) -> Dict[int, Dict[str, str]]:
    """iteration -> {field: printed value} of upstream's iteration lines (each iteration once)."""
    found: Dict[int, Dict[str, str]] = {}
    for line in out.splitlines():
        m = _LINE.search(line)
        if not m:
            continue
        it = int(m.group(1))
        assert it not in found, f"iteration {it} logged twice (more than one replica logs)"
        parts = (p.split(":", 1) for p in m.group(2).split("|") if ":" in p)
        found[it] = {k.strip(): v.strip() for k, v in parts if k.strip() in LINE_FIELDS}
    return found


def resumed_lines(every: Dict[int, Dict[str, str]], loaded: int, *, log_interval: int = 1,
                  first_line_keeps_sums: bool = True) -> Dict[int, Dict[str, str]]:
    """The lines upstream prints when it resumes at iteration `loaded`, from the lines of a run that
    logged `every` iteration (`--log-interval 1`, uninterrupted): `training_log` prints at each
    multiple of the interval the mean of the losses summed since its last print and the counters of
    that iteration; Megatron-LM (`first_line_keeps_sums`) also prints the first iteration of
    `train()` and does not reset its sums there (its `is_first_iteration`)."""
    want, sums, count = {}, {}, 0
    for it in sorted(i for i in every if i > loaded):
        line = every[it]
        for key in ("lm loss",):
            if key in line:
                sums[key] = sums.get(key, 0.0) + float(line[key])
        count += 1
        first = it == loaded + 1 and first_line_keeps_sums
        if it % log_interval == 0 or first:
            want[it] = dict(line, **{k: f"{v / count:.6E}" for k, v in sums.items()})
            if not first:
                sums, count = {}, 0
    return want


def assert_lines(out: str, want: Dict[int, Dict[str, str]], *, loss_rel: float = 1e-4) -> None:
    """The iteration lines in `out` are `want`'s: the same iterations, and in each the same fields
    with the same values; the loss to `loss_rel` (float summation order over several replicas
    against one rank), the grad norm (printed to 3 decimals) to 2e-3, the rest as printed."""
    got = log_lines(out)
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    for it, line in want.items():
        assert sorted(got[it]) == sorted(line), (it, got[it], line)
        for key, value in line.items():
            mine = got[it][key]
            if key == "lm loss":
                ok = math.isclose(float(mine), float(value), rel_tol=loss_rel, abs_tol=1e-6)
            elif key == "grad norm":
                ok = abs(float(mine) - float(value)) <= 2e-3
            elif key == "learning rate":
                ok = math.isclose(float(mine), float(value), rel_tol=1e-6)
            else:
                ok = mine == value
            assert ok, f"iteration {it}, {key}: {mine} (want {value})"


def memory_reports(out: str) -> List[int]:
    """The iterations after which upstream's memory report was printed."""
    return [int(m.group(1)) for m in re.finditer(r"\] \(after (\d+) iterations\) memory \(MB\)", out)]


def step_records(log_dir: Path):
    """step -> the records of every rank that committed it (steps_rank*.jsonl)."""
    steps = {}
    for f in sorted(log_dir.glob("steps_rank*.jsonl")):
        for r in read_jsonl(f):
            steps.setdefault(r["step"], []).append(r)
    return steps


def check_whole_and_identical(log_dir: Path, dp: int, k: int, iters: int, tp: int = 1, pp: int = 1,
                              first: int = 0) -> None:
    """Every step first..iters-1 ran the dp x k micro-batches of the global batch exactly once, and the
    replicas' shards at each (tensor, pipeline) position were bit-identical at its start (the chaos
    harness's check, which also counts a member killed between a commit and its record)."""
    from megatron_mecefo.elastic.plan.topology import Grid
    from megatron_mecefo.testing.chaos import check_steps, generation_plans

    bad = check_steps(step_records(log_dir), Grid(tp=tp, pp=pp, dp=dp), k, iters,
                      generation_plans(log_dir, tp * pp * dp), first=first)
    assert not bad, "\n".join(bad)


def record(out: str) -> Dict[str, Dict[int, int]]:
    """How often each iteration's log line and each evaluation appear in upstream's output."""
    counts: Dict[str, Dict[int, int]] = {"iteration": {}, "evaluation": {}}
    for m in _ITER.finditer(out):
        counts["iteration"][int(m.group(1))] = counts["iteration"].get(int(m.group(1)), 0) + 1
    for m in re.finditer(r"(?:validation|test) loss at iteration (\d+)", out):
        counts["evaluation"][int(m.group(1))] = counts["evaluation"].get(int(m.group(1)), 0) + 1
    return counts


def assert_recorded_once(out, *, killed: str, iters: int, evaluations: Dict[int, int]) -> None:
    """A run (a launcher's CompletedProcess) that lost a rank (`killed`, the injector's words)
    finished and logged every iteration 1..iters once and each evaluation as often as upstream does
    (`evaluations`: iteration -> count; at the end upstream evaluates the validation and test sets)."""
    assert out.returncode == 0, out.stdout[-6000:]
    assert f"[mecefo inject] {killed}" in out.stdout
    got = record(out.stdout)
    assert got["iteration"] == {i: 1 for i in range(1, iters + 1)}, got
    assert got["evaluation"] == evaluations, got


def assert_losses(out, want: Dict[int, Dict[str, str]], iters: int) -> None:
    """A run (a launcher's result) that ended well and logged every iteration 1..iters once, each
    line `want`'s (`assert_lines`, the loss to 1e-5)."""
    assert out.returncode == 0, out.stdout[-6000:]
    assert sorted(want) == list(range(1, iters + 1))
    assert_lines(out.stdout, want, loss_rel=1e-5)


def check_pipeline_faults(launch: Callable, args_of: Callable[[List[str]], List[str]], want: Dict[int, Dict[str, str]],
                          log_dir: Path, iters: int = 12) -> None:
    """P = 2 x D = 2 on 4 ranks (replica r = ranks r and 2 + r), approximations off: the last stage of
    replica 1 (rank 3) is SIGKILLed in the backward of step 4, its first stage leaves (exit 4),
    replica 0 covers and the restarted replica rejoins after step 8; in a second run the lead's last
    stage (rank 2, which prints the losses) hangs in step 4 and replica 1 prints the rest. Both give
    the fault-free lines `want` (`log_lines`) at every iteration, each logged once.

    Args:
        launch: (script args, **mecefo_launch options) -> the launcher's result, on the checkout.
        args_of: extra flags -> the script's arguments.
    """
    killed = launch(args_of(["--mecefo-log-dir", str(log_dir), "--mecefo-inject", "kill:3:4", "--mecefo-inject",
                             "hold:3:8", "--mecefo-inject", "hold:1:8"]),  # the job waits for both ranks of the replica
                    restart_after=1, timeout=300)
    assert killed.returncode == 0, killed.stdout[-6000:]
    assert "rank 1 (pid" in killed.stdout and "ended: exit code 4" in killed.stdout
    assert "generation 1: members [0, 2], cover {1: 0}" in killed.stdout
    for rank in (1, 3):
        events = [json.loads(line) for line in (log_dir / f"events_rank{rank}.jsonl").read_text().splitlines()]
        assert [e["step"] for e in events if e["event"] == "rejoined"] == [9]
    hung = launch(args_of(["--mecefo-inject", "hang:2:4", "--mecefo-collective-timeout-s", "5",
                           "--mecefo-agree-timeout-s", "20"]))
    assert hung.returncode == 0, hung.stdout[-4000:]
    assert "generation 1: members [1, 3], cover {0: 1}" in hung.stdout and "rank 2 is stopped (hung)" in hung.stdout
    for out in (killed, hung):
        assert_losses(out, want, iters)
        assert consumed(out.stdout)[iters] == iters * 4
    check_whole_and_identical(log_dir, dp=2, k=2, iters=iters, pp=2)
