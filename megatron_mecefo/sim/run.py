"""One setup (cluster, failures, costs), every system on the same traces, means over seeds."""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from pathlib import Path
from typing import Callable, Dict, List, Optional

from megatron_mecefo.elastic.plan.topology import Grid
from megatron_mecefo.sim import presets, trace as tr
from megatron_mecefo.sim.baselines import DropSamples, Reconfigure, Reroute, SparePool, Spread
from megatron_mecefo.sim.checkpoint_restart import CheckpointRestart, daly_interval
from megatron_mecefo.sim.engine import Outcome, simulate
from megatron_mecefo.sim.mecefo import MeCeFO

__all__ = ["Setup", "SYSTEMS", "run_all", "measured_costs"]

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def measured_costs(results: Path = RESULTS) -> Dict[str, float]:
    """MeCeFO's costs from this project's benchmarks: the covering step ratio at LLaMA-1B layer size
    (covering_cost.json) and crash-to-degraded-step (recovery.json). Empty when not found."""
    out: Dict[str, float] = {}
    try:
        cc = json.loads((results / "covering_cost.json").read_text())
        out["cover_time_ratio"] = cc.get("time_ratio_covering_vs_normal_paper_1b", cc["time_ratio_covering_vs_normal"])
        out["recovery_s"] = json.loads((results / "recovery.json").read_text())["crash_to_degraded_step_s"]
        cp = json.loads((results / "control_plane.json").read_text())
        rows = [(r["n"], r["failure"]["calls"]) for r in cp["runs"] if r["impl"] == "new"]
        (n0, c0), (n1, c1) = min(rows), max(rows)
        out["agreement_calls_per_rank"] = (c1 - c0) / (n1 - n0)  # O(N): the slope of the measured calls
        out["store_calls_per_s"] = cp["store_calls_per_s"]
    except (OSError, KeyError, ValueError):
        pass
    return out


def recovery_at(n: int, measured: Dict[str, float], measured_ranks: int = 4) -> float:
    """Crash to the first degraded step at `n` ranks: the measured one (recovery.json, a few ranks on
    one machine) plus the store traffic of the agreement of the ranks beyond those, at the store's
    measured rate (control_plane.json). Without the control-plane figures: the measured one."""
    extra = max(0, n - measured_ranks) * measured.get("agreement_calls_per_rank", 0.0)
    return measured["recovery_s"] + extra / measured.get("store_calls_per_s", float("inf"))


def p99_poisson(mean: float) -> int:
    """Smallest k with P(Poisson(mean) <= k) >= 0.99 (ByteRobust sizes warm spares so)."""
    k, term, total = 0, math.exp(-mean), math.exp(-mean)
    while total < 0.99:
        k += 1
        term *= mean / k
        total += term
    return k


