"""The formats of MeCeFO's failure injection: "inject" rules and a "trace" (the ds_config keys and
`--mecefo-inject` / `--mecefo-trace`), validated when MeCeFOConfig is built.

Below config.py and above nothing of ours: what the rules do at run time is elastic/faults/inject.py's.
"""

from __future__ import annotations

from typing import List

__all__ = ["KINDS", "PHASES", "PAPER_SCENARIOS", "RULE_FORMAT", "parse_rules", "parse_trace"]

PHASES = ("forward", "backward", "allreduce", "commit", "optimizer", "recovery", "join", "transfer", "admit", "reshard")
"""Where a kill or hang fires (elastic/faults/inject.py's docstring says when each point is reached)."""

KINDS = ("kill", "hang", "error", "hold", "slow")

RULE_FORMAT = ("kill|hang|error:RANK:STEP[:PHASE[:INCARNATION]] or hold:RANK:STEP[:INCARNATION] or "
               "slow:RANK:FACTOR:FROM[:TO]")

PAPER_SCENARIOS = {"low": (2.0, 4.0), "medium": (1.0, 3.0), "high": (0.5, 2.0)}
"""The paper's failure scenarios: (mean time between failures, recovery time) in hours."""


def parse_rules(rules, where: str = 'mecefo "inject"') -> List[dict]:
    """Validate injection rules: dicts {"kind", "rank", "step" (int or "*"), "phase", "incarnation"}
    or CLI strings in RULE_FORMAT. Returns normalized dicts (phase "backward" and incarnation 0 by
    default; a hold's incarnation defaults to 1, its phase is "forward": the start of the step). A
    slow-down is {"kind": "slow", "rank", "factor", "from", "to"} (`_parse_slow`).

    Raises:
        ValueError: naming `where` (the ds_config key and flag) and the bad rule.
    """
    if isinstance(rules, (str, dict)):
        rules = [rules]
    out = []
    for rule in rules:
        if isinstance(rule, str) and rule.startswith("slow:") or isinstance(rule, dict) and rule.get("kind") == "slow":
            out.append(_parse_slow(rule, where))
            continue
        if isinstance(rule, str):
            parts = rule.split(":")
            fields = ("kind", "rank", "step", "incarnation") if parts[0] == "hold" else \
                ("kind", "rank", "step", "phase", "incarnation")
            if not 3 <= len(parts) <= len(fields):
                raise ValueError(f"{where}: {rule!r} is not {RULE_FORMAT}")
            rule = dict(zip(fields, parts))
            try:
                rule["rank"] = int(rule["rank"])
                rule["step"] = "*" if rule["step"] == "*" else int(rule["step"])
                if "incarnation" in rule:
                    rule["incarnation"] = int(rule["incarnation"])
            except ValueError:
                raise ValueError(f"{where}: rank, step (or *) and incarnation of {parts} must be integers") from None
        if not isinstance(rule, dict):
            raise ValueError(f"{where} entries must be objects, got {rule!r}")
        unknown = set(rule) - {"kind", "rank", "step", "phase", "incarnation"}
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {sorted(unknown)} in {rule!r}")
        if rule.get("kind") not in KINDS:
            raise ValueError(f"{where}: kind must be one of {KINDS}, got {rule.get('kind')!r}")
        hold = rule["kind"] == "hold"
        rule = {"phase": "forward" if hold else "backward", "incarnation": 1 if hold else 0, **rule}
        if rule["phase"] not in PHASES:
            raise ValueError(f"{where}: phase must be one of {PHASES}, got {rule['phase']!r}")
        if rule["kind"] == "error" and rule["phase"] != "commit":
            raise ValueError(f"{where}: an error is injected at phase commit only (the step's last collective "
                             f"failing on this rank while its peers' completed), got {rule['phase']!r}")
        if hold and rule["step"] == "*":
            raise ValueError(f"{where}: a hold names a step, got {rule!r}")
        for f in ("rank", "step", "incarnation"):
            v = rule.get(f)
            if f == "step" and v == "*":
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{where}: {f} must be an integer >= 0, got {v!r}")
        out.append(rule)
    return out


