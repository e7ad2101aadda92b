"""The MeCeFO DeepSpeed hook with a tiny Megatron-Core GPT (MeCeFO spec), 3 real processes."""

import json
import sys
from pathlib import Path

import pytest
import torch

from megatron_mecefo.config import MeCeFOConfig
from tests.helpers import run_launcher

ROOT = Path(__file__).resolve().parents[2]
FAST = ["--mecefo-collective-timeout-s", "10", "--mecefo-heartbeat-interval-s", "0.2",
        "--mecefo-heartbeat-timeout-s", "1.5", "--mecefo-agree-timeout-s", "40"]
EXACT = ["--no-mecefo-skip-attention", "--no-mecefo-lowrank-ffn", "--mecefo-recompute-ffn", "never"]
STEPS = 6


def run(out, *extra, restart_after=None, world=3, steps=STEPS):
    cmd = [sys.executable, "-m", "megatron_mecefo.elastic.launch", "--nproc-per-node", str(world), "--master-port", "0"]
    if restart_after is not None:
        cmd += ["--restart-failed-after", str(restart_after)]
    cmd += [str(ROOT / "examples/tiny_gpt/train.py"), "--out", str(out), "--steps", str(steps), *FAST, *extra]
    proc = run_launcher(cmd, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def summaries(out, ranks):
    return {r: json.loads((out / f"final_rank{r}.json").read_text()) for r in ranks}


def steps(out, world=3):
    recs = {}
    for r in range(world):
        p = out / f"steps_rank{r}.jsonl"
        if p.exists():
            for rec in map(json.loads, p.read_text().splitlines()):
                recs.setdefault(rec["step"], []).append(rec)
    return recs


def check_accounting(out, world=3, k=2, n_steps=STEPS):
    recs = steps(out, world)
    assert sorted(recs) == list(range(n_steps))
    for step, rs in recs.items():
        mbs = sorted((m[0], m[1]) for r in rs for m in r["micro_batches"])
        assert mbs == [(d, j) for d in range(world) for j in range(k)], (step, mbs)
        assert all(r["samples"] == world * k * 2 for r in rs)
    return recs


pytestmark = [pytest.mark.dist]


def check_replicas_identical_every_step(out):
    for step, rs in steps(out).items():
        assert len({r["param_sha256"] for r in rs}) == 1, f"replicas differ at the start of step {step}"


@pytest.mark.fault
@pytest.mark.parametrize("phase", ["backward", "optimizer"])
def test_kill_with_mecefo_covering(tmp_path, phase):
    """A kill mid-backward (the covering layers' own injection point) and after the commit (the
    gated optimizer step). The step driver's other points are killed in this host by
    test_fold_is_exact_with_approximations_off (allreduce), and in all four phases on the bare
    runtime (tests/elastic) and in both upstream checkouts (the record tests)."""
    run(tmp_path, "--mecefo-inject", f"kill:1:2:{phase}", "--hash-params")
    check_replicas_identical_every_step(tmp_path)
    s = summaries(tmp_path, [0, 2])
    assert s[0]["steps"] == s[2]["steps"] == STEPS
    assert s[0]["param_sha256"] == s[2]["param_sha256"] and s[0]["opt_sha256"] == s[2]["opt_sha256"]
    assert torch.isfinite(torch.tensor(s[0]["last_loss"]))
    recs = check_accounting(tmp_path)
    covering = {r["rank"]: r for r in recs[STEPS - 1]}[2]
    assert covering["cover"] == {"1": 2}
    assert all(m[2] for m in covering["micro_batches"]), "the neighbour runs all its micro-batches in covering mode"


@pytest.mark.fault
def test_hang_in_deepspeed(tmp_path):
    run(tmp_path, "--mecefo-inject", "hang:2:3:backward", "--hash-params")
    check_replicas_identical_every_step(tmp_path)
    s = summaries(tmp_path, [0, 1])
    assert s[0]["param_sha256"] == s[1]["param_sha256"] and s[0]["steps"] == STEPS
    recs = check_accounting(tmp_path)
    assert {r["rank"]: r for r in recs[STEPS - 1]}[0]["cover"] == {"2": 0}


@pytest.mark.fault
def test_fold_is_exact_with_approximations_off(tmp_path):
    run(tmp_path / "ff", *EXACT)
    run(tmp_path / "kill", *EXACT, "--mecefo-inject", "kill:1:3:allreduce")
    ref = torch.load(tmp_path / "ff" / "final_rank0.pt")
    check_accounting(tmp_path / "kill")
    for r in (0, 2):
        got = torch.load(tmp_path / "kill" / f"final_rank{r}.pt")
        for name in ref:
            torch.testing.assert_close(got[name], ref[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.fault
def test_rejoin_restores_model_and_optimizer(tmp_path):
    n = 8  # the job holds at step 5 until the restarted rank asks to rejoin: step 5's commit admits it
    run(tmp_path, "--mecefo-inject", "kill:1:1:backward", "--mecefo-inject", "hold:1:5", "--hash-params",
        restart_after=0.5, steps=n)
    check_replicas_identical_every_step(tmp_path)
    s = summaries(tmp_path, [0, 1, 2])
    assert all(v["steps"] == n for v in s.values())
    assert len({v["param_sha256"] for v in s.values()}) == 1
    assert len({v["opt_sha256"] for v in s.values()}) == 1
    recs = check_accounting(tmp_path, n_steps=n)
    assert [sorted(r["rank"] for r in recs[s]) for s in range(1, 6)] == [[0, 2]] * 5, "degraded until the hold"
    assert [sorted(r["rank"] for r in recs[s]) for s in range(6, n)] == [[0, 1, 2]] * (n - 6), "the rank is back"
    assert not any(r["degraded"] for r in recs[n - 1])


def test_zero_stages_2_3_and_fp16_refused_before_training():
    cfg = MeCeFOConfig(enable=True)
    for stage in (2, 3):
        with pytest.raises(ValueError, match=rf'"zero_optimization.stage"={stage} is not supported with MeCeFO'):
            cfg.check_ds_config({"zero_optimization": {"stage": stage}})
    cfg.check_ds_config({"zero_optimization": {"stage": 1}})  # sharded over the live replicas (elastic/sharding/zero.py)
    with pytest.raises(ValueError, match="fp16"):
        cfg.check_ds_config({"fp16": {"enabled": True}})
    MeCeFOConfig(enable=False).check_ds_config({"zero_optimization": {"stage": 2}})  # plain training: untouched


def _tiny_gpt_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("tiny_gpt_train", ROOT / "examples/tiny_gpt/train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.fault
@pytest.mark.parametrize("case", ["paper", "floor_activation", "budget", "spread", "gradient"])
def test_degraded_step_applies_the_mecefo_gradient(tmp_path, megatron_world, case):
    """With the approximations on, the gradient the survivors apply at a degraded step is MeCeFO's,
    recomputed here in one process from the same weights and data: the covering rank's own and
    adopted micro-batches in covering mode, attention parameters averaged over the micro-batches
    with an exact attention backward only, every other parameter over the whole global batch.

    "paper": 3 ranks, one killed (the paper's rule). "floor_activation": 4 ranks, two killed in one
    step, so both survivors cover and the paper's rule would leave attention no gradient; with
    attention_floor 0.5 each survivor keeps its own micro-batches' attention backward, and the
    low-rank FFN gradient takes each micro-batch's own input directions (basis "activation").
    "budget": 3 ranks, one killed, covering_budget 1.6: with the default costs (a covering
    micro-batch 0.55 of an exact one) the covering rank approximates its two adopted micro-batches
    and keeps its own two exact, 1.45 normal steps; the attention divisor follows from the plan.
    "spread": 4 ranks, one killed, cover "spread": the two lost micro-batches go to two survivors
    (ring order from the failed replica), each approximating one own and the adopted one (2.1
    exact-micro-batch costs each, under the paper's 2.2), the third runs exact. "gradient": 3 ranks, one killed,
    basis "gradient" with tau 100: every covering step projects on the aggregated gradient of step 1,
    the last step without covering."""

    from megatron_mecefo.elastic import Grid, fold_neighbor, ring_cover, sample_range
    from megatron_mecefo.testing.reference import reference_gradient
    from megatron_mecefo.elastic.plan.cover_plan import Costs, plan_cover
    from megatron_mecefo.params import GradGroup, grad_group

    step = 4  # the survivors cover from step 2; with tau = 2 the weight basis is recomputed at step 4 from these weights
    if case == "paper":
        world, survivors, options, extra = 3, [0, 2], {}, ["--mecefo-inject", "kill:1:2:backward"]
    elif case == "budget":
        world, survivors, options = 3, [0, 2], {"covering_budget": 1.6}
        extra = ["--mecefo-inject", "kill:1:2:backward", "--mecefo-covering-budget", "1.6"]
    elif case == "spread":
        world, survivors, options = 4, [0, 2], {"cover": "spread"}
        extra = ["--mecefo-inject", "kill:1:2:backward", "--mecefo-cover", "spread"]
    elif case == "gradient":
        world, survivors, options = 3, [0, 2], {"basis": "gradient", "tau": 100}
        extra = ["--mecefo-inject", "kill:1:2:backward", "--mecefo-basis", "gradient", "--mecefo-tau", "100",
                 "--dump-step", "1"]
    else:
        world, survivors, options = 4, [0, 2], {"attention_floor": 0.5, "basis": "activation"}
        extra = ["--mecefo-inject", "kill:1:2:backward", "--mecefo-inject", "kill:3:2:backward",
                 "--mecefo-attention-floor", "0.5", "--mecefo-basis", "activation"]
    run(tmp_path, *extra, "--dump-step", str(step), world=world)
    dumps = {r: torch.load(tmp_path / f"dump_rank{r}_step{step}.pt") for r in survivors}
    for name, g in dumps[0]["grads"].items():
        assert torch.equal(g, dumps[2]["grads"][name]), name

    train = _tiny_gpt_module()
    model = train.build_model()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(dumps[0]["params"][name])
    cfg = MeCeFOConfig(enable=True, **{**train.MECEFO, **options})
    if case == "gradient":  # the projectors see step 1's aggregate (clipped: the same singular vectors)
        from megatron_mecefo.approx.projector import observe_gradients

        step1 = torch.load(tmp_path / "dump_rank0_step1.pt")["grads"]
        for name, p in model.named_parameters():
            p.grad = step1[name].clone()
        assert observe_gradients(model, cfg.cover_policy(1), 1, exact=True) == 2 * 2  # fc1 and fc2 of 2 layers
    live = [r for r in range(world) if r != 1] if case == "spread" else survivors
    fold = fold_neighbor(ring_cover(Grid(dp=world), live), 2, attention_floor=cfg.attention_floor)
    # the healthy replicas' k each (two of them at 4 ranks) / the floor: half of 4 x k
    assert fold.divisor_mha == (4 if case in ("floor_activation", "spread") else 2)
    records = {r["rank"]: r for r in steps(tmp_path, world)[step]}
    if case in ("budget", "spread"):  # the plan every member derived from the agreed (default) costs
        fold = plan_cover(ring_cover(Grid(dp=world), live), 2, Costs(), policy=cfg.cover,
                          target=None if case == "spread" else 1.6 * 2).fold
        for r in live:
            assert records[r]["micro_batches"] == [[m.replica, m.index, m.covering] for m in fold.assignments[r]]
            assert records[r]["divisor_mha"] == fold.divisor_mha
    if case == "budget":  # rank 2's own two micro-batches exact, the adopted two covering
        assert records[2]["micro_batches"] == [[2, 0, False], [2, 1, False], [1, 0, True], [1, 1, True]]
        assert fold.divisor_mha == 4
    if case == "spread":  # replica 1's two micro-batches on two survivors, each with one own approximated
        assert records[2]["micro_batches"] == [[2, 0, False], [2, 1, True], [1, 0, True]]
        assert records[3]["micro_batches"] == [[3, 0, False], [3, 1, True], [1, 1, True]]
        assert records[0]["micro_batches"] == [[0, 0, False], [0, 1, False]] and fold.divisor_mha == 4

    def loss_of(m):
        tokens, pos, labels = train.batch(sample_range(step, m.replica, m.index, micro_batch_size=2, dp=world, k=2))
        return model(tokens, pos, None, labels=labels).float().mean()

    flat = lambda d: torch.cat([v.flatten() for v in d.values()])  # noqa: E731
    expected, exact = reference_gradient(model, fold, loss_of, cfg.cover_policy(step)), reference_gradient(model, fold, loss_of)
    clip = min(1.0, 1.0 / (torch.linalg.norm(flat(expected)).item() + 1e-6))  # DeepSpeed's default gradient_clipping 1.0
    for name, g in dumps[0]["grads"].items():
        torch.testing.assert_close(g, expected[name] * clip, rtol=1e-4, atol=1e-6, msg=name)
    exact = {name: g * min(1.0, 1.0 / (torch.linalg.norm(flat(exact)).item() + 1e-6)) for name, g in exact.items()}
    err = (torch.linalg.norm(flat(dumps[0]["grads"]) - flat(exact)) / torch.linalg.norm(flat(exact))).item()
    assert err > 0.05, "the covering rank approximated: the applied gradient is not the exact one"
    attention = [g for name, g in dumps[0]["grads"].items() if grad_group(dict(model.named_parameters())[name]) is GradGroup.MHA]
    assert attention and all(torch.linalg.norm(g) > 0 for g in attention), "attention learned from exact micro-batches"
