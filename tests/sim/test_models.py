"""The simulator against the analytic models it must reproduce (seconds, no torch)."""

import math
import subprocess
import sys

import pytest

from megatron_mecefo.elastic.plan.topology import Grid
from megatron_mecefo.sim import trace as tr
from megatron_mecefo.sim.checkpoint_restart import CheckpointRestart, daly_interval, daly_segment_time
from megatron_mecefo.sim.engine import simulate
from megatron_mecefo.sim.mecefo import MeCeFO

pytestmark = pytest.mark.unit
H = tr.HOUR


def test_checkpoint_restart_matches_dalys_expected_time_per_segment():
    """Monte Carlo over a long Poisson trace: wall time per completed segment within 1 % of Daly's E[T]."""
    m, w, u = 1.0 * H, 60.0, 300.0
    interval = daly_interval(w, m)
    horizon = 20_000 * H
    trace = tr.poisson(domains=32, horizon_s=horizon, repair=tr.Repair(60.0), seed=1, mtbf_hours=1.0)
    out = CheckpointRestart(interval, w, u).run(trace, horizon)
    per_segment = horizon / out.segments
    assert per_segment == pytest.approx(daly_segment_time(interval, w, u, m), rel=0.01)
    assert sum(out.breakdown.values()) + out.progress_s == pytest.approx(horizon, rel=1e-9)


def test_dalys_interval_is_near_the_monte_carlo_optimum():
    m, w, u = 2.0 * H, 120.0, 600.0
    best = daly_interval(w, m)
    ettr = {f: best * f / daly_segment_time(best * f, w, u, m) for f in (0.5, 1.0, 2.0)}
    assert ettr[1.0] > ettr[0.5] and ettr[1.0] > ettr[2.0]


@pytest.mark.parametrize("scenario,mtbf,repair", [("low", 2.0, 4.0), ("medium", 1.0, 3.0), ("high", 0.5, 2.0)])
def test_the_papers_presets_keep_lambda_r_domains_down(scenario, mtbf, repair):
    """Concurrent failures of a Poisson trace with fixed repair: mean lambda R, none down e^(-lambda R)."""
    horizon = 20_000 * H
    trace = tr.poisson(domains=32, horizon_s=horizon, repair=tr.Repair(repair * H), seed=2, mtbf_hours=mtbf)
    mean, idle = tr.concurrency(trace, horizon)
    lam_r = repair / mtbf
    assert mean == pytest.approx(lam_r, rel=0.03)
    assert idle == pytest.approx(math.exp(-lam_r), abs=0.01)


