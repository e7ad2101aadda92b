"""Resuming examples/pretrain_gpt/pretrain_gpt.py: --load with a kill and a rejoin, dropout runs on
the same loss curve (RNG state in the checkpoint), and checkpoints that are not plain data."""

import json
import sys

import pytest

from tests.data.pretrain import SMALL, losses, pretrain
from tests.helpers import ROOT, run_launcher

pytestmark = pytest.mark.dist

DROPOUT = ["--hidden-dropout", "0.2", "--attention-dropout", "0.2"]


def test_dropout_run_resumes_on_the_same_loss_curve(tmp_path):
    """An 8-iteration run saves at iterations 4 and 8; rolled back to iteration 4 (DeepSpeed's `latest`
    file names the checkpoint to load), a rerun logs iterations 5..8 with the same losses. With dropout
    on, that needs the model, optimizer, scheduler and RNG states all restored (without the RNG state
    the resumed run draws other dropout masks)."""
    for name, mecefo in (("mecefo", ["--mecefo"]), ("plain", [])):  # plain DeepSpeed saves and loads the same way
        ckpt = str(tmp_path / name)
        common = ["--train-iters", "8", "--eval-interval", "100", *mecefo, *DROPOUT]
        full = losses(pretrain(tmp_path, 2, *common, "--save", ckpt, "--save-interval", "4").stdout)
        (tmp_path / name / "latest").write_text("global_step4")
        (tmp_path / name / "latest_checkpointed_iteration.txt").write_text("4")
        rest = losses(pretrain(tmp_path, 2, *common, "--load", ckpt).stdout)
        assert sorted(full) == list(range(1, 9)) and sorted(rest) == [5, 6, 7, 8], name
        assert [rest[i] for i in range(5, 9)] == [full[i] for i in range(5, 9)], name


@pytest.mark.fault
def test_load_then_a_kill_and_a_rejoin_finish_with_every_step_whole(tmp_path):
    """The issue's reproducer: checkpoint at step 4, rerun with --load, rank 1 killed at step 8 and
    restarted. Before, the restarted rank loaded the checkpoint over the live state it had received
    and the job hung, then exited 1."""
    pretrain(tmp_path, 2, "--train-iters", "4", "--eval-interval", "100", "--mecefo", "--save", str(tmp_path / "ckpt"))
    logs = tmp_path / "logs"
    cmd = [sys.executable, "-m", "megatron_mecefo.elastic.launch", "--nproc-per-node", "2", "--master-port", "0",
           "--restart-failed-after", "1", str(ROOT / "examples/pretrain_gpt/pretrain_gpt.py"), *SMALL,
           "--train-iters", "20", "--eval-interval", "20", "--log-interval", "5", "--mecefo", "--load", str(tmp_path / "ckpt"),
           "--mecefo-inject", "kill:1:8", "--mecefo-inject", "hold:1:14", "--mecefo-log-dir", str(logs),
           "--mecefo-log-param-hash",
           "--mecefo-agree-timeout-s", "15", "--mecefo-collective-timeout-s", "10"]
    proc = run_launcher(cmd, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    events = [json.loads(l) for l in (logs / "events_rank1.jsonl").read_text().splitlines()]
    rejoined = [e for e in events if e["event"] == "rejoined"]
    assert rejoined and rejoined[0]["step"] == 15, "rank 1 rejoined with the live state, not the checkpoint's"
    steps = {r: [json.loads(l) for l in (logs / f"steps_rank{r}.jsonl").read_text().splitlines()] for r in (0, 1)}
    assert [s["step"] for s in steps[0]] == list(range(4, 20))
    assert all(s["samples"] == 8 for s in steps[0])
    assert [s["step"] for s in steps[1]] == list(range(4, 8)) + list(range(15, 20))
    hashes = {s["step"]: s["param_sha256"] for s in steps[0]}
    assert all(s["param_sha256"] == hashes[s["step"]] for s in steps[1]), "replicas identical before and after"


def test_a_checkpoint_that_is_not_plain_data_is_refused(tmp_path):
    """Loading unpickles with weights_only: a file that would run code on load is refused."""
    import torch

    pretrain(tmp_path, 1, "--train-iters", "2", "--eval-interval", "100", "--mecefo", "--save", str(tmp_path / "ckpt"))
    target = tmp_path / "ckpt" / "global_step2" / "mp_rank_00_model_states.pt"
    state = torch.load(target, weights_only=True)
    marker = tmp_path / "pwned"
    state["extra"] = _RunsCode(str(marker))
    torch.save(state, target)
    proc = pretrain(tmp_path, 1, "--train-iters", "4", "--eval-interval", "100", "--mecefo",
                    "--load", str(tmp_path / "ckpt"), expect=2)
    assert "holds more than tensors and plain containers" in proc.stderr
    assert not marker.exists() and "iteration" not in proc.stdout


class _RunsCode:
    """Unpickling this creates a file: what an untrusted checkpoint could do."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))
