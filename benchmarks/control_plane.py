"""The control plane's store traffic against N: the real membership code, N simulated members.

N members are threads of this process, each with its own connection to one TCPStore served by a
separate process (as the launcher or `mecefo-store` serves a job's). Every store call of a member's
training thread is counted; its heartbeat thread's calls are counted apart. For each N, the code of
this tree ("new") and of an earlier commit ("baseline", read from git) run side by side:

  healthy     every member votes ok for one step (Membership.decide: the baseline's commit, and
              this tree's with a sharded optimizer state): calls per step, in total and on the
              busiest member, and the time until every member has the decision
  healthy_replicated  this tree's healthy step with a replicated optimizer state (no vote: the
              lowest member's join-count read and progress mark)
  failure     one member's process exited (the launcher's mark); the survivors vote abort and
              agree on the next generation: calls and time until every survivor has it
  admission   a restarted member asks to join; the members commit steps until one names it, then
              all agree on the generation with it: calls and time from its request

It also measures how many store calls per second the store server sustains on this machine (8
client threads), so each figure scales to another machine.

    python benchmarks/control_plane.py                       # N = 8 .. 4096; writes results/control_plane.{json,png}
    python benchmarks/control_plane.py --sizes 8 64 --baseline-max 64
"""

from __future__ import annotations

import os

# c10d looks up the peer's host name of every new store connection (for its logs). Where the
# resolver drops queries, each lost one stalls a connection by the resolver's timeout (5 s by
# default): 1 in ~25 connections here. N members need 2N connections; fail such lookups fast.
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # one warning per such connection otherwise

import argparse  # noqa: E402
import collections  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import multiprocessing as mp  # noqa: E402
import platform  # noqa: E402
import resource  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402

import torch.distributed as dist  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_mecefo.elastic.membership import keys  # noqa: E402
from megatron_mecefo.testing.counting import Counted  # noqa: E402

BASELINE = "efb62c9"
"""The last commit whose control plane scanned every member from every member (2N^2 per step)."""


def _serve(conn) -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=600))
    conn.send(store.port)
    conn.recv()  # until told to stop


class Job:
    """N simulated members of one job on the store at `port` (a fresh namespace per job)."""

    def __init__(self, impl, port: int, n: int, tag: str) -> None:
        self.impl, self.port, self.n = impl, port, n
        self.counts = collections.Counter()
        self.beats = collections.Counter()
        self.prefix = f"bench/{tag}"
        self.members = [self.member(r) for r in range(n)]

    def client(self):
        raw = dist.TCPStore("127.0.0.1", self.port, is_master=False, wait_for_workers=False,
                            timeout=timedelta(seconds=600))
        return dist.PrefixStore(self.prefix, raw)

    def member(self, rank: int):
        store = Counted(self.client(), self.counts, rank)
        connect = lambda: Counted(self.client(), self.beats, rank)  # noqa: E731
        m = self.impl.Membership(store, connect, rank, heartbeat_interval_s=1.0, heartbeat_timeout_s=10.0,
                                 agree_timeout_s=300.0)
        m.start()
        return m

    def stop(self) -> None:
        for m in self.members:
            m.stop()

    def run(self, ranks, fn) -> float:
        """fn(member) on each rank of `ranks` at once; returns the wall time until all returned."""
        errors = []

        def body(r):
            try:
                fn(self.members[r])
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append((r, e))

        threads = [threading.Thread(target=body, args=(r,)) for r in ranks]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise RuntimeError(f"{len(errors)} members failed, e.g. rank {errors[0][0]}: {errors[0][1]!r}")
        return time.monotonic() - t0

    def calls(self):
        total = sum(self.counts.values())
        busiest = max(self.counts.values()) if self.counts else 0
        self.counts.clear()
        return total, busiest


def healthy_replicated(impl, port, n, steps):
    """The store calls of a healthy step with a replicated optimizer state: the commit is the
    confirmation all-reduce (no store); the lowest member asks whether restarted ranks wait
    (`ElasticRuntime._admission`) and marks the progress (`_committed`). The launcher path counts
    the same in each step record's `store_calls` (tests/elastic/test_fault_tolerance.py)."""
    job = Job(impl, port, n, f"replicated{n}{impl.__name__}")
    job.calls()
    members = list(range(n))
    lowest = job.members[0]
    t0 = time.monotonic()
    for s in range(steps):
        assert lowest.joins.pending(members, 0) == []
        lowest.store.set(keys.PROGRESS, str(s + 1))
    wall = time.monotonic() - t0
    total, busiest = job.calls()
    job.stop()
    return {"calls": total / steps, "busiest": busiest / steps, "s": wall / steps}


def healthy(impl, port, n, steps):
    """A healthy step's vote (Membership.decide): the baseline's commit, and this tree's with a
    sharded optimizer state."""
    job = Job(impl, port, n, f"healthy{n}{impl.__name__}")
    job.calls()  # the members' start
    members = list(range(n))
    wall = 0.0
    for s in range(steps):
        wall += job.run(members, lambda m, s=s: m.decide(0, s, members, True, n))
    total, busiest = job.calls()
    job.stop()
    return {"calls": total / steps, "busiest": busiest / steps, "s": wall / steps}