def test_metas_mttf_projections_from_the_failure_rate():
    """r_f = 6.50 per 1000 node-days: MTTF 1.8 h at 16,384 GPUs and 0.23 h at 131,072 (8 GPUs a node)."""
    for gpus, hours in ((16_384, 1.8), (131_072, 0.23)):
        rate = tr.rate_per_s(domains=gpus // 8, failures_per_1000_node_days=6.50)
        assert 1 / rate / H == pytest.approx(hours, rel=0.03)


def test_mecefo_drop_is_the_covering_ratio_weighted_by_the_degraded_time():
    """pp = 1, no event costs: throughput = P0 + (1 - P0) / c, P0 the share of time with none down."""
    horizon = 5_000 * H
    trace = tr.poisson(domains=32, horizon_s=horizon, repair=tr.Repair(2 * H), seed=3, mtbf_hours=0.5)
    c = 1.2
    out = simulate(MeCeFO(Grid(dp=32), cover_ratio=c, recovery_s=0, rejoin_s=0, step_s=0), trace, horizon)
    _, p0 = tr.concurrency(trace, horizon)
    assert out.ettr == pytest.approx(p0 + (1 - p0) / c, rel=1e-6)
    assert out.fatal_events == 0
    # a quarter of the data is approximate with 4 of 32 down on average: 2 f / D, weighted by speed
    assert 0.15 < out.approx_fraction < 0.3


def test_mecefo_falls_back_when_no_neighbour_is_left():
    """4 replicas, 3 down at once: the ring cannot cover; the job restarts on the one left."""
    trace = (tr.Failure(100.0, 1, 1000.0), tr.Failure(200.0, 2, 1000.0), tr.Failure(300.0, 3, 1000.0))
    sim = MeCeFO(Grid(dp=4), cover_ratio=1.0, recovery_s=0, rejoin_s=0, step_s=0, restart_s=50.0)
    out = simulate(sim, trace, 2000.0)
    assert out.fatal_events == 1
    # 0-300 full speed, restart 300-350, one replica of four until the first repair at 1100, then covered
    assert out.progress_s == pytest.approx(300 + 750 * 0.25 + 900, rel=1e-9)


def test_no_torch_import():
    code = "import sys, megatron_mecefo.sim.engine, megatron_mecefo.sim.mecefo, megatron_mecefo.sim.checkpoint_restart; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"


def test_torchft_drops_the_failed_groups_samples_and_recover_spreads_them():
    """With no event costs: torchft trains at full step speed on (D - f) / D of the data; ReCoVer
    trains on all of it at (D - f) / D speed. Both progress at E[(D - f) / D]."""
    from megatron_mecefo.sim.baselines import DropSamples, Spread

    horizon = 2_000 * H
    trace = tr.poisson(domains=16, horizon_s=horizon, repair=tr.Repair(2 * H), seed=4, mtbf_hours=0.5)
    mean_down, _ = tr.concurrency(trace, horizon)
    drop = simulate(DropSamples(Grid(dp=16), detect_s=0, step_s=0), trace, horizon)
    # lcm(1..16) micro-batches per replica: every deal over the survivors is even, speed (D - f) / D
    spread = simulate(Spread(Grid(dp=16), transition_s=0, step_s=0, micro_batches=720_720), trace, horizon)
    assert drop.ettr == pytest.approx(1 - mean_down / 16, rel=1e-6)
    assert spread.ettr == pytest.approx(drop.ettr, rel=1e-6)
    assert drop.breakdown["dropped"] == pytest.approx(horizon * mean_down / 16, rel=1e-6)
    assert "dropped" not in spread.breakdown
    # 8 micro-batches each: one replica's 8 over 15 survivors leaves some with 9; the step waits for them
    assert Spread(Grid(dp=16), micro_batches=8).rate(frozenset({4})).speed == pytest.approx(8 / 9)


def test_spares_wait_for_a_repair_when_the_pool_is_empty():
    from megatron_mecefo.sim.baselines import SparePool

    trace = (tr.Failure(100.0, 0, 500.0), tr.Failure(200.0, 1, 500.0))
    out = simulate(SparePool(spares=1, restart_s=10.0, lost_s=0.0), trace, 1000.0, timeline=True)
    # 100-110 swap; 200-600 waiting (2 down, 1 spare), restart 600-610 when domain 0 is back
    assert out.progress_s == pytest.approx(1000 - 10 - 400 - 10)
    assert out.breakdown == pytest.approx({"restart": 20.0, "waiting_for_repair": 400.0})


def test_p99_spares_and_the_cli_errors():
    from megatron_mecefo.sim.__main__ import main
    from megatron_mecefo.sim.run import p99_poisson

    assert p99_poisson(4.0) == 9 and p99_poisson(0.01) == 0
    assert main(["--gpus", "30", "--tp", "4", "--mtbf-hours", "1", "--cover-time-ratio", "1.1", "--seeds", "1"]) == 2
    assert main(["--gpus", "32", "--cover-time-ratio", "1.1"]) == 2  # no failure rate
    assert main(["--scenario", "high", "--systems", "mecefo,nope", "--cover-time-ratio", "1.1"]) == 2


def test_the_cli_writes_every_systems_keys(tmp_path):
    from megatron_mecefo.sim.__main__ import main
    from megatron_mecefo.sim.run import SYSTEMS
    import json

    out = tmp_path / "r.json"
    assert main(["--scenario", "high", "--systems", ",".join(SYSTEMS), "--hours", "48", "--seeds", "3", "--pp", "2",
                 "--cover-time-ratio", "1.05", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    for name in SYSTEMS:
        r = result["systems"][name]
        assert set(r) >= {"throughput_drop", "throughput_drop_ci95", "ettr", "approx_fraction", "breakdown"}, name
        assert 0 <= r["throughput_drop"] < 1 and 0 < r["ettr"] <= 1, (name, r)
    assert result["systems"]["mecefo"]["approx_fraction"] > 0.1


def test_oobleck_reproduces_its_artifacts_time_shares():
    """Oobleck's artifact simulator, BERT-large on its 10-minute trace (30 nodes, one removed every
    601.2 s, run until the last removal): the published effective / rebalance / fallback shares of
    wall time, within 3 points, from the artifact's own constants (presets) and trace format."""
    from megatron_mecefo.sim.baselines import Reconfigure
    from megatron_mecefo.sim.presets import OOBLECK_ARTIFACT_BERT_LARGE as bert

    rows = [f"0,add,node{i}" for i in range(1, 31)]
    rows += [f"{601_200 * k},remove,node{k}" for k in range(1, 16)]
    domains, trace = tr.read_node_events(rows)
    assert domains == 30 and len(trace) == 15 and all(f.repair == math.inf for f in trace)
    tput = bert["samples_per_s"]
    step_s = bert["samples_per_step"] / tput[30]
    policy = Reconfigure(domains, bert["reconfig_s"], step_s, throughput=tput)
    out = simulate(policy, trace, horizon_s=15 * 601.2)
    shares = {"rebalance": out.breakdown["reconfigure"] / out.wall_s, "fallback": out.wasted_wall_s / out.wall_s}
    shares["effective"] = 1 - shares["rebalance"] - shares["fallback"]
    for key, published in bert["shares_10m"].items():
        assert shares[key] == pytest.approx(published, abs=0.03), (key, shares)
    # each removal lost one step at the speed it ran at: 14 removals before the horizon
    assert out.wasted_wall_s == pytest.approx(sum(bert["samples_per_step"] / tput[n] for n in range(30, 16, -1)))


def test_node_event_traces_repair_on_a_later_addition():
    domains, trace = tr.read_node_events(["0,add,a", "0,add,b", "1000,remove,b", "5000,add,c", "7000,remove,a"])
    assert domains == 2
    assert trace == (tr.Failure(1.0, 1, 4.0), tr.Failure(7.0, 0, math.inf))
    with pytest.raises(ValueError, match="not added at time 0"):
        tr.read_node_events(["0,add,a", "10,remove,z"])


def test_spread_runs_the_runtimes_planner():
    """cover "spread" in the simulator is elastic/plan/cover_plan.py's plan: D = 8, k = 8, one replica
    lost, a covering micro-batch at 0.6 of an exact one."""
    from megatron_mecefo.elastic.plan.cover_plan import Costs, plan_cover
    from megatron_mecefo.elastic.plan.topology import ring_cover

    grid = Grid(dp=8)
    neighbour = MeCeFO(grid, cover_ratio=1.2).rate(frozenset({3}))
    assert neighbour.speed == pytest.approx(1 / 1.2) and neighbour.approx == pytest.approx(2 / 8)
    # the default target (the paper's 1.2): 8 lost over 7 survivors, [2, 1, 1, 1, 1, 1, 1], the one
    # with two approximating one micro-batch (9.6 <= 9.6): 1.2 with 1 of 64 approximated
    r = MeCeFO(grid, cover_ratio=1.2, cover="spread", micro_batches=8).rate(frozenset({3}))
    plan = plan_cover(ring_cover(grid, [0, 1, 2, 4, 5, 6, 7]), 8, Costs(covering=0.6), policy="spread")
    assert r.speed == pytest.approx(8 / plan.slowest) and r.approx == pytest.approx(plan.approximated / 64)
    assert r.speed >= neighbour.speed - 1e-12 and r.approx < neighbour.approx
    # a budget of 1.0: no slowdown, for more approximated micro-batches than the paper's (20 of 64:
    # a survivor adopting one must approximate three to stay within 8 exact ones' time)
    b = MeCeFO(grid, cover_ratio=1.2, cover="spread", budget=1.0, micro_batches=8).rate(frozenset({3}))
    assert b.speed == pytest.approx(1.0) and b.approx == pytest.approx(20 / 64)
    # one micro-batch per replica: the lost one cannot be split, spread is the neighbour's rule
    one = MeCeFO(grid, cover_ratio=1.0, cover="spread", micro_batches=1).rate(frozenset({3}))
    assert one.speed == pytest.approx(1.0) and one.approx <= 2 / 8


@pytest.mark.parametrize("on_loss", ["give_up", "reinit"])
def test_sharded_state_is_lost_when_a_shard_and_its_copy_fail_together(on_loss):
    """A node of 2 GPUs holds two ring-adjacent replicas (tp = pp = 1): its failure takes a shard and
    the copy; one GPU per node never loses one to a single failure."""
    def policy(g):
        return MeCeFO(Grid(dp=8), gpus_per_node=g, cover_ratio=1.1, sharded=True, reshard_s=3.0, recovery_s=2.0,
                      on_shard_loss=on_loss, restart_s=600.0, shard_loss_lost_s=900.0)
    one = policy(1)
    tr_ = one.on_failure(frozenset({2}), tr.Failure(0.0, 2, 10.0))
    assert (tr_.downtime_s, tr_.fatal, one.counters()) == (5.0, False, {"shard_losses": 0})
    two = policy(2)
    tr_ = two.on_failure(frozenset({1}), tr.Failure(0.0, 1, 10.0))  # replicas 2 and 3
    assert two.counters() == {"shard_losses": 1}
    if on_loss == "give_up":
        assert tr_.fatal and tr_.downtime_s == 600.0 and tr_.lost_s == 900.0
    else:
        assert not tr_.fatal and tr_.downtime_s == 5.0
    # adjacent replicas on two different one-GPU domains, the second failing while the first is down
    one.on_failure(frozenset({2, 3}), tr.Failure(1.0, 3, 10.0))
    assert one.counters() == {"shard_losses": 0}  # 2's copy was re-sharded away from 3 after the first failure


def test_recycle_fills_bubbles_and_needs_pipelines():
    from megatron_mecefo.sim.baselines import Reroute

    grid = Grid(pp=4, dp=8)
    # one rank of stage 1 down: 8 micro-batches over 7 peers -> 2 extra; bubble of 3 slots absorbs them
    assert Reroute(grid, micro_batches=8, absorbed=1.0).rate(frozenset({grid.rank(0, 1, 5)})).speed == 1.0
    half = Reroute(grid, micro_batches=8, absorbed=0.5).rate(frozenset({grid.rank(0, 1, 5)}))
    assert half.speed == pytest.approx((8 + 3) / (8 + 2 + 1.5))
    with pytest.raises(ValueError, match="--pp > 1"):
        Reroute(Grid(dp=8))


def test_the_cli_reads_a_trace_and_draws_bursts(tmp_path):
    from megatron_mecefo.sim.__main__ import main
    import json

    csv_path = tmp_path / "t.csv"
    tr.write_csv([tr.Failure(3600.0, 0, 7200.0), tr.Failure(5400.0, 1, 7200.0)], csv_path)
    out = tmp_path / "r.json"
    assert main(["--gpus", "8", "--mtbf-hours", "1", "--trace-csv", str(csv_path), "--hours", "10", "--seeds", "2",
                 "--systems", "mecefo", "--cover-time-ratio", "1.5", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["setup"]["failures_per_run"] == 2
    # covering from 1 h to 3.5 h at speed 1 / 1.5, less three 2 s transitions inside (two failures, a rejoin)
    degraded = (2.5 * 3600 - 3 * 2.0) * (1 - 1 / 1.5)
    assert r["systems"]["mecefo"]["breakdown"]["degraded"] == pytest.approx(degraded / 3600, rel=1e-6)
    assert main(["--gpus", "8", "--mtbf-hours", "1", "--trace-csv", str(csv_path), "--gpus-per-node", "8",
                 "--systems", "mecefo", "--cover-time-ratio", "1.5"]) == 2  # domain 1 of a 1-domain cluster
    w = tr.weibull(domains=32, horizon_s=5000 * H, repair=tr.Repair(1.0), seed=0, shape=0.7, mtbf_hours=1.0)
    gaps = [b.t - a.t for a, b in zip(w, w[1:])]
    assert sum(gaps) / len(gaps) == pytest.approx(H, rel=0.05)
    assert max(gaps) > 10 * H  # bursts and long quiet spells


def test_the_cli_times_a_token_budget_and_plots(tmp_path):
    from megatron_mecefo.sim.__main__ import main
    import json

    out, png = tmp_path / "r.json", tmp_path / "t.png"
    assert main(["--scenario", "high", "--systems", "mecefo,torchft", "--hours", "48", "--seeds", "2",
                 "--cover-time-ratio", "1.25", "--token-budget", "7.2e9", "--tokens-per-s", "1e6",
                 "--out", str(out), "--plot", str(png)]) == 0
    r = json.loads(out.read_text())["systems"]
    for name in ("mecefo", "torchft"):  # 2 h of failure-free training at each system's own rate
        assert r[name]["time_to_budget_hours"] == pytest.approx(2.0 / (1 - r[name]["throughput_drop"]))
    assert png.stat().st_size > 10_000
    assert main(["--scenario", "high", "--token-budget", "5"]) == 2


def test_mecefo_rates_come_from_the_runtimes_fold():
    """Two replicas of 8 down: the ring gives two covering replicas; the paper's rule waits for a
    covering step of cover_ratio and approximates 4 of 8 replicas' data; "adopted" keeps the
    covering replicas' own micro-batches exact (1 + c / 2) and approximates 2 of 8."""
    grid = Grid(dp=8)
    paper = MeCeFO(grid, cover_ratio=1.2, micro_batches=4).rate(frozenset({2, 5}))
    assert paper.speed == pytest.approx(1 / 1.2) and paper.approx == pytest.approx(4 / 8)
    adopted = MeCeFO(grid, cover_ratio=1.2, micro_batches=4, approximate="adopted").rate(frozenset({2, 5}))
    assert adopted.speed == pytest.approx(1 / 1.6) and adopted.approx == pytest.approx(2 / 8)
    with pytest.raises(ValueError, match="approximate"):
        MeCeFO(grid, approximate="none")


def _step_level(policy, trace, horizon, step_s):
    """Walk the same run step by step: a failure wastes the partial step it interrupts (no mean-loss
    assumption), a repair is admitted at the next step boundary, transitions block the clock."""
    events = sorted([(f.t, 0, f) for f in trace] + [(f.t + f.repair, 1, f) for f in trace], key=lambda e: (e[0], e[1]))
    events = [e for e in events if e[0] < horizon]
    down, t, progress, i = frozenset(), 0.0, 0.0, 0
    while t < horizon:
        r = policy.rate(down)
        nxt = events[i][0] if i < len(events) else math.inf
        if r.speed == 0:
            t = nxt
        elif t + step_s / r.speed <= nxt:
            t += step_s / r.speed
            progress += step_s * (1 - r.dropped)
            continue
        if i == len(events) or nxt >= horizon:
            break
        _, kind, f = events[i]
        i += 1
        if kind == 0:  # the step in flight is lost
            t = max(t, nxt)
            down = down | {f.domain}
            tr_ = policy.on_failure(down, f)
        else:  # the step in flight completes first
            if r.speed:
                t += step_s / r.speed
                progress += step_s * (1 - r.dropped)
            down = down - {f.domain}
            tr_ = policy.on_repair(down, f.domain)
        t += tr_.downtime_s
    return progress / horizon


def test_the_fluid_model_agrees_with_a_step_by_step_walk():
    """MeCeFO and torchft on the paper's high scenario with 20 s steps: the fluid engine's ETTR
    (half a step lost per failure, rates between events) within 0.2 points of a step-level walk (a
    whole step or none lost per failure would miss it by 0.55)."""
    from megatron_mecefo.sim.baselines import DropSamples

    horizon, step_s = 200 * H, 20.0
    trace = tr.poisson(domains=32, horizon_s=horizon, repair=tr.Repair(2 * H), seed=3, mtbf_hours=0.5)
    for make in (lambda: MeCeFO(Grid(dp=32), cover_ratio=1.3, step_s=step_s, recovery_s=2.0, rejoin_s=2.0),
                 lambda: DropSamples(Grid(dp=32), detect_s=5.0, step_s=step_s)):
        fluid = simulate(make(), trace, horizon).ettr
        walked = _step_level(make(), trace, horizon, step_s)
        assert fluid == pytest.approx(walked, abs=0.002), (make().__class__.__name__, fluid, walked)


def test_cluster_scenarios_and_flags_that_override_them(tmp_path):
    from megatron_mecefo.sim.__main__ import main, parse
    from megatron_mecefo.sim.run import Setup
    import json

    out = tmp_path / "r.json"
    assert main(["--scenario", "llama3", "--tp", "8", "--pp", "16", "--systems", "torchft", "--seeds", "4",
                 "--cover-time-ratio", "1.1", "--out", str(out)]) == 0
    setup = json.loads(out.read_text())["setup"]
    assert (setup["gpus"], setup["gpus_per_node"], setup["repair_hours"]) == (16_384, 8, 4.0)
    # Llama 3: 419 unexpected interruptions in 54 days on 16,384 GPUs -> about 233 in 30 days
    assert setup["failures_per_run"] == pytest.approx(419 * 30 / 54, rel=0.1)
    s = Setup.from_args(parse(["--scenario", "high", "--failures-per-1000-node-days", "100", "--cover-time-ratio", "1"]))
    assert (s.gpus, s.mtbf_hours, s.repair_hours) == (32, None, 2.0)
    assert 1 / s.rate / 3600 == pytest.approx(24 * 1000 / (100 * 32))
    assert main(["--scenario", "high", "--mtbf-hours", "1", "--failures-per-1000-node-days", "5"]) == 2
    assert main(["--scenario", "high", "--weibull-shape", "0.7", "--lemons", "2", "--cover-time-ratio", "1"]) == 2
