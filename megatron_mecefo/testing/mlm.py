"""Running an extracted, patched Megatron-LM snapshot (core_v0.16.1) in the tests, on CPU.

Megatron-LM's training loop needs CUDA. Its processes here get on PYTHONPATH a test-only shim
(fake_cuda/sitecustomize.py, on with MECEFO_TEST_FAKE_CUDA=1) that turns "cuda" devices into the
CPU, and the "mlm" extra's packages plus triton, which upstream imports at module level
($MECEFO_MLM_DEPS, installed by scripts/test.sh). The data is upstream's `--mock-data`.
"""

from __future__ import annotations

import os
import unittest
from pathlib import Path
from typing import Dict, List, Optional

from megatron_mecefo.testing import mds
from megatron_mecefo.testing.launch import ROOT
from megatron_mecefo.testing.mds import extract  # noqa: F401  (used as mlm.extract)

SNAPSHOT_GLOB = "Megatron-LM-*.tar.gz"
FAKE_CUDA = Path(__file__).resolve().parent / "fake_cuda"


def original_script() -> str:
    """upstream's pretrain_gpt.py, from the snapshot."""
    return mds.original_script(SNAPSHOT_GLOB)


def env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    deps = os.environ.get("MECEFO_MLM_DEPS")
    if not deps or not os.path.isdir(deps):
        raise unittest.SkipTest("Megatron-LM needs the mlm extra and triton: run the tests with scripts/test.sh")
    # CUDA_DEVICE_MAX_CONNECTIONS: upstream asserts it with tensor parallelism (its launch scripts set it)
    e = dict(os.environ, PYTHONPATH=os.pathsep.join([str(mds.NO_COMPILE), str(FAKE_CUDA), deps, str(ROOT)]), MECEFO_TEST_FAKE_CUDA="1",
             CUDA_DEVICE_MAX_CONNECTIONS="1",
             OMP_NUM_THREADS="1")
    if e.get("MECEFO_PRELOAD", "0") not in ("", "0"):  # upstream's script imports all it needs at its top
        e["MECEFO_PRELOAD"] = "script"
    e.update(extra or {})
    return e


def args(*, dp: int, tp: int = 1, iters: int = 10, micro_batches: int = 2, extra: List[str] = ()) -> List[str]:
    """A tiny GPT with the flags a user passes (on CPU: gloo, no fused kernels or gradient
    accumulation fusion) and upstream's mock data."""
    return ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "128",
            "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "1",
            "--global-batch-size", str(dp * micro_batches), "--train-iters", str(iters), "--lr-decay-iters", str(iters),
            "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2",
            "--weight-decay", "0.01", "--clip-grad", "1.0", "--seed", "1234", "--log-interval", "1",
            "--eval-interval", "5", "--eval-iters", "2", "--mock-data", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "1000", "--tensor-model-parallel-size", str(tp), "--transformer-impl", "local",
            "--no-gradient-accumulation-fusion", "--no-persist-layer-norm", "--no-masked-softmax-fusion",
            "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion", "--num-workers", "0",
            "--distributed-backend", "gloo", *extra]


def torchrun(checkout: Path, nproc: int, script_args: List[str], **kwargs):
    return mds.torchrun(checkout, nproc, script_args, env_of=env, **kwargs)


def mecefo_launch(checkout: Path, nproc: int, script_args: List[str], **kwargs):
    return mds.mecefo_launch(checkout, nproc, script_args, env_of=env, **kwargs)


def upstream_reference(checkout: Path, nproc: int, script_args: List[str], **kwargs):
    return mds.upstream_reference(checkout, nproc, script_args, env_of=env, **kwargs)


def prepare(root: Path) -> None:
    """Build upstream's dataset helpers once (every test's first rank would otherwise compile them)."""
    import subprocess

    subprocess.run(["make", "-C", str(root / "megatron" / "core" / "datasets")], env=env(), check=True,
                   capture_output=True)
    mds.compile_sources(root)
