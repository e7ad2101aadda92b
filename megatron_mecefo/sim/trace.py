"""Failure traces: when each failure domain (a GPU or a node) goes down and for how long.

A trace is a sorted tuple of `Failure(t, domain, repair)` (seconds from the start; `repair`: how long
the domain stays out of the pool). Generators are seeded (`random.Random(seed)`), so a (scenario,
seed) pair is one trace for every system compared on it.

* `poisson`: exponential inter-failure times at a cluster-wide rate (an MTBF, or failures per 1000
  node-days per domain), the failing domain drawn uniformly among those up (a domain that is down
  cannot fail again); repair fixed, exponential or lognormal.
* `weibull`: the same with Weibull inter-failure times (shape < 1: failures come in bursts).
* `lemon`: two classes of domains, a few failing `factor` times as often as the rest.
* CSV in and out: `t_s,domain,repair_s`; `read_node_events` reads the `delta_ms,add|remove,name`
  traces of Oobleck's artifact simulator (SymbioticLab/Oobleck, tools/simulator/traces).
"""

from __future__ import annotations

import csv
import dataclasses
import math
import random
from pathlib import Path
from typing import Iterable, List, Optional, Sequence, Tuple

__all__ = ["Failure", "Repair", "poisson", "weibull", "lemon", "read_csv", "write_csv", "read_node_events", "concurrency"]

HOUR = 3600.0
DAY = 24 * HOUR


@dataclasses.dataclass(frozen=True, order=True)
class Failure:
    t: float
    """Seconds from the start of the run."""
    domain: int
    """Index of the failure domain (a GPU when gpus_per_node = 1, else a node)."""
    repair: float
    """Seconds until the domain is back in the pool."""


@dataclasses.dataclass(frozen=True)
class Repair:
    """Distribution of repair times: "fixed", "exponential" or "lognormal" (mean `mean_s`; `sigma`:
    the lognormal's shape)."""

    mean_s: float
    kind: str = "fixed"
    sigma: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in ("fixed", "exponential", "lognormal"):
            raise ValueError(f'repair kind must be "fixed", "exponential" or "lognormal", got {self.kind!r}')
        if not self.mean_s > 0:
            raise ValueError(f"repair mean must be > 0 s, got {self.mean_s}")

    def draw(self, rng: random.Random) -> float:
        if self.kind == "fixed":
            return self.mean_s
        if self.kind == "exponential":
            return rng.expovariate(1.0 / self.mean_s)
        mu = math.log(self.mean_s) - self.sigma ** 2 / 2  # E[lognormal] = exp(mu + sigma^2 / 2)
        return rng.lognormvariate(mu, self.sigma)


def rate_per_s(*, domains: int, mtbf_hours: Optional[float] = None,
               failures_per_1000_node_days: Optional[float] = None) -> float:
    """Cluster-wide failure rate (per second) from an MTBF of the whole cluster, or from a rate per
    domain and day (Meta's r_f: failures per 1000 node-days)."""
    if (mtbf_hours is None) == (failures_per_1000_node_days is None):
        raise ValueError("give exactly one of mtbf_hours and failures_per_1000_node_days")
    if mtbf_hours is not None:
        if not mtbf_hours > 0:
            raise ValueError(f"mtbf_hours must be > 0, got {mtbf_hours}")
        return 1.0 / (mtbf_hours * HOUR)
    if not failures_per_1000_node_days > 0:
        raise ValueError(f"failures_per_1000_node_days must be > 0, got {failures_per_1000_node_days}")
    return domains * failures_per_1000_node_days / 1000.0 / DAY


def _generate(gaps, *, domains: int, horizon_s: float, repair: Repair, rng: random.Random,
              weights: Optional[Sequence[float]] = None) -> Tuple[Failure, ...]:
    """Failures at the cumulative sums of `gaps()` until `horizon_s`; each hits a domain that is up
    (drawn with `weights`), which stays down for a repair time. A failure that finds every domain
    down is dropped (nothing is left to fail)."""
    out: List[Failure] = []
    up_at = [0.0] * domains
    t = 0.0
    while True:
        t += gaps()
        if t >= horizon_s:
            return tuple(out)
        up = [d for d in range(domains) if up_at[d] <= t]
        if not up:
            continue
        w = [weights[d] for d in up] if weights is not None else None
        d = rng.choices(up, weights=w)[0]
        r = repair.draw(rng)
        up_at[d] = t + r
        out.append(Failure(t, d, r))


