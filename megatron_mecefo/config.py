"""MeCeFOConfig: the one configuration object, from a ds_config "mecefo" block and/or CLI flags.

Sources, lowest to highest precedence: field defaults < ds_config["mecefo"] < `--mecefo*` flags.
Every value is validated in `__post_init__`; a bad value raises ValueError naming the ds_config key
and the CLI flag, before any training starts. Validation that needs the model (the rank against the
FFN sizes) is `megatron_mecefo.layers.check_lowrank_rank(model, cfg.rank)`.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import os
import textwrap
from typing import Any, Dict, Mapping, Optional

from megatron_mecefo.approx.mode import BASES, SVD_METHODS, CoverPolicy
from megatron_mecefo.fault_rules import parse_rules, parse_trace

__all__ = ["MeCeFOConfig", "LaunchEnv", "RECOMPUTE_CHOICES", "APPROXIMATE_CHOICES", "COVER_CHOICES",
           "field_docs", "reference_table"]

RECOMPUTE_CHOICES = ("auto", "always", "never")
APPROXIMATE_CHOICES = ("all", "adopted")
COVER_CHOICES = ("neighbour", "spread")
SHARD_REDUNDANCY_CHOICES = ("neighbour", "none")
SHARD_LOSS_CHOICES = ("give_up", "reinit")


@dataclasses.dataclass(frozen=True)
class LaunchEnv:
    """What the launcher tells a rank through the environment (the only env reads of the package)."""

    rank: int
    world: int
    local_rank: int
    master_addr: str
    master_port: int
    incarnation: int
    """0 on first start; restarts by mecefo-launch count up (the rank then rejoins)."""
    mecefo_launcher: bool
    """True under mecefo-launch (it hosts the store and keeps survivors alive)."""
    job_id: Optional[str] = None
    """The job's id (MECEFO_JOB_ID, set by mecefo-launch); None under another launcher: rank 0 makes
    one for its store daemon and the other ranks read it from the store."""
    max_restarts: int = 0
    """How often the launcher restarts a failed rank (MECEFO_MAX_RESTARTS; 0: never, as under
    launchers that end the job when a rank fails)."""

    @classmethod
    def read(cls) -> "LaunchEnv":
        env = os.environ
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_PORT") if k not in env]
        if missing:
            raise RuntimeError(
                f"{', '.join(missing)} not set: start the job with mecefo-launch (or deepspeed / torchrun)"
            )
        return cls(
            rank=int(env["RANK"]), world=int(env["WORLD_SIZE"]), local_rank=int(env.get("LOCAL_RANK", "0")),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"), master_port=int(env["MASTER_PORT"]),
            incarnation=int(env.get("MECEFO_INCARNATION", "0")), mecefo_launcher=env.get("MECEFO_LAUNCHER") == "1",
            job_id=env.get("MECEFO_JOB_ID") or None, max_restarts=int(env.get("MECEFO_MAX_RESTARTS", "0")),
        )


def cache_root() -> str:
    """Where built datasets are cached: $MECEFO_CACHE, else ~/.cache/megatron_mecefo."""
    return os.environ.get("MECEFO_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "megatron_mecefo")


def _flag(key: str) -> str:
    return "--mecefo" if key == "enable" else "--mecefo-" + key.replace("_", "-")


@dataclasses.dataclass(kw_only=True)
class MeCeFOConfig:
    """MeCeFO settings. Disabled by default: then every MeCeFO component is a no-op."""

    enable: bool = False
    """Turn MeCeFO on (`--mecefo`). Off: plain training, bit-identical to stock Megatron-Core."""
    rank: int = 64
    """Rank r of the low-rank FFN weight gradient; 0 < r < min(out, in) of every local FFN weight."""
    tau: int = 200
    """Steps between refreshes of each FFN weight's projection basis (also computed on first use)."""
    basis: str = "weight"
    """Input directions of the low-rank FFN weight gradient: "weight" (the paper: top-r right singular
    vectors of W, refreshed every tau steps), "activation" (the dominant directions of each covering
    micro-batch's own FFN input, drawn per micro-batch by a randomized range finder; 2-3x lower error
    at the same r on a trained model, see docs/results.md), or "gradient" (top-r right singular vectors
    of W's aggregated gradient of the last step without covering, refreshed at every such step and
    every tau steps while covering; not with a sharded optimizer)."""
    svd_method: str = "auto"
    """How the weight basis is computed: "exact" (torch.linalg.svd), "randomized" (torch.svd_lowrank), or
    "auto" = exact when min(out, in) <= svd_exact_max_dim, randomized above."""
    svd_exact_max_dim: int = 4096
    """Threshold of svd_method="auto"."""
    skip_attention: bool = True
    """Covering micro-batches skip the attention backward (gradient through the residual only)."""
    lowrank_ffn: bool = True
    """Covering micro-batches use the low-rank FFN weight gradient."""
    recompute_ffn: str = "auto"
    """FFN activation recompute on covering micro-batches: "always" (the paper), "never", or "auto":
    only when a covering rank holds more than one micro-batch's activations at once (adopted
    micro-batches merged into a larger batch). One micro-batch at a time with the attention backward
    skipped already needs about half of a normal rank's activation memory, so recompute would only
    cost time (see benchmarks/covering_cost.py). The engine and the patched checkouts run micro-batches one
    at a time, so there "auto" never recomputes; set "always" for the paper's memory profile."""
    approximate: str = "all"
    """Which micro-batches of a covering rank run in covering mode: "all" (its own and the adopted
    ones; the paper's rule, attention gradients averaged over non-covering ranks only) or "adopted"
    (its own micro-batches stay exact)."""
    attention_floor: float = 0.0
    """The least share of a step's micro-batches whose attention backward runs exact (0 to 1; 0: the
    paper's rule, none kept). When more replicas cover than the floor allows (with two of four
    replicas down the paper's rule leaves attention no gradient at all), covering micro-batches keep
    their attention backward, the covering replicas' own ones first, until the share reaches it."""
    cover: str = "neighbour"
    """Who runs a failed replica's micro-batches: "neighbour" (the paper: its ring neighbour runs all
    of them besides its own, and the job runs at that replica's pace) or "spread" (dealt over the
    survivors round the ring, each approximating as few as keep its step within the target:
    covering_budget, else the neighbour rule's own time, so never slower and never more
    approximated than the paper). Plans come from micro-batch costs the members measure and agree on
    with each generation (elastic/plan/cover_plan.py, elastic/plan/costs.py)."""
    covering_budget: Optional[float] = None
    """The slowest replica's step time while covering, in normal steps (e.g. 1.05): the covering
    replicas then approximate as few micro-batches as keep their steps within it (adopted ones
    first), from the costs the members measured and agreed on (before the first covering step was
    measured, a covering micro-batch counts as 0.55 of an exact one). None: "neighbour" approximates
    as the paper, "spread" within the neighbour rule's time."""
    rebalance: bool = False
    """Fail-slow: a replica whose compute per micro-batch stays above rebalance_threshold times the
    median replica's for rebalance_window committed steps sheds micro-batches to the faster replicas
    from the next step on (the same micro-batches in the same global batch, each in the mode the
    cover plan gave it; event "rebalance"), and the plan goes back to even once it recovers. Off:
    no plan changes for speed, and a replica slower than collective_timeout_s is retired as failed."""
    rebalance_threshold: float = 1.2
    """With rebalance: a replica is slow above this many times the median replica's compute per
    micro-batch (> 1), and healthy again below 1 + (rebalance_threshold - 1) / 2."""
    rebalance_window: int = 5
    """With rebalance: committed steps a replica stays above (or below) the thresholds before the plan
    changes (>= 2)."""
    retire_slower_than: Optional[float] = None
    """With rebalance: a replica whose compute per micro-batch stays above this many times the median
    replica's for rebalance_window steps is retired as failed (exit 4: restarted, it rejoins), if
    the others can cover it; above rebalance_threshold. None: slow replicas are only rebalanced."""
    shard_redundancy: str = "neighbour"
    """With a sharded optimizer state (ds_config "zero_optimization.stage": 1, Megatron-LM's
    --use-distributed-optimizer): "neighbour" keeps a copy of each replica's shard, current at every
    step, on the replica that covers it (twice the sharded state's memory; the owner sends the
    copy's 1/D of the reduced gradient each step), so a failed replica's shard is re-sharded from
    it; "none" keeps no copy (plain ZeRO-1 memory): losing a replica then loses its shard, which
    on_shard_loss handles."""
    on_shard_loss: str = "give_up"
    """When a range of the sharded optimizer state has no live holder left (its owner and the holder
    of its copy failed in one step, or shard_redundancy is "none"): "give_up" ends the job with a
    checkpoint (every holder writes its ranges); "reinit" rebuilds the range and goes on: its
    parameters as one survivor holds them (re-sent to all), its moments zero and its step count 0
    (the bias correction of a fresh start, for that range only); the cost in loss is in
    docs/results.md."""
    collective_timeout_s: float = 60.0
    """Timeout of the data-parallel collectives, and of the tensor- and pipeline-parallel ones inside a
    replica: a hung rank stalls the others at most this long. Must exceed the longest normal wait at
    a collective (a covering rank's slower step)."""
    heartbeat_interval_s: float = 0.5
    """How often each rank bumps its heartbeat in the store."""
    heartbeat_timeout_s: float = 5.0
    """A rank whose heartbeat has not moved for this long is presumed failed (crash or hang)."""
    agree_timeout_s: float = 120.0
    """How long survivors wait for every candidate to check in to a new generation (the others are
    left out and rejoin later); a voted commit decision not made within it becomes an abort. Must
    exceed collective_timeout_s and twice heartbeat_timeout_s. With no plan 2 x heartbeat_timeout_s
    later, the job gives up."""
    join_timeout_s: float = 600.0
    """How long a restarted rank waits, from its start, to be let back in (a trace's down time
    included); with tensor or pipeline parallelism also how long a rank waits for the other ranks of
    its replica to start."""
    restart_failed_after: Optional[float] = None
    """Under a launcher other than mecefo-launch (deepspeed, torchrun, srun, by hand), each rank's
    keeper restarts a crashed training process after this many seconds so it rejoins (None: it is
    not restarted; the job goes on without it). Under mecefo-launch, its --restart-failed-after."""
    max_restarts: int = 3
    """How often a keeper restarts its rank's training process (with restart_failed_after)."""
    store: Optional[str] = None
    """HOST:PORT of a `mecefo-store` on a node that does not train, for ranks started by a launcher
    other than mecefo-launch: then losing any node, node 0 included, is survived (None: rank 0's
    keeper starts the job's store on MASTER_ADDR:MASTER_PORT; under torchrun the job uses the
    agent's store)."""
    log_dir: Optional[str] = None
    """Directory of the per-step and recovery-event logs, steps_rank{R}.jsonl and events_rank{R}.jsonl
    (None: no files)."""
    log_param_hash: bool = False
    """Record a SHA-256 of the parameters at the start of every step in steps_rank{R}.jsonl, to
    check that replicas stay bit-identical (costs one pass over the parameters per step)."""
    inject: tuple = ()
    """Failure injection for tests and demos: a list of {"kind": "kill"|"hang"|"error"|"hold", "rank": R,
    "step": S (or "*": any step), "phase": "forward"|"backward"|"allreduce"|"commit"|"optimizer"|"recovery"|
    "join"|"transfer"|"admit"|"reshard", "incarnation": I (default 0: the first start)}; "hold" makes every
    rank wait at the start of step S until incarnation I (default 1) of rank R asks to rejoin; "error"
    (phase "commit" only) makes the step's last collective fail on rank R while its peers' completed;
    {"kind": "slow", "rank": R, "factor": F, "from": S, "to": T} makes rank R's compute take F times
    as long from step S to T (exclusive; none: the end), by sleeping. CLI: --mecefo-inject
    kill|hang|error:RANK:STEP[:PHASE[:INCARNATION]], hold:RANK:STEP[:INCARNATION] or
    slow:RANK:FACTOR:FROM[:TO] (repeatable). A rank outside the job is refused at start (formats:
    fault_rules.py)."""

    trace: Optional[dict] = None
    """Trace-driven failures: {"mtbf_steps": M, "recovery_steps": R, "seed": S} (job-wide mean steps
    between failures, steps a failed rank stays down), {"scenario": "low"|"medium"|"high",
    "steps_per_hour": H, "seed": S} for the paper's rates (MTBF 2/1/0.5 h, recovery 4/3/2 h), or
    {"events": [[rank, fail_step, rejoin_step], ...]} to replay a given trace (checked at start:
    inject.check_trace: refused, naming the event, when a rank is outside the job, fails again while
    down, or leaves a failed replica without a healthy non-covering neighbour, or must come back more
    often than the launcher restarts it). Failed ranks come back only under mecefo-launch
    --restart-failed-after, at most --max-restarts times each; the job then waits at each rejoin
    step for the restarted rank, so the trace plays out as written."""

    def __post_init__(self) -> None:
        self._check_bool("enable", "skip_attention", "lowrank_ffn", "log_param_hash")
        self._check_int_range("rank", 1)
        self._check_int_range("tau", 1)
        self._check_int_range("svd_exact_max_dim", 1)
        self._check_choice("basis", BASES)
        self._check_choice("svd_method", SVD_METHODS)
        self._check_choice("recompute_ffn", RECOMPUTE_CHOICES)
        self._check_choice("approximate", APPROXIMATE_CHOICES)
        self._check_choice("cover", COVER_CHOICES)
        self._check_number("attention_floor", lambda v: 0 <= v <= 1, "a number in [0, 1]")
        self._check_number("covering_budget", lambda v: v >= 1, "a number >= 1 (the slowest replica's step time over "
                           "a normal one's)", optional=True)
        self._check_bool("rebalance")
        self._check_number("rebalance_threshold", lambda v: v > 1, "a number > 1 (a slow replica's compute per "
                           "micro-batch over the median replica's)")
        self._check_int_range("rebalance_window", 2)
        self._check_number("retire_slower_than", lambda v: v > self.rebalance_threshold,
                           f"a number above rebalance_threshold ({self.rebalance_threshold})", optional=True)
        if self.retire_slower_than is not None and not self.rebalance:
            raise ValueError(f"{self._where('retire_slower_than')} needs rebalance on (the replicas' speeds are "
                             "measured for it): set --mecefo-rebalance")
        self._check_choice("shard_redundancy", SHARD_REDUNDANCY_CHOICES)
        self._check_choice("on_shard_loss", SHARD_LOSS_CHOICES)
        for key in ("collective_timeout_s", "heartbeat_interval_s", "heartbeat_timeout_s", "agree_timeout_s", "join_timeout_s"):
            self._check_number(key, lambda v: v > 0, "a number > 0")
        if self.heartbeat_timeout_s < 2 * self.heartbeat_interval_s:
            raise ValueError(
                f"{self._where('heartbeat_timeout_s')} must be at least twice heartbeat_interval_s "
                f"({self.heartbeat_interval_s}), got {self.heartbeat_timeout_s}"
            )
        if self.agree_timeout_s <= self.collective_timeout_s:
            raise ValueError(
                f"{self._where('agree_timeout_s')} must exceed collective_timeout_s ({self.collective_timeout_s}): "
                f"survivors wait for peers still blocked in a collective; got {self.agree_timeout_s}"
            )
        if self.agree_timeout_s <= 2 * self.heartbeat_timeout_s:
            raise ValueError(
                f"{self._where('agree_timeout_s')} must exceed twice heartbeat_timeout_s ({self.heartbeat_timeout_s}): "
                "an agreement waits for a hung rank until its heartbeat is presumed dead, and a waiting rank "
                f"takes over from a hung publisher only after that; got {self.agree_timeout_s}. Raise "
                "agree_timeout_s or lower heartbeat_timeout_s")
        self._check_number("restart_failed_after", lambda v: v >= 0, "a number >= 0", optional=True)
        self._check_int_range("max_restarts", 0)
        if self.store is not None:
            host, _, port = str(self.store).rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"{self._where('store')} must be HOST:PORT (a mecefo-store), got {self.store!r}")
        if self.log_dir is not None and not isinstance(self.log_dir, str):
            raise ValueError(f"{self._where('log_dir')} must be a path string, got {self.log_dir!r}")
        self.inject = tuple(parse_rules(self.inject, self._where("inject")))
        if self.trace is not None:
            self.trace = parse_trace(self.trace, self._where("trace"))

    # -- validation -------------------------------------------------------------------------------

    @staticmethod
    def _where(key: str) -> str:
        return f'mecefo "{key}" (ds_config) / {_flag(key)}'

    def _check_bool(self, *keys: str) -> None:
        for key in keys:
            value = getattr(self, key)
            if not isinstance(value, bool):
                raise ValueError(f"{self._where(key)} must be true or false, got {value!r}")

    def _check_int_range(self, key: str, low: int) -> None:
        value = getattr(self, key)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{self._where(key)} must be an integer >= {low}, got {value!r}")

    def _check_number(self, key: str, ok, must: str, optional: bool = False) -> None:
        """A number (not a bool) for which ok(value) holds, stored as a float; None too if `optional`."""
        value = getattr(self, key)
        if optional and value is None:
            return
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
            raise ValueError(f"{self._where(key)} must be {must}, got {value!r}")
        setattr(self, key, float(value))

    def _check_choice(self, key: str, choices) -> None:
        value = getattr(self, key)
        if value not in choices:
            raise ValueError(f"{self._where(key)} must be one of {', '.join(map(repr, choices))}, got {value!r}")

    # -- construction -----------------------------------------------------------------------------

    @classmethod
    def keys(cls) -> tuple:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_ds_config(cls, block: Optional[Mapping[str, Any]], **overrides: Any) -> "MeCeFOConfig":
        """Build from the ds_config "mecefo" block (a dict, or None when absent), then `overrides`.

        Raises:
            ValueError: unknown key, or a value out of range.
        """
        if block is None:
            block = {}
        if not isinstance(block, Mapping):
            raise ValueError(f'ds_config "mecefo" must be a JSON object, got {type(block).__name__}')
        unknown = sorted(set(block) - set(cls.keys()))
        if unknown:
            raise ValueError(
                f'unknown key(s) in ds_config "mecefo": {", ".join(unknown)}; '
                f"allowed: {', '.join(cls.keys())}"
            )
        values = dict(block)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    @classmethod
    def from_args(cls, args: argparse.Namespace, ds_block: Optional[Mapping[str, Any]] = None) -> "MeCeFOConfig":
        """Build from parsed `--mecefo*` flags (see `add_cli_args`) over an optional ds_config block."""
        overrides = {key: getattr(args, "mecefo" if key == "enable" else f"mecefo_{key}", None) for key in cls.keys()}
        if overrides["enable"] is False:  # store_true default: "not given", not "disable"
            overrides["enable"] = None
        return cls.from_ds_config(ds_block, **overrides)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Add the `--mecefo*` flags, one per field, their help from the field's docstring and its
        default; every parsed default is None so the ds_config block is not overridden."""
        g = parser.add_argument_group("MeCeFO", "fault-tolerant training (override ds_config \"mecefo\")")
        docs = field_docs()
        for f in dataclasses.fields(MeCeFOConfig):
            flag, kind = _flag(f.name), _FLAG_KINDS.get(f.name, f.type)
            help_ = f"{_first_sentence(docs[f.name])} (default: {_default_text(f.default)})"
            if f.name in _CHOICES:
                g.add_argument(flag, choices=_CHOICES[f.name], default=None, help=help_)
            elif kind == "store_true":
                g.add_argument(flag, action="store_true", default=None, help=help_)
            elif kind == "bool":
                g.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_)
            elif f.name == "inject":
                g.add_argument(flag, action="append", default=None, metavar="RULE", help=help_ + "; repeatable")
            elif f.name == "trace":
                g.add_argument(flag, type=json.loads, default=None, metavar="JSON", help=help_)
            else:
                g.add_argument(flag, type={"int": int, "float": float}.get(kind, str), default=None, help=help_)
        return parser

    # -- use --------------------------------------------------------------------------------------

    def cover_policy(self, step: int, *, live_microbatches: int = 1) -> CoverPolicy:
        """The CoverPolicy for a covering micro-batch at optimizer `step`.

        Args:
            step: the optimizer step (drives the basis refresh every `tau` steps).
            live_microbatches: how many micro-batches' activations the covering rank holds at once
                (1 when it runs its micro-batches one after the other); decides recompute_ffn="auto".
        """
        if self.recompute_ffn == "auto":
            recompute = live_microbatches > 1
        else:
            recompute = self.recompute_ffn == "always"
        return CoverPolicy(
            step=step,
            skip_attention=self.skip_attention,
            recompute_ffn=recompute,
            lowrank_ffn=self.lowrank_ffn,
            rank=self.rank,
            basis=self.basis,
            tau=self.tau,
            svd_method=self.svd_method,
            svd_exact_max_dim=self.svd_exact_max_dim,
        )

    def recompute_note(self, live_microbatches: int = 1) -> str:
        """What recompute_ffn resolves to for a covering rank holding `live_microbatches` at once."""
        on = self.cover_policy(0, live_microbatches=live_microbatches).recompute_ffn
        why = " (micro-batches run one at a time)" if self.recompute_ffn == "auto" and live_microbatches == 1 else ""
        return f"recompute_ffn={self.recompute_ffn} -> {'on' if on else 'off'}{why}"

    def check_ds_config(self, ds_config: Mapping[str, Any]) -> None:
        """Reject DeepSpeed settings MeCeFO cannot run with, before training starts (plain training,
        `enable` off, is left alone)."""
        if not self.enable:
            return
        stage = ds_config.get("zero_optimization", {}).get("stage", 0)
        if stage not in (0, 1):
            raise ValueError(
                f'ds_config "zero_optimization.stage"={stage} is not supported with MeCeFO (--mecefo): stages 2 and 3 '
                "shard the gradients and the parameters too, and a covering rank needs the whole model and gradient "
                "of its replica. Use stage 1 (the optimizer state sharded over the live replicas, each shard also "
                "held by its covering neighbour) or 0."
            )
        if ds_config.get("fp16", {}).get("enabled"):
            raise ValueError('ds_config "fp16" is not supported with MeCeFO yet; use "bf16" or fp32')

    @property
    def approximations_on(self) -> bool:
        """A covering micro-batch approximates something (skipped attention backward, low-rank FFN
        gradient, or recomputation always)."""
        return self.enable and (self.skip_attention or self.lowrank_ffn or self.recompute_ffn == "always")

    def restarts(self, env: LaunchEnv) -> int:
        """How often a failed rank of this job is restarted: mecefo-launch's budget under it, else
        the keeper's (max_restarts, with restart_failed_after)."""
        if env.mecefo_launcher:
            return env.max_restarts
        return self.max_restarts if self.restart_failed_after is not None else 0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# -- one source for the CLI help and the README's configuration reference ---------------------------

