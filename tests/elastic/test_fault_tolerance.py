"""Real fault tests: ranks of a data-parallel job are SIGKILLed or SIGSTOPped at exact points.

Each test launches megatron_mecefo/testing/toy_train.py under mecefo-launch (separate processes, gloo, a store
hosted by the launcher) and checks, from the files the ranks write:
* the job finishes (no hang) and the launcher exits 0 (or 3 when the failure cannot be absorbed);
* survivors end bit-identical (parameters and Adam state);
* with MeCeFO's approximations off, they equal a fault-free run on the same data (the fold and
  the gradient divisors are exact);
* every committed step consumed every micro-batch of the global batch exactly once.
"""

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest
import torch

import megatron_mecefo
from megatron_mecefo.testing import toy_train
from tests.helpers import run_launcher
from megatron_mecefo.testing.chaos_runs import TOY_SCRIPT

pytestmark = [pytest.mark.dist, pytest.mark.fault]

ROOT = Path(__file__).resolve().parents[2]
STEPS, K, MB = 10, 2, 4
EXACT = ["--mecefo", "--no-mecefo-skip-attention", "--no-mecefo-lowrank-ffn", "--mecefo-recompute-ffn", "never"]
FAST = ["--mecefo-collective-timeout-s", "4", "--mecefo-heartbeat-interval-s", "0.2",
        "--mecefo-heartbeat-timeout-s", "1.5", "--mecefo-agree-timeout-s", "30"]


def launch(out: Path, world: int, *extra: str, restart_after=None, timeout=150, spawn=False):
    cmd = [sys.executable, "-m", "megatron_mecefo.elastic.launch", "--nproc-per-node", str(world), "--master-port", "0",
           "--max-restarts", "10", *(["--no-preload"] if spawn else [])]
    if restart_after is not None:
        cmd += ["--restart-failed-after", str(restart_after)]
    cmd += [str(TOY_SCRIPT), "--out", str(out), "--steps", str(STEPS), "--k", str(K),
            "--mb", str(MB), *EXACT, *FAST, *extra]
    t0 = time.monotonic()
    proc = run_launcher(cmd, timeout)
    return proc, time.monotonic() - t0


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    out = {}
    for world in (3, 4):
        d = tmp_path_factory.mktemp(f"ref{world}")
        toy_train.reference(argparse.Namespace(steps=STEPS, k=K, mb=MB, world=world, out=d))
        out[world] = torch.load(d / "reference.pt", weights_only=False)
    return out


def finals(out: Path, ranks):
    return {r: torch.load(out / f"final_rank{r}.pt", weights_only=False) for r in ranks}


def step_records(out: Path, world: int):
    by_step = defaultdict(list)
    for r in range(world):
        path = out / f"steps_rank{r}.jsonl"
        if path.exists():
            for line in path.read_text().splitlines():
                rec = json.loads(line)
                by_step[rec["step"]].append(rec)
    return by_step


def check_run(out, world, survivors, reference, proc, silent=None):
    """`silent`: step -> ranks that died after committing it, before writing its record (the
    parameters, equal to the reference, show their micro-batches were in it)."""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    f = finals(out, survivors)
    first = f[survivors[0]]
    for r in survivors:
        assert f[r]["step"] == STEPS
        for a, b in zip(first["params"], f[r]["params"]):
            assert torch.equal(a, b), f"rank {r} diverged from rank {survivors[0]}"
        for sa, sb in zip(first["opt"]["state"].values(), f[r]["opt"]["state"].values()):
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(sa[key], sb[key]), (r, key)
    for a, b in zip(reference["params"], first["params"]):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    # accounting: every committed step consumed the global batch exactly once
    records = step_records(out, world)
    assert sorted(records) == list(range(STEPS))
    for step, recs in records.items():
        assert len({r["generation"] for r in recs}) == 1, (step, recs)
        mbs = sorted((m[0], m[1]) for r in recs for m in r["micro_batches"])
        mute = (silent or {}).get(step, ())
        assert mbs == [(d, j) for d in range(world) for j in range(K) if d not in mute], (step, mbs)
        assert all(r["samples"] == world * K * MB for r in recs)
        assert all(torch.isfinite(torch.tensor(r["loss"])) for r in recs)
    return records


def regroups(out: Path, rank: int):
    path = out / f"events_rank{rank}.jsonl"
    return [e for e in map(json.loads, path.read_text().splitlines()) if e["event"] == "regroup" and e["generation"] > 0]


def test_a_healthy_step_makes_at_most_two_store_calls_in_the_whole_job(tmp_path, references):
    """No failure, 4 ranks: the commit is the reduction's own confirmation, so a step touches the
    store only where one rank asks whether restarted ranks wait and marks the progress (each step
    record counts its rank's calls; heartbeats run on their own connection)."""
    proc, _ = launch(tmp_path, 4)
    records = check_run(tmp_path, 4, [0, 1, 2, 3], references[4], proc)
    per_step = {step: sum(r["store_calls"] for r in recs) for step, recs in records.items()}
    assert all(n <= 2 for n in per_step.values()), per_step
    assert all(r["store_calls"] == 0 for recs in records.values() for r in recs if r["rank"] != 0)