def _parse_slow(rule, where: str) -> dict:
    """A slow-down: {"kind": "slow", "rank": R, "factor": F > 1, "from": S, "to": T (None: to the
    end)}, or "slow:R:F:S[:T]". Rank R's compute takes F times as long from step S up to (not
    including) step T, in every incarnation (the node is slow, not the process)."""
    if isinstance(rule, str):
        parts = rule.split(":")
        if not 4 <= len(parts) <= 5:
            raise ValueError(f"{where}: {rule!r} is not slow:RANK:FACTOR:FROM[:TO]")
        try:
            rule = {"kind": "slow", "rank": int(parts[1]), "factor": float(parts[2]), "from": int(parts[3]),
                    "to": int(parts[4]) if len(parts) == 5 else None}
        except ValueError:
            raise ValueError(f"{where}: in {rule!r} rank, FROM and TO must be integers, FACTOR a number") from None
    unknown = set(rule) - {"kind", "rank", "factor", "from", "to"}
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {sorted(unknown)} in {rule!r}")
    rule = {"to": None, **rule}
    for f in ("rank", "from") + (("to",) if rule["to"] is not None else ()):
        v = rule.get(f)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{where}: {f} of a slow-down must be an integer >= 0, got {v!r}")
    factor = rule.get("factor")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 1:
        raise ValueError(f"{where}: the factor of a slow-down must be a number > 1, got {factor!r}")
    if rule["to"] is not None and rule["to"] <= rule["from"]:
        raise ValueError(f"{where}: a slow-down ends after it starts, got from {rule['from']} to {rule['to']}")
    return {**rule, "factor": float(factor)}


def parse_trace(trace, where: str = 'mecefo "trace"') -> dict:
    """Validate a trace: {"events": [[rank, fail_step, rejoin_step], ...]}, {"mtbf_steps": M,
    "recovery_steps": R, "seed": S}, or {"scenario": "low"|"medium"|"high", "steps_per_hour": H,
    "seed": S} (the paper's rates). Returns the normalized dict.

    Raises:
        ValueError: naming `where` and what is wrong.
    """
    if not isinstance(trace, dict):
        raise ValueError(f"{where} must be an object, got {trace!r}")
    trace = dict(trace)
    if "events" in trace:  # a recorded / hand-made trace: [[rank, fail_step, rejoin_step], ...]
        events = trace.pop("events")
        if trace or not isinstance(events, list) or not all(
            isinstance(e, (list, tuple)) and len(e) == 3 and all(isinstance(x, int) and x >= 0 for x in e) and e[2] > e[1]
            for e in events
        ):
            raise ValueError(f'{where}: "events" must be a list of [rank, fail_step, rejoin_step] with rejoin > fail, alone')
        return {"events": [list(e) for e in events]}
    seed = trace.pop("seed", 0)
    if "scenario" in trace:
        scenario, per_hour = trace.pop("scenario"), trace.pop("steps_per_hour", None)
        if scenario not in PAPER_SCENARIOS:
            raise ValueError(f"{where}: scenario must be one of {tuple(PAPER_SCENARIOS)}, got {scenario!r}")
        if isinstance(per_hour, bool) or not isinstance(per_hour, (int, float)) or per_hour <= 0:
            raise ValueError(f"{where}: steps_per_hour must be a number > 0 with a scenario, got {per_hour!r}")
        mtbf_h, recovery_h = PAPER_SCENARIOS[scenario]
        trace.update(mtbf_steps=mtbf_h * per_hour, recovery_steps=max(1, round(recovery_h * per_hour)))
    unknown = set(trace) - {"mtbf_steps", "recovery_steps"}
    if unknown or not {"mtbf_steps", "recovery_steps"} <= set(trace):
        raise ValueError(f'{where} needs "mtbf_steps" and "recovery_steps" (or "scenario" + "steps_per_hour"); got {sorted(trace)}')
    m, r = trace["mtbf_steps"], trace["recovery_steps"]
    if isinstance(m, bool) or not isinstance(m, (int, float)) or m <= 0:
        raise ValueError(f"{where}: mtbf_steps must be > 0, got {m!r}")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(f"{where}: recovery_steps must be an integer >= 1, got {r!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"{where}: seed must be an integer, got {seed!r}")
    return {"mtbf_steps": float(m), "recovery_steps": r, "seed": seed}