def failure(impl, port, n):
    job = Job(impl, port, n, f"failure{n}{impl.__name__}")
    members, dead = list(range(n)), n - 1
    job.members[dead].stop()
    keys.mark_exited(job.members[0].store, dead)
    job.calls()

    def vote(m):
        assert not m.decide(0, 7, members, False, n).commit

    def agree(m):
        agreed = m.agree(1, members, 7)
        assert dead not in agreed.members and len(agreed.members) == n - 1

    voted = job.run(members[:-1], vote)
    votes = collections.Counter(job.counts)
    job.counts.clear()
    wall = job.run(members[:-1], agree)
    both = votes + job.counts
    total, busiest = job.calls()
    job.stop()
    # the agreement alone (what a replicated state's failure costs after its failed confirmation),
    # and with the vote before it (the sharded state's, and every failure's in the baseline)
    return {"calls": sum(both.values()), "busiest": max(both.values()), "s": voted + wall,
            "agreement": {"calls": total, "busiest": busiest, "s": wall}}


def admission(impl, port, n):
    job = Job(impl, port, n, f"admission{n}{impl.__name__}")
    members, joiner = list(range(n - 1)), n - 1
    job.calls()
    generation = {}

    def join(m):
        generation["g"] = m.request_join(time.monotonic() + 300)
        m.agree(generation["g"], list(range(n)), None)

    def train(m):
        s = 0
        while True:
            d = m.decide(0, s, members, True, n)
            s += 1
            if d.joiners:
                m.agree(d.next_generation, list(range(n)), s)
                return

    t = threading.Thread(target=lambda: job.run([joiner], join))
    t0 = time.monotonic()
    t.start()
    job.run(members, train)
    t.join()
    wall = time.monotonic() - t0
    total, busiest = job.calls()
    job.stop()
    return {"calls": total, "busiest": busiest, "s": wall}


def store_rate(port, seconds=2.0, clients=8):
    done = [0] * clients
    stop = time.monotonic() + seconds

    def hammer(i):
        store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
        while time.monotonic() < stop:
            store.add("rate", 0)
            done[i] += 1

    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(done) / seconds


def load_baseline(commit: str):
    """The membership module of `commit`, imported from git (never kept in the tree)."""
    source = subprocess.run(["git", "show", f"{commit}:megatron_mecefo/elastic/membership.py"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout
    path = Path(tempfile.mkdtemp()) / "membership_baseline.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("membership_baseline", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


LABELS = {"healthy_replicated": "healthy step, no vote", "healthy": "healthy step, vote",
          "failure": "failure to agreed generation", "admission": "admission of a joiner"}


def plot(result, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for impl, style in (("baseline", "--"), ("new", "-")):
        rows = [r for r in result["runs"] if r["impl"] == impl]
        for what, color in (("healthy_replicated", "C1"), ("healthy", "C0"), ("failure", "C3"), ("admission", "C2")):
            pts = [(r["n"], r[what]) for r in rows if r.get(what)]
            if not pts:
                continue
            ns = [p[0] for p in pts]
            label = f"{LABELS[what]} ({impl}{', sharded state' if what == 'healthy' and impl == 'new' else ''})"
            axes[0].plot(ns, [p[1]["calls"] for p in pts], style, color=color, marker="o", label=label)
            axes[1].plot(ns, [p[1]["s"] for p in pts], style, color=color, marker="o", label=label)
    axes[0].set_ylabel("store calls (healthy: per step; failure, admission: per event)")
    axes[1].set_ylabel("seconds (healthy: per step)")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("members N")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"control plane: one TCPStore, N simulated members ({result['store_calls_per_s']:.0f} store calls/s "
                 "sustained here)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[8, 64, 256, 1024, 4096])
    p.add_argument("--baseline", default=BASELINE, help="the commit whose membership.py is the baseline")
    p.add_argument("--baseline-max", type=int, default=256,
                   help="largest N the baseline runs at (its agreement costs 8N^2 calls: ~70 s at 256 here)")
    p.add_argument("--steps", type=int, default=3, help="healthy steps per N")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "control_plane.json")
    p.add_argument("--replot", action="store_true", help="redraw the PNG from the JSON only")
    args = p.parse_args(argv)
    if args.replot:
        plot(json.loads(args.out.read_text()), args.out.with_suffix(".png"))
        return 0
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    threading.stack_size(512 * 1024)
    parent, child = mp.Pipe()
    server = mp.get_context("spawn").Process(target=_serve, args=(child,), daemon=True)
    server.start()
    port = parent.recv()
    impls = {"new": sys.modules["megatron_mecefo.elastic.membership"], "baseline": load_baseline(args.baseline)}
    result = {"date": time.strftime("%Y-%m-%d"), "command": "python benchmarks/control_plane.py " + " ".join(argv or sys.argv[1:]),
              "machine": f"{platform.machine()}, {mp.cpu_count()} cores, members as threads of one process",
              "baseline_commit": args.baseline, "store_calls_per_s": store_rate(port), "runs": []}
    print(f"store sustains {result['store_calls_per_s']:.0f} calls/s", flush=True)
    for n in args.sizes:
        if 2 * n + 64 > hard:
            print(f"N={n}: skipped ({hard} file descriptors)")
            continue
        for name, impl in impls.items():
            if name == "baseline" and n > args.baseline_max:
                continue
            row = {"impl": name, "n": n}
            if name == "new":
                row["healthy_replicated"] = healthy_replicated(impl, port, n, args.steps)
            row["healthy"] = healthy(impl, port, n, args.steps if name == "new" or n <= 64 else 1)
            row["failure"] = failure(impl, port, n)
            row["admission"] = admission(impl, port, n)
            result["runs"].append(row)
            print(json.dumps(row), flush=True)
    parent.send("stop")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