# "commit": after the rank's confirmation completed, so the others commit the step without it
@pytest.mark.parametrize("phase", ["forward", "backward", "allreduce", "commit", "optimizer"])
def test_kill_in_each_phase(tmp_path, references, phase):
    proc, _ = launch(tmp_path, 3, "--mecefo-inject", f"kill:1:4:{phase}")
    assert "killed by SIGKILL" in proc.stderr
    records = check_run(tmp_path, 3, [0, 2], references[3], proc, silent={4: [1]} if phase == "commit" else None)
    # after the failure rank 2 covers rank 1's micro-batches
    last = {r["rank"]: r for r in records[STEPS - 1]}
    assert set(last) == {0, 2} and last[2]["cover"] == {"1": 2} and last[2]["degraded"]
    assert [m[:2] for m in last[2]["micro_batches"]] == [[2, 0], [2, 1], [1, 0], [1, 1]]
    (event,) = regroups(tmp_path, 0)
    assert event["members"] == [0, 2]
    assert event["agree_s"] < 2.0, event  # the launcher reports the crash: no heartbeat wait


def test_hang_is_detected_within_the_collective_timeout(tmp_path, references):
    proc, _ = launch(tmp_path, 3, "--mecefo-inject", "hang:1:3:backward")
    assert "is stopped (hung)" in proc.stderr
    check_run(tmp_path, 3, [0, 2], references[3], proc)
    (event,) = regroups(tmp_path, 0)
    assert event["members"] == [0, 2]
    # detection takes the collective timeout (4 s), agreement waits out the heartbeat (1.5 s), then
    # step 3 is redone: far from torch's 30-minute default
    t = {s["step"]: s["time"] for s in map(json.loads, (tmp_path / "steps_rank0.jsonl").read_text().splitlines())}
    assert 4.0 <= t[3] - t[2] < 4.0 + 1.5 + 3.0, t


def test_two_failures_get_different_neighbours(tmp_path, references):
    proc, _ = launch(tmp_path, 4, "--mecefo-inject", "kill:1:2:backward", "--mecefo-inject", "kill:2:6:allreduce")
    records = check_run(tmp_path, 4, [0, 3], references[4], proc)
    last = {r["rank"]: r for r in records[STEPS - 1]}
    assert last[0]["cover"] == {"1": 3, "2": 0}
    assert {tuple(m[:2]) for m in last[0]["micro_batches"]} == {(0, 0), (0, 1), (2, 0), (2, 1)}


def test_failure_during_recovery(tmp_path, references):
    # rank 1 crashes; rank 2 dies while the survivors agree on the next generation
    proc, _ = launch(tmp_path, 4, "--mecefo-inject", "kill:1:3:allreduce", "--mecefo-inject", "kill:2:3:recovery")
    assert "rank 2: kill at step 3 (recovery)" in proc.stderr
    records = check_run(tmp_path, 4, [0, 3], references[4], proc)
    assert {r["rank"] for r in records[STEPS - 1]} == {0, 3}
    assert regroups(tmp_path, 0)[-1]["members"] == [0, 3]


