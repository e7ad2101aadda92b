"""examples/pretrain_gpt/pretrain_gpt.py end to end: real processes under mecefo-launch."""

import json
import re
import sys

import pytest

from tests.helpers import ROOT, run_launcher

pytestmark = pytest.mark.dist

SMALL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
         "--micro-batch-size", "2", "--global-batch-size", "8", "--eval-iters", "2", "--log-interval", "1",
         "--lr-decay-style", "constant", "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
         "--mecefo-rank", "16", "--mecefo-heartbeat-timeout-s", "2"]
EXACT = ["--no-mecefo-skip-attention", "--no-mecefo-lowrank-ffn", "--mecefo-recompute-ffn", "never"]


def pretrain(tmp_path, nproc, *extra, expect=0):
    cmd = [sys.executable, "-m", "megatron_mecefo.elastic.launch", "--nproc-per-node", str(nproc), "--master-port", "0",
           str(ROOT / "examples/pretrain_gpt/pretrain_gpt.py"), *SMALL, *extra]
    proc = run_launcher(cmd, timeout=240)
    assert proc.returncode == expect, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def losses(out: str):
    return {int(m.group(1)): float(m.group(2)) for m in re.finditer(r"iteration\s+(\d+)/\s*\d+ .*?lm loss: (\S+) ", out)}


def valid_loss(out: str):
    return [float(x) for x in re.findall(r"validation loss at iteration \d+ \| lm loss value: (\S+) \|", out)]


def test_with_and_without_mecefo_train_the_same_model(tmp_path):
    plain = pretrain(tmp_path, 2, "--train-iters", "8", "--eval-interval", "4")
    exact = pretrain(tmp_path, 2, "--train-iters", "8", "--eval-interval", "4", "--mecefo", *EXACT)
    mecefo = pretrain(tmp_path, 2, "--train-iters", "8", "--eval-interval", "4", "--mecefo")
    vp, ve, vm = valid_loss(plain.stdout), valid_loss(exact.stdout), valid_loss(mecefo.stdout)
    assert len(vp) == 2 and vp[1] < vp[0]
    assert ve == pytest.approx(vp, rel=1e-5), "MeCeFO's runtime without failures = plain DeepSpeed data parallelism"
    assert vm == pytest.approx(vp, rel=1e-5), "no failure: MeCeFO changes nothing"


def test_injected_kill_is_absorbed(tmp_path):
    out = pretrain(tmp_path, 2, "--train-iters", "10", "--eval-interval", "10", "--mecefo", "--mecefo-inject", "kill:1:4",
                   "--mecefo-log-dir", str(tmp_path / "logs")).stdout
    assert "cover 1->0" in out
    assert sorted(losses(out)) == list(range(1, 11))
    steps = [json.loads(l) for l in (tmp_path / "logs" / "steps_rank0.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == list(range(10))
    assert all(s["samples"] == 8 for s in steps)
    assert steps[-1]["degraded"] and all(m[2] for m in steps[-1]["micro_batches"])


def test_checkpoint_resume_continues_the_same_loss_curve(tmp_path):
    full = losses(pretrain(tmp_path, 2, "--train-iters", "8", "--eval-interval", "100", "--mecefo").stdout)
    first = losses(pretrain(tmp_path, 2, "--train-iters", "4", "--eval-interval", "100", "--mecefo",
                            "--save", str(tmp_path / "ckpt")).stdout)
    rest = losses(pretrain(tmp_path, 2, "--train-iters", "8", "--eval-interval", "100", "--mecefo",
                           "--load", str(tmp_path / "ckpt")).stdout)
    assert sorted(first) == [1, 2, 3, 4] and sorted(rest) == [5, 6, 7, 8]
    for it in range(1, 9):
        assert (first if it <= 4 else rest)[it] == full[it], it


def test_trains_on_a_preprocessed_file(tmp_path):
    from megatron_mecefo.data.preprocess import main as preprocess

    src = tmp_path / "docs.jsonl"
    src.write_text("\n".join(json.dumps({"text": f"document {i}: " + "the quick brown fox " * 20}) for i in range(60)))
    preprocess(["--input", str(src), "--output-prefix", str(tmp_path / "data" / "docs")])
    out = pretrain(tmp_path, 1, "--train-iters", "6", "--eval-interval", "6", "--mecefo",
                   "--data-path", str(tmp_path / "data" / "docs"), "--split", "90,10,0").stdout
    v = valid_loss(out)
    assert len(v) == 1 and v[0] < 5.0


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--data-path", "/nonexistent/corpus"], "not found; create it with"),
        (["--mecefo", "--mecefo-rank", "0"], "--mecefo-rank must be an integer >= 1"),
        (["--mecefo", "--deepspeed_config", "ZERO1"], '"zero_optimization.stage"=1 is not supported with MeCeFO'),
        (["--mecefo", "--mecefo-rank", "64"], "mecefo.rank=64 is out of range for FFN weight"),
    ],
)
def test_bad_input_stops_before_training(tmp_path, extra, message):
    if "ZERO1" in extra:
        cfg = tmp_path / "ds.json"
        cfg.write_text(json.dumps({"zero_optimization": {"stage": 1}}))
        extra = [str(cfg) if x == "ZERO1" else x for x in extra]
    proc = pretrain(tmp_path, 1, "--train-iters", "5", *extra, expect=2)
    assert message in proc.stderr
    assert "iteration" not in proc.stdout