def poisson(*, domains: int, horizon_s: float, repair: Repair, seed: int, mtbf_hours: Optional[float] = None,
            failures_per_1000_node_days: Optional[float] = None) -> Tuple[Failure, ...]:
    """Poisson failures at a cluster-wide rate (see `rate_per_s`)."""
    lam = rate_per_s(domains=domains, mtbf_hours=mtbf_hours, failures_per_1000_node_days=failures_per_1000_node_days)
    rng = random.Random(seed)
    return _generate(lambda: rng.expovariate(lam), domains=domains, horizon_s=horizon_s, repair=repair, rng=rng)


def weibull(*, domains: int, horizon_s: float, repair: Repair, seed: int, shape: float, mtbf_hours: float) -> Tuple[Failure, ...]:
    """Weibull inter-failure times of mean `mtbf_hours` (shape < 1: bursts; 1: Poisson)."""
    if not shape > 0:
        raise ValueError(f"weibull shape must be > 0, got {shape}")
    scale = mtbf_hours * HOUR / math.gamma(1 + 1 / shape)
    rng = random.Random(seed)
    return _generate(lambda: rng.weibullvariate(scale, shape), domains=domains, horizon_s=horizon_s,
                     repair=repair, rng=rng)


def lemon(*, domains: int, horizon_s: float, repair: Repair, seed: int, mtbf_hours: float, lemons: int,
          factor: float) -> Tuple[Failure, ...]:
    """Poisson failures at a cluster MTBF where `lemons` domains fail `factor` times as often as the rest."""
    if not 0 <= lemons <= domains or not factor >= 1:
        raise ValueError(f"need 0 <= lemons <= domains and factor >= 1, got lemons={lemons}, factor={factor}")
    rng = random.Random(seed)
    weights = [factor if d < lemons else 1.0 for d in range(domains)]
    return _generate(lambda: rng.expovariate(1.0 / (mtbf_hours * HOUR)), domains=domains, horizon_s=horizon_s,
                     repair=repair, rng=rng, weights=weights)


def concurrency(trace: Iterable[Failure], horizon_s: float) -> Tuple[float, float]:
    """(time-averaged number of domains down, share of the time with none down) over [0, horizon_s)."""
    edges = []
    for f in trace:
        edges += [(f.t, 1), (min(f.t + f.repair, horizon_s), -1)]
    edges.sort()
    down, last, area, idle = 0, 0.0, 0.0, 0.0
    for t, delta in edges:
        area += down * (t - last)
        idle += (t - last) if down == 0 else 0.0
        down, last = down + delta, t
    idle += horizon_s - last if down == 0 else 0.0
    area += down * (horizon_s - last)
    return area / horizon_s, idle / horizon_s


def write_csv(trace: Iterable[Failure], path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["t_s", "domain", "repair_s"])
        for e in trace:
            w.writerow([f"{e.t:.3f}", e.domain, f"{e.repair:.3f}"])


def read_csv(path: Path) -> Tuple[Failure, ...]:
    """A trace written by `write_csv` (or by hand: columns t_s, domain, repair_s)."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    try:
        trace = tuple(sorted(Failure(float(r["t_s"]), int(r["domain"]), float(r["repair_s"])) for r in rows))
    except (KeyError, ValueError) as e:
        raise ValueError(f"{path}: expected columns t_s, domain, repair_s with numbers ({e})") from None
    if any(e.t < 0 or e.repair <= 0 or e.domain < 0 for e in trace):
        raise ValueError(f"{path}: times must be >= 0, repairs > 0 and domains >= 0")
    return trace


def read_node_events(lines: Iterable[str]) -> Tuple[int, Tuple[Failure, ...]]:
    """(domains, trace) from rows `delta_ms,add|remove,name` (Oobleck's artifact traces). The nodes
    added at time 0 are the domains; a removal keeps its domain down until the next later addition
    (a new node takes the place of the oldest outage), or for good when none comes."""
    rows = [r for r in csv.reader(lines) if r]
    try:
        events = sorted((int(t) / 1000.0, kind.strip(), name.strip()) for t, kind, name in rows)
    except ValueError as e:
        raise ValueError(f"expected rows delta_ms,add|remove,name ({e})") from None
    if any(kind not in ("add", "remove") for _, kind, _ in events):
        raise ValueError("an event is neither add nor remove")
    index = {name: i for i, (t, kind, name) in enumerate(e for e in events if e[0] == 0 and e[1] == "add")}
    outages: List[List[float]] = []  # [t, domain, back_at]
    waiting: List[List[float]] = []
    for t, kind, name in events:
        if kind == "remove":
            if name not in index:
                raise ValueError(f"node {name!r} is removed but was not added at time 0")
            outages.append([t, index[name], math.inf])
            waiting.append(outages[-1])
        elif t > 0 and waiting:
            waiting.pop(0)[2] = t
    return len(index), tuple(Failure(t, int(d), back - t) for t, d, back in outages)