@pytest.mark.parametrize("spawn", [False, True], ids=["forked", "spawned"])
def test_rejoin_after_restart(tmp_path, references, spawn):
    # the job holds at step 7 until rank 1 is back, however long its restart takes; step 7's commit admits it
    proc, _ = launch(tmp_path, 3, "--mecefo-inject", "kill:1:2:backward", "--mecefo-inject", "hold:1:7",
                     restart_after=0.5, spawn=spawn)
    records = check_run(tmp_path, 3, [0, 1, 2], references[3], proc)
    gens = [sorted(r["rank"] for r in records[s]) for s in range(STEPS)]
    assert gens[2:8] == [[0, 2]] * 6, "degraded from the crash until the hold's step"
    assert gens[8:] == [[0, 1, 2]] * 2, "the restarted rank is back from the step after the hold"
    assert not any(r["degraded"] for r in records[STEPS - 1]), "covering stopped"
    events = [json.loads(l) for l in (tmp_path / "events_rank1.jsonl").read_text().splitlines()]
    assert any(e["event"] == "rejoined" for e in events)
    for rank in range(3):  # an old generation's group is freed at each regroup, the rejoin's included
        events = [json.loads(l) for l in (tmp_path / f"events_rank{rank}.jsonl").read_text().splitlines()]
        alive = [e["groups_alive"] for e in events if e["event"] == "regroup"]
        assert len(alive) >= 2 and set(alive) == {1}, (rank, alive)
        # mecefo-launch gave every incarnation NCCL's recovery settings (nccl_env.py)
        for e in (e for e in events if e["event"] == "started"):
            assert e["nccl_env"]["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2", e
            assert e["nccl_env"]["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0" and e["nccl_env"]["NCCL_NVLS_ENABLE"] == "0", e
            assert e["nccl_version"] is None and e["nccl_warnings"] == [], e  # gloo: no NCCL version to check
            assert e["version"] == megatron_mecefo.__version__, e  # a bug report says which version ran


def test_an_abort_that_never_returns_retires_the_rank(tmp_path, references):
    """NCCL's abort can hang: rank 1's abort of the broken generation's group never returns. It
    leaves after the bound (the collective timeout, 4 s), as a rank left out of a generation does,
    and the others finish exactly without it and without the killed rank 3."""
    proc, _ = launch(tmp_path, 4, "--mecefo-inject", "kill:3:3:allreduce", "--abort-hangs", "1")
    check_run(tmp_path, 4, [0, 2], references[4], proc)
    events = [json.loads(l) for l in (tmp_path / "events_rank1.jsonl").read_text().splitlines()]
    (retired,) = [e for e in events if e["event"] == "retired"]
    assert "did not return within 4 s" in retired["reason"], retired
    assert regroups(tmp_path, 0)[-1]["members"] == [0, 2]


def test_no_neighbour_left_checkpoints_and_exits(tmp_path):
    proc, elapsed = launch(tmp_path, 3, "--mecefo-inject", "kill:1:3:backward", "--mecefo-inject", "kill:2:3:backward")
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "has no healthy neighbour left" in proc.stderr and "checkpoint of the last committed step written to" in proc.stderr
    ckpt = torch.load(tmp_path / "checkpoint_rank0.pt", weights_only=False)
    assert ckpt["step"] == 3
    assert elapsed < 60


def test_trace_driven_failures_and_rejoins(tmp_path):
    from megatron_mecefo.elastic.faults.inject import failure_trace

    steps = 30
    trace = {"mtbf_steps": 7, "recovery_steps": 4, "seed": 3}
    expected = failure_trace(4, steps, 7, 4, 3)
    assert len(expected) >= 3
    # the job holds at each rejoin step for the restarted rank: the trace plays out as written
    cmd_extra = ["--steps", str(steps), "--mecefo-trace", json.dumps(trace)]
    proc, _ = launch(tmp_path, 4, *cmd_extra, restart_after=0.2, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    fired = proc.stderr.count("[mecefo inject]")
    assert fired == len([e for e in expected if e.fail_step < steps]), proc.stderr[-3000:]
    records = step_records(tmp_path, 4)
    for e in expected:  # down from its failure through its rejoin step, a member again right after
        members = {s: {r["rank"] for r in records[s]} for s in range(steps)}
        assert all(e.rank not in members[s] for s in range(e.fail_step, min(e.rejoin_step + 1, steps))), e
        if e.rejoin_step + 1 < steps:
            assert e.rank in members[e.rejoin_step + 1], e
    assert sorted(records) == list(range(steps))
    for step, recs in records.items():
        mbs = sorted((m[0], m[1]) for r in recs for m in r["micro_batches"])
        assert mbs == [(d, j) for d in range(4) for j in range(K)], (step, mbs)
    degraded = sum(any(r["degraded"] for r in recs) for recs in records.values())
    assert degraded >= 4
    final_members = sorted(r["rank"] for r in records[steps - 1])
    f = finals(tmp_path, final_members)
    for r in final_members:
        for a, b in zip(f[final_members[0]]["params"], f[r]["params"]):
            assert torch.equal(a, b)


def test_a_late_starter_joins_instead_of_blocking_the_start(tmp_path, references):
    # rank 2 starts once the others have agreed on generation 0 without it (its deadline passed)
    proc, _ = launch(tmp_path, 3, "--late-rank", "2", "--mecefo-agree-timeout-s", "5",
                     "--mecefo-inject", "hold:2:5:0")  # the job waits for it at step 5 (incarnation 0: a late starter)
    records = check_run(tmp_path, 3, [0, 1, 2], references[3], proc)
    assert sorted(r["rank"] for r in records[0]) == [0, 1]
    assert records[0][0]["cover"] == {"2": 0}
    # the hold pins its rejoin: it asks once step 4 committed, and the job waits at step 5 until it
    # has, however fast or slow it started; step 5's commit admits it
    assert [sorted(r["rank"] for r in records[s]) for s in (5, 6)] == [[0, 1], [0, 1, 2]]


def test_a_step_without_the_whole_global_batch_is_never_committed(tmp_path, references):
    """A loop that leaves out a micro-batch: the step is refused (IncompleteStep), not committed with
    fewer samples; the job ends with exit 3 and a checkpoint of the last whole step."""
    proc, _ = launch(tmp_path, 3, "--skip-micro-batch", "1:4")
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "the members ran 5 of the 6 micro-batches of the global batch" in proc.stderr
    assert sorted(step_records(tmp_path, 3)) == [0, 1, 2, 3]
    ckpt = [p for p in tmp_path.glob("checkpoint_rank*.pt")]
    assert len(ckpt) == 1 and torch.load(ckpt[0], weights_only=False)["step"] == 4
