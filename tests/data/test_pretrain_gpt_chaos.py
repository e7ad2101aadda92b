"""examples/pretrain_gpt under compound failures (the reproducers of the compound-failures issue)."""

import json
import re
import sys

import pytest

from megatron_mecefo.testing import chaos
from megatron_mecefo.testing.chaos import Fault, Schedule
from tests.helpers import ROOT, run_launcher

pytestmark = [pytest.mark.dist, pytest.mark.fault]

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
         "--micro-batch-size", "2", "--global-batch-size", "16", "--lr", "1e-3", "--eval-iters", "2",
         "--mecefo", "--mecefo-rank", "8", "--mecefo-collective-timeout-s", "5", "--mecefo-heartbeat-timeout-s", "2",
         "--mecefo-agree-timeout-s", "20", "--mecefo-log-param-hash"]


def launch(tmp_path, launcher_args, *args, nproc=4, timeout=420):
    cmd = [sys.executable, "-m", "megatron_mecefo.elastic.launch", "--nproc-per-node", str(nproc), "--master-port", "0",
           *launcher_args, str(ROOT / "examples/pretrain_gpt/pretrain_gpt.py"),
           "--deepspeed_config", str(ROOT / "examples/pretrain_gpt/ds_config.json"), *MODEL,
           "--mecefo-log-dir", str(tmp_path), *args]
    return run_launcher(cmd, timeout)


def iterations(out):
    return [int(m) for m in re.findall(r"iteration\s+(\d+)/", out)]


def finishes(tmp_path, schedule, restart_after):
    """Run `schedule` to the end; the chaos invariants hold and every iteration ran."""
    proc = launch(tmp_path, ["--restart-failed-after", str(restart_after)], "--train-iters", str(schedule.steps),
                  "--eval-interval", str(schedule.steps), "--log-interval", "20", *schedule.flags())
    result = chaos.RunResult(proc.returncode, 0.0, proc.stdout, proc.stderr)
    outcome, bad = chaos.check_run(result, tmp_path, schedule, k=2, bound_s=1e9)
    assert not bad, "\n".join(bad) + proc.stderr[-4000:]
    assert outcome == "finished" and proc.returncode == 0
    assert iterations(proc.stdout)[-1] == schedule.steps
    return proc


def test_restarted_rank_caught_in_a_recovery(tmp_path):
    """The issue's reproducer, made independent of timing: rank 0 killed at 8 and restarted; rank 2
    hangs right after the commit that decides to admit rank 0 (so the admission must first agree
    without it); rank 3 is killed in the middle of handing rank 0 the state. Rank 1 keeps the job
    alive, rank 0 is admitted only with the state, and every step is whole and bit-identical."""
    faults = (Fault("kill", 0, 8, "optimizer"), Fault("hold", 0, 12, "forward", 1), Fault("hang", 2, "*", "admit"),
              Fault("kill", 3, "*", "transfer"))
    proc = finishes(tmp_path, Schedule(0, 4, 20, faults, 1.0), restart_after=1)
    assert "validation loss at iteration 20" in proc.stdout
    hang = re.search(r"rank 2: hang at step (\d+) \(admit\)", proc.stderr)
    kill = re.search(r"rank 3: kill at step (\d+) \(transfer\)", proc.stderr)
    assert hang and kill, "rank 2 hung when rank 0's admission was decided; rank 3 died handing it the state"
    assert int(kill.group(1)) == int(hang.group(1)) + 1, "both in the generation admitting rank 0"
    # every regroup that brought rank 0 back handed it the state of the step it then trained
    joins = [e for e in chaos.events(tmp_path, 4, "regroup") if 0 in e["joiners"]]
    assert joins and all(e["step"] > 8 for e in joins)
    first_after = min(r["step"] for r in (json.loads(l) for l in (tmp_path / "steps_rank0.jsonl").read_text().splitlines())
                      if r["step"] > 8)
    assert first_after == joins[-1]["step"]


def test_last_survivor_gives_up_with_a_checkpoint_that_resumes(tmp_path):
    """Rank 3 hangs, ranks 0 and 1 are killed: rank 2 alone cannot cover three replicas. It writes a
    DeepSpeed checkpoint of the last committed step to --save and every rank exits 3; the launcher
    restarts nobody and exits 3 naming the reason. `--load` resumes from there on one rank (the
    same global batch in 8 micro-batches per step instead of 2)."""
    save = tmp_path / "ckpt"
    faults = (Fault("hang", 3, 10, "backward"), Fault("kill", 0, 15, "forward"), Fault("kill", 1, 20, "backward"))
    schedule = Schedule(0, 4, 30, faults, None)
    proc = launch(tmp_path, [], "--train-iters", "30", "--eval-interval", "30", "--log-interval", "5",
                  "--save", str(save), *schedule.flags())
    result = chaos.RunResult(proc.returncode, 0.0, proc.stdout, proc.stderr)
    outcome, bad = chaos.check_run(result, tmp_path, schedule, k=2, bound_s=1e9)
    assert not bad and outcome == "gave_up", "\n".join(bad) + proc.stderr[-4000:]
    assert proc.returncode == 3
    assert "the job gave up: " in proc.stderr and "has no healthy neighbour left" in proc.stderr
    assert f"checkpoint of step 20 at {save / 'global_step20'}" in proc.stderr
    assert "will restart" not in proc.stderr
    assert (save / "latest").read_text() == "global_step20"
    resumed = launch(tmp_path / "resume", [], "--train-iters", "25", "--eval-interval", "25", "--log-interval", "1",
                     "--load", str(save), nproc=1)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert iterations(resumed.stdout) == [21, 22, 23, 24, 25]


def test_donor_killed_during_a_state_transfer(tmp_path):
    """Rank 1 is killed and restarted; when the survivors admit it, the donor (rank 0, the lowest
    state holder) is killed in the middle of sending it the state. The receivers form the next
    generation (rank 2 sends the state instead), rank 0 comes back too, and every step is whole."""
    faults = (Fault("kill", 1, 8, "backward"), Fault("hold", 1, 12, "forward", 1), Fault("kill", 0, "*", "transfer"),
              Fault("hold", 0, 16, "forward", 1))
    proc = finishes(tmp_path, Schedule(0, 4, 20, faults, 1.0), restart_after=1)
    assert re.search(r"rank 0: kill at step \d+ \(transfer\)", proc.stderr), "the donor died mid-transfer"
    regroups = chaos.events(tmp_path, 4, "regroup")
    received = [e for e in regroups if 1 in e["joiners"] and 0 not in e["members"]]
    assert received, "rank 1 received the state in a generation without the dead donor"
    assert any(0 in e["joiners"] for e in regroups), "the donor came back too"