_CHOICES = {"basis": BASES, "svd_method": SVD_METHODS, "recompute_ffn": RECOMPUTE_CHOICES, "approximate": APPROXIMATE_CHOICES, "cover": COVER_CHOICES,
            "shard_redundancy": SHARD_REDUNDANCY_CHOICES, "on_shard_loss": SHARD_LOSS_CHOICES}
_FLAG_KINDS = {"enable": "store_true", "log_param_hash": "bool", "rebalance": "bool", "log_dir": "str", "store": "str",
               "restart_failed_after": "float", "covering_budget": "float", "retire_slower_than": "float"}


def field_docs() -> Dict[str, str]:
    """The docstring under each field of MeCeFOConfig, whitespace folded (read from the source)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(MeCeFOConfig)))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
            docs[node.target.id] = " ".join(str(after.value.value).split())
    return docs


def _first_sentence(text: str) -> str:
    head = text.split(". ")[0].rstrip(".")
    return head.replace("%", "%%")  # argparse formats help strings


def _default_text(value: Any) -> str:
    return {None: "none", (): "none", True: "on", False: "off"}.get(value, str(value)) \
        if isinstance(value, (bool, tuple, type(None))) else str(value)


def reference_table() -> str:
    """The README's configuration reference: one row per field (ds_config key, flag, default, doc)."""
    rows = ["| ds_config `\"mecefo\"` key | flag | default | what it does |", "|---|---|---|---|"]
    docs = field_docs()
    for f in dataclasses.fields(MeCeFOConfig):
        doc = docs[f.name].replace("|", "\\|")
        rows.append(f"| `{f.name}` | `{_flag(f.name)}` | {_default_text(f.default)} | {doc} |")
    return "\n".join(rows)