@dataclasses.dataclass
class Setup:
    gpus: int
    gpus_per_node: int = 1
    tp: int = 1
    pp: int = 1
    mtbf_hours: Optional[float] = None
    failures_per_1000_node_days: Optional[float] = None
    repair_hours: float = 2.0
    repair: str = "fixed"
    hours: float = 720.0
    spares: Optional[int] = None
    cover_time_ratio: Optional[float] = None
    recovery_s: float = 2.0
    step_s: float = 1.0
    checkpoint_write_s: float = presets.CKPT_WRITE_S
    restart_s: float = presets.RESTART_S
    model: str = "1B"
    """Which model size the size-dependent constants of the baselines are taken at (350M, 1B, 7B)."""
    micro_batches: int = presets.MICRO_BATCHES
    trace_kind: str = "poisson"
    """"poisson", "weibull" (`weibull_shape`), "lemon" (`lemons` domains `lemon_factor` x as
    failure-prone) or "csv" (`trace_csv`, the same trace for every seed)."""
    weibull_shape: float = 0.7
    lemons: int = 0
    lemon_factor: float = 10.0
    trace_csv: Optional[str] = None
    cover_time_ratio_source: str = "given"

    def __post_init__(self) -> None:
        if self.gpus % self.gpus_per_node:
            raise ValueError(f"--gpus {self.gpus} is not a multiple of --gpus-per-node {self.gpus_per_node}")
        if self.gpus % (self.tp * self.pp):
            raise ValueError(f"--gpus {self.gpus} is not a multiple of tp x pp = {self.tp * self.pp}")
        if self.model not in presets.MODEL_PARAMS:
            raise ValueError(f"--model must be one of {sorted(presets.MODEL_PARAMS)}, got {self.model!r}")
        if self.trace_kind not in ("poisson", "weibull", "lemon", "csv"):
            raise ValueError(f"unknown trace kind {self.trace_kind!r}")
        if (self.trace_kind == "csv") != (self.trace_csv is not None):
            raise ValueError("--trace-csv and the csv trace kind go together")
        if self.trace_kind == "lemon" and not 0 < self.lemons <= self.gpus // self.gpus_per_node:
            raise ValueError(f"--lemons must be in 1..{self.gpus // self.gpus_per_node} (failure domains)")
        if (self.mtbf_hours is None) == (self.failures_per_1000_node_days is None):
            raise ValueError("give exactly one of --mtbf-hours / --scenario and --failures-per-1000-node-days")
        self.grid = Grid(tp=self.tp, pp=self.pp, dp=self.gpus // (self.tp * self.pp))
        self.domains = self.gpus // self.gpus_per_node
        self.rate = tr.rate_per_s(domains=self.domains, mtbf_hours=self.mtbf_hours,
                                  failures_per_1000_node_days=self.failures_per_1000_node_days)
        if self.spares is None:
            self.spares = max(1, p99_poisson(self.rate * self.repair_hours * tr.HOUR))
        if self.cover_time_ratio is None:
            measured = measured_costs()
            if "cover_time_ratio" not in measured:
                raise ValueError("no measured covering cost found (benchmarks/results/covering_cost.json): pass --cover-time-ratio")
            self.cover_time_ratio, self.recovery_s = measured["cover_time_ratio"], recovery_at(self.gpus, measured)
            self.cover_time_ratio_source = ("measured: benchmarks/results/covering_cost.json, the paper's rule at "
                                            "LLaMA-1B layer size, CPU fp32 (the paper's drops imply 1.01-1.04)")

    @classmethod
    def from_args(cls, args) -> "Setup":
        preset = presets.SCENARIOS[args.scenario] if args.scenario else {}
        kw = dict(gpus=args.gpus or preset.get("gpus"),
                  gpus_per_node=args.gpus_per_node or preset.get("gpus_per_node", 1),
                  repair_hours=args.repair_hours if args.repair_hours is not None else preset.get("repair_hours", 2.0))
        if kw["gpus"] is None:
            raise ValueError("give --gpus or --scenario")
        # a rate given on the command line replaces the scenario's
        if args.mtbf_hours is not None or args.failures_per_1000_node_days is not None:
            kw.update(mtbf_hours=args.mtbf_hours, failures_per_1000_node_days=args.failures_per_1000_node_days)
        else:
            kw.update(mtbf_hours=preset.get("mtbf_hours"),
                      failures_per_1000_node_days=preset.get("failures_per_1000_node_days"))
        optional = {"checkpoint_write_s": args.checkpoint_write_s, "restart_s": args.restart_s}
        kinds = [k for k, given in (("csv", args.trace_csv), ("weibull", args.weibull_shape), ("lemon", args.lemons)) if given]
        if len(kinds) > 1:
            raise ValueError(f"--trace-csv, --weibull-shape and --lemons are different traces: give one, got {kinds}")
        kind = kinds[0] if kinds else "poisson"
        return cls(**kw, tp=args.tp, pp=args.pp, repair=args.repair, hours=args.hours,
                   spares=args.spares, cover_time_ratio=args.cover_time_ratio, step_s=args.step_s, model=args.model,
                   micro_batches=args.micro_batches, trace_kind=kind, weibull_shape=args.weibull_shape or 0.7,
                   lemons=args.lemons, lemon_factor=args.lemon_factor,
                   trace_csv=str(args.trace_csv) if args.trace_csv else None,
                   **{k: v for k, v in optional.items() if v is not None})

    def trace(self, seed: int):
        common = dict(domains=self.domains, horizon_s=self.hours * tr.HOUR, seed=seed,
                      repair=tr.Repair(self.repair_hours * tr.HOUR, self.repair))
        mtbf = 1 / self.rate / tr.HOUR
        if self.trace_kind == "csv":
            trace = tr.read_csv(Path(self.trace_csv))
            if any(f.domain >= self.domains for f in trace):
                raise ValueError(f"{self.trace_csv}: a domain is >= the {self.domains} failure domains of this cluster")
            return trace
        if self.trace_kind == "weibull":
            return tr.weibull(shape=self.weibull_shape, mtbf_hours=mtbf, **common)
        if self.trace_kind == "lemon":
            return tr.lemon(lemons=self.lemons, factor=self.lemon_factor, mtbf_hours=mtbf, **common)
        return tr.poisson(mtbf_hours=mtbf, **common)

    @property
    def reshard_s(self) -> float:
        """A re-shard moves about one rank's new share of the optimizer state."""
        per_rank = presets.MODEL_PARAMS[self.model] * presets.OPTIMIZER_BYTES_PER_PARAM / (self.tp * self.pp * self.grid.dp)
        return per_rank / presets.PEER_BYTES_PER_S


# name -> (setup -> (run(trace, horizon) -> Outcome, failure-free speed, share of provisioned GPUs training))
def _engine(policy_of: Callable[[Setup], object]):
    return lambda s: (lambda trace, horizon, timeline=False: simulate(policy_of(s), trace, horizon, timeline=timeline))


def _cr(write, restart):
    def make(s: Setup):
        cr = CheckpointRestart(daly_interval(write(s), 1 / s.rate), write(s), restart(s))
        return cr.run, cr.failure_free_ettr, 1.0
    return make


def _mecefo(**what_if):
    def policy(s: Setup) -> MeCeFO:
        kw = dict(what_if)
        if kw.get("sharded"):  # a give-up reloads the last periodic checkpoint: half an interval lost
            kw.update(reshard_s=s.reshard_s, shard_loss_lost_s=daly_interval(s.checkpoint_write_s, 1 / s.rate) / 2)
        return MeCeFO(s.grid, s.gpus_per_node, s.cover_time_ratio, s.step_s, s.recovery_s, s.recovery_s, s.restart_s,
                      micro_batches=s.micro_batches, **kw)
    return lambda s: (_engine(policy)(s), 1.0, 1.0)


SYSTEMS: Dict[str, Callable[[Setup], tuple]] = {
    "mecefo": _mecefo(),
    "mecefo_adopted": _mecefo(approximate="adopted"),
    "mecefo_spread": _mecefo(cover="spread"),
    "mecefo_spread_budget1.05": _mecefo(cover="spread", budget=1.05),
    "mecefo_spread_budget1": _mecefo(cover="spread", budget=1.0),
    "mecefo_sharded": _mecefo(sharded=True, on_shard_loss="give_up"),
    "mecefo_sharded_reinit": _mecefo(sharded=True, on_shard_loss="reinit"),
    "checkpoint_restart": _cr(lambda s: s.checkpoint_write_s, lambda s: s.restart_s),
    "inmemory_checkpoint": _cr(lambda s: presets.INMEMORY_CKPT_WRITE_S, lambda s: presets.INMEMORY_RESTART_S),
    "torchft": lambda s: (_engine(lambda s: DropSamples(s.grid, s.gpus_per_node, presets.TORCHFT_DETECT_S, s.step_s,
                                                        presets.TORCHFT_OVERHEAD))(s), 1 / presets.TORCHFT_OVERHEAD, 1.0),
    "recycle": lambda s: (_engine(lambda s: Reroute(s.grid, s.gpus_per_node, s.micro_batches, presets.RECYCLE_BUBBLE_ABSORBED,
                                                    presets.RECYCLE_TRANSITION_S, s.step_s))(s), 1.0, 1.0),
    "recover": lambda s: (_engine(lambda s: Spread(s.grid, s.gpus_per_node, presets.RECOVER_TRANSITION_S, s.step_s,
                                                    s.micro_batches))(s), 1.0, 1.0),
    "oobleck": lambda s: (_engine(lambda s: Reconfigure(s.domains, presets.OOBLECK_RECONFIG_S[s.model], s.step_s,
                                                        min_domains=presets.OOBLECK_FAULT_THRESHOLD + 1))(s), 1.0, 1.0),
    "bamboo": lambda s: (_engine(lambda s: Reconfigure(s.domains, presets.BAMBOO_RECONFIG_S[s.model], s.step_s,
                                                       min_domains=presets.BAMBOO_PIPELINE_STAGES,
                                                       pipeline_stages=presets.BAMBOO_PIPELINE_STAGES))(s), 1.0, 1.0),
    "replicated_optimizer_spares": lambda s: (_engine(lambda s: SparePool(s.spares, presets.SPARE_SWAP_S, s.step_s / 2))(s),
                                              1.0, s.domains / (s.domains + s.spares)),
    "nvrx_local_checkpoint": lambda s: (_engine(lambda s: SparePool(s.spares, presets.NVRX_INJOB_RESTART_S,
                                                                    presets.LOCAL_CKPT_INTERVAL_S / 2,
                                                                    presets.LOCAL_CKPT_OVERHEAD))(s),
                                        1.0, s.domains / (s.domains + s.spares)),
    "nvrx_inprocess": lambda s: (_engine(lambda s: SparePool(s.spares, presets.NVRX_RESTART_S, s.step_s / 2))(s),
                                 1.0, s.domains / (s.domains + s.spares)),
}


def _ci95(xs: List[float]) -> float:
    return 1.96 * statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else 0.0


def run_all(setup: Setup, systems: List[str], *, seeds: int, budget_hours: Optional[float] = None) -> dict:
    """Every system in `systems` on the same `seeds` traces. `budget_hours`: a training budget in hours
    of the failure-free job without fault tolerance (tokens / its tokens per second); each system's
    `time_to_budget_hours` is the wall time to train it at the system's mean rate in these runs."""
    unknown = [n for n in systems if n not in SYSTEMS]
    if unknown:
        raise ValueError(f"unknown system(s) {unknown}; choose from {sorted(SYSTEMS)}")
    if seeds < 1:
        raise ValueError("--seeds must be >= 1")
    horizon = setup.hours * tr.HOUR
    traces = [setup.trace(seed) for seed in range(seeds)]
    out = {"setup": {k: v for k, v in dataclasses.asdict(setup).items()}, "systems": {}}
    out["setup"]["failures_per_run"] = statistics.mean(len(t) for t in traces)
    for name in systems:
        run, ff_speed, provisioned = SYSTEMS[name](setup)
        outcomes: List[Outcome] = [run(t, horizon) for t in traces]
        ettr = [o.ettr * provisioned for o in outcomes]
        drop = [1 - o.ettr / ff_speed for o in outcomes]
        causes = sorted({k for o in outcomes for k in o.breakdown})
        out["systems"][name] = {
            "throughput_drop": statistics.mean(drop), "throughput_drop_ci95": _ci95(drop),
            "ettr": statistics.mean(ettr), "ettr_ci95": _ci95(ettr),
            "approx_fraction": statistics.mean(o.approx_fraction for o in outcomes),
            "dropped_fraction": statistics.mean(o.breakdown.get("dropped", 0.0) / o.wall_s for o in outcomes),
            "fatal_events": statistics.mean(o.fatal_events for o in outcomes),
            **{k: statistics.mean(o.counters.get(k, 0) for o in outcomes) for k in sorted({k for o in outcomes for k in o.counters})},
            "breakdown": {k: statistics.mean(o.breakdown.get(k, 0.0) for o in outcomes) / tr.HOUR for k in causes},
            # spares held idle, in hours of the provisioned cluster
            **({"idle_spares_hours": setup.hours * (1 - provisioned)} if provisioned < 1 else {}),
            "failure_free_speed": ff_speed, "provisioned_share": provisioned,
        }
        if budget_hours is not None:
            rate = statistics.mean(o.ettr for o in outcomes)
            out["systems"][name]["time_to_budget_hours"] = budget_hours / rate if rate > 0 else math.inf
    return out
