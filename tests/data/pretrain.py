"""Running examples/pretrain_gpt/pretrain_gpt.py in the tests: tiny flags, a launcher, log parsing."""

import re
import sys

from tests.helpers import ROOT, run_launcher

SMALL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
         "--micro-batch-size", "2", "--global-batch-size", "8", "--eval-iters", "2", "--log-interval", "1",
         "--lr-decay-style", "constant", "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
         "--mecefo-rank", "16", "--mecefo-heartbeat-timeout-s", "2"]


def spawn_if_refused(expect: int) -> list:
    """Launcher flags for a run expected to end with bad input (exit 2): the example refuses it
    before its heavy imports, so a preloaded parent would import them for nothing."""
    return ["--no-preload"] if expect == 2 else []


def pretrain(tmp_path, nproc, *extra, expect=0):
    cmd = [sys.executable, "-m", "megatron_mecefo.elastic.launch", "--nproc-per-node", str(nproc), "--master-port", "0",
           *spawn_if_refused(expect), str(ROOT / "examples/pretrain_gpt/pretrain_gpt.py"), *SMALL, *extra]
    proc = run_launcher(cmd, timeout=240)
    assert proc.returncode == expect, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def losses(out: str):
    return {int(m.group(1)): float(m.group(2)) for m in re.finditer(r"iteration\s+(\d+)/\s*\d+ .*?lm loss: (\S+) ", out)}


def valid_loss(out: str):
    return [float(x) for x in re.findall(r"validation loss at iteration \d+ \| lm loss value: (\S+) \|", out)]
