"""The control plane's store traffic against N: the real membership code, N simulated members.

N members are threads of this process, each with its own connection to one TCPStore served by a
separate process (as the launcher or `mecefo-store` serves a job's). Every store call of a member's
training thread is counted; its heartbeat thread's calls are counted apart. For each N, the code of
this tree ("new") and of an earlier commit ("baseline", read from git) run side by side:

  healthy     every member votes ok for one step (Membership.votes.decide: the baseline's commit, and
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


class Members:
    """Some simulated members of one job (a fresh namespace per job) on the store at `port`: the
    ranks of `ranks`, each a Membership on its own connection (training thread) and a second one
    (heartbeat thread); every store call counted per rank."""

    def __init__(self, impl, port: int, n: int, tag: str, ranks, hb_timeout_s: float = 10.0) -> None:
        self.impl, self.port, self.n, self.hb_timeout_s = impl, port, n, hb_timeout_s
        self.counts = collections.Counter()
        self.beats = collections.Counter()
        self.prefix = f"bench/{tag}"
        self.members = {r: self.member(r) for r in ranks}

    def client(self):
        raw = dist.TCPStore("127.0.0.1", self.port, is_master=False, wait_for_workers=False,
                            timeout=timedelta(seconds=600))
        return dist.PrefixStore(self.prefix, raw)

    def member(self, rank: int):
        store = Counted(self.client(), self.counts, rank)
        connect = lambda: Counted(self.client(), self.beats, rank)  # noqa: E731
        m = self.impl.Membership(store, connect, rank, heartbeat_interval_s=1.0, heartbeat_timeout_s=self.hb_timeout_s,
                                 agree_timeout_s=300.0)
        m.start()
        return m

    def run(self, ranks, action: str, args=()) -> tuple:
        """ACTIONS[action](member, *args) on each of `ranks` held here, at once; returns (start, end)
        on the system's monotonic clock (one clock for every process of the machine)."""
        errors = []

        def body(r):
            try:
                ACTIONS[action](self.members[r], *args)
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append((r, e))

        threads = [threading.Thread(target=body, args=(r,)) for r in ranks if r in self.members]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise RuntimeError(f"{len(errors)} members failed, e.g. rank {errors[0][0]}: {errors[0][1]!r}")
        return t0, time.monotonic()

    def take_counts(self) -> collections.Counter:
        counts = collections.Counter(self.counts)
        self.counts.clear()
        return counts

    def stop(self, ranks=None) -> None:
        for r, m in self.members.items():
            if ranks is None or r in ranks:
                m.stop()


def _worker(conn, impl_name: str, baseline: str) -> None:
    """A process holding some members of each job: runs what the parent sends (see Job)."""
    threading.stack_size(512 * 1024)
    impl = load_impl(impl_name, baseline)
    jobs = {}
    while True:
        cmd, *args = conn.recv()
        try:
            if cmd == "job":
                tag, port, n, ranks, hb_timeout_s = args
                jobs[tag] = Members(impl, port, n, tag, ranks, hb_timeout_s)
                out = None
            elif cmd == "run":
                tag, ranks, action, action_args = args
                out = jobs[tag].run(ranks, action, action_args)
            elif cmd == "counts":
                out = jobs[args[0]].take_counts()
            elif cmd == "stop":
                tag, ranks = args
                jobs[tag].stop(ranks)
                if ranks is None:
                    del jobs[tag]
                out = None
            else:  # "exit"
                conn.send(("ok", None))
                return
            conn.send(("ok", out))
        except Exception as e:  # noqa: BLE001 - the parent raises it
            conn.send(("error", repr(e)))


SPREAD_HB_TIMEOUT_S = 60.0
"""The members' heartbeat timeout where they are spread over processes (thousands of threads on a
few cores: a member starved for 10 s would be presumed dead, which the store's load does not cause)."""


class Job:
    """N simulated members of one job: threads of this process (`workers` empty), or spread over
    the worker processes (rank r in worker r % len(workers)) where one process cannot hold them."""

    def __init__(self, impl, port: int, n: int, tag: str, workers=()) -> None:
        self.n, self.tag, self.workers = n, tag, list(workers)
        if not self.workers:
            self.local = Members(impl, port, n, tag, range(n))
        else:
            self.local = None
            self._all("job", lambda i: (tag, port, n, list(range(i, n, len(self.workers))), SPREAD_HB_TIMEOUT_S))

    def _all(self, cmd, args_of) -> list:
        for i, w in enumerate(self.workers):
            w.send((cmd, *args_of(i)))
        replies = [w.recv() for w in self.workers]
        bad = [r[1] for r in replies if r[0] != "ok"]
        if bad:
            raise RuntimeError(f"a worker failed: {bad[0]}")
        return [r[1] for r in replies]

    def run(self, ranks, action: str, *args) -> float:
        """ACTIONS[action](member, *args) on each rank of `ranks` at once; returns the wall time from
        the first start until all returned."""
        if self.local is not None:
            t0, t1 = self.local.run(ranks, action, args)
            return t1 - t0
        ranks = list(ranks)
        spans = self._all("run", lambda i: (self.tag, [r for r in ranks if r % len(self.workers) == i], action, args))
        return max(t1 for _, t1 in spans) - min(t0 for t0, _ in spans)

    def counts(self) -> collections.Counter:
        """The training threads' store calls per rank since the last call."""
        if self.local is not None:
            return self.local.take_counts()
        total = collections.Counter()
        for c in self._all("counts", lambda i: (self.tag,)):
            total.update(c)
        return total

    def calls(self):
        counts = self.counts()
        return sum(counts.values()), max(counts.values()) if counts else 0

    def stop(self, ranks=None) -> None:
        if self.local is not None:
            self.local.stop(ranks)
        else:
            self._all("stop", lambda i: (self.tag, ranks))


# What a member does in each measurement (module level: the worker processes look them up by name).

def _pending_none(m, n):
    assert m.joins.pending(list(range(n)), 0) == []


def _mark_progress(m, s):
    m.store.set(keys.PROGRESS, str(s + 1))


def _votes(m):
    """The step votes: a handle of this tree's Membership, methods of the baseline's."""
    return getattr(m, "votes", m)


def _generations(m):
    return getattr(m, "generations", m)


def _decide_ok(m, s, n):
    _votes(m).decide(0, s, list(range(n)), True, n)


def _mark_exited(m, rank):
    keys.mark_exited(m.store, rank)


def _vote_abort(m, n):
    assert not _votes(m).decide(0, 7, list(range(n)), False, n).commit


def _agree_without(m, n, dead):
    agreed = _generations(m).agree(1, list(range(n)), 7)
    assert dead not in agreed.members and len(agreed.members) == n - 1


def _join(m, n):
    _generations(m).agree(m.request_join(time.monotonic() + 300), list(range(n)), None)


def _train_until_admitted(m, n):
    members, s = list(range(n - 1)), 0
    while True:
        d = _votes(m).decide(0, s, members, True, n)
        s += 1
        if d.joiners:
            _generations(m).agree(d.next_generation, list(range(n)), s)
            return


ACTIONS = {f.__name__.lstrip("_"): f for f in (_pending_none, _mark_progress, _decide_ok, _mark_exited, _vote_abort,
                                               _agree_without, _join, _train_until_admitted)}


def healthy_replicated(impl, port, n, steps, workers=()):
    """The store calls of a healthy step with a replicated optimizer state: the commit is the
    confirmation all-reduce (no store); the lowest member asks whether restarted ranks wait
    (`ElasticRuntime._admission`) and marks the progress (`_committed`). The launcher path counts
    the same in each step record's `store_calls` (tests/elastic/test_fault_tolerance.py)."""
    job = Job(impl, port, n, f"replicated{n}{impl.__name__}", workers)
    job.calls()
    wall = 0.0
    for s in range(steps):
        wall += job.run([0], "pending_none", n)
        wall += job.run([0], "mark_progress", s)
    total, busiest = job.calls()
    job.stop()
    return {"calls": total / steps, "busiest": busiest / steps, "s": wall / steps}


def healthy(impl, port, n, steps, workers=()):
    """A healthy step's vote (Membership.votes.decide): the baseline's commit, and this tree's with a
    sharded optimizer state."""
    job = Job(impl, port, n, f"healthy{n}{impl.__name__}", workers)
    job.calls()  # the members' start
    wall = 0.0
    for s in range(steps):
        wall += job.run(range(n), "decide_ok", s, n)
    total, busiest = job.calls()
    job.stop()
    return {"calls": total / steps, "busiest": busiest / steps, "s": wall / steps}


def failure(impl, port, n, workers=()):
    job = Job(impl, port, n, f"failure{n}{impl.__name__}", workers)
    dead = n - 1
    job.stop([dead])
    job.run([0], "mark_exited", dead)
    job.calls()
    voted = job.run(range(n - 1), "vote_abort", n)
    votes = job.counts()
    wall = job.run(range(n - 1), "agree_without", n, dead)
    agreement = job.counts()
    job.stop()
    both = votes + agreement
    # the agreement alone (what a replicated state's failure costs after its failed confirmation),
    # and with the vote before it (the sharded state's, and every failure's in the baseline)
    return {"calls": sum(both.values()), "busiest": max(both.values()), "s": voted + wall,
            "agreement": {"calls": sum(agreement.values()), "busiest": max(agreement.values()), "s": wall}}


def admission(impl, port, n, workers=()):
    job = Job(impl, port, n, f"admission{n}{impl.__name__}", workers)
    joiner = n - 1
    job.calls()
    if not workers:  # the joiner in its own thread, the members beside it
        t = threading.Thread(target=lambda: job.run([joiner], "join", n))
        t0 = time.monotonic()
        t.start()
        job.run(range(n - 1), "train_until_admitted", n)
        t.join()
        wall = time.monotonic() - t0
    else:  # one run: the joiner's worker runs it beside its share of the members
        wall = job.run(range(n), "admission_role", n)
    total, busiest = job.calls()
    job.stop()
    return {"calls": total, "busiest": busiest, "s": wall}


def _admission_role(m, n):
    (_join if m.rank == n - 1 else _train_until_admitted)(m, n)


ACTIONS["admission_role"] = _admission_role


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


def load_impl(name: str, baseline: str):
    """"new": this tree's membership package; "baseline": the module of commit `baseline`."""
    if name == "new":
        import megatron_mecefo.elastic.membership as impl

        return impl
    return load_baseline(baseline)


def start_workers(count: int, name: str, baseline: str) -> list:
    ctx = mp.get_context("spawn")
    conns = []
    for _ in range(count):
        parent, child = ctx.Pipe()
        ctx.Process(target=_worker, args=(child, name, baseline), daemon=True).start()
        conns.append(parent)
    return conns


def restart_workers(conns, name: str, baseline: str) -> list:
    """Fresh workers after a failed part (its members' threads may still run)."""
    if not conns:
        return conns
    for c in conns:
        c.close()
    return start_workers(len(conns), name, baseline)


def stop_workers(conns) -> None:
    for c in conns:
        c.send(("exit",))
        c.recv()


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
            pts = [(r["n"], r[what]) for r in rows if r.get(what) and "error" not in r[what]]
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
    p.add_argument("--procs", type=int, default=4,
                   help="worker processes that hold the members from --procs-from members on")
    p.add_argument("--procs-from", type=int, default=2048,
                   help="smallest N whose members are spread over --procs processes (below: threads of this one)")
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
    impls = {"new": load_impl("new", args.baseline), "baseline": load_baseline(args.baseline)}
    result = {"date": time.strftime("%Y-%m-%d"), "command": "python benchmarks/control_plane.py " + " ".join(argv or sys.argv[1:]),
              "machine": f"{platform.machine()}, {mp.cpu_count()} cores, members as threads of one process "
                         f"(from N = {args.procs_from} on: of {args.procs} processes)",
              "baseline_commit": args.baseline, "store_calls_per_s": store_rate(port), "runs": []}
    print(f"store sustains {result['store_calls_per_s']:.0f} calls/s", flush=True)
    for n in args.sizes:
        if 2 * n + 64 > hard:  # the store server holds two connections per member
            print(f"N={n}: skipped ({hard} file descriptors)")
            continue
        for name, impl in impls.items():
            if name == "baseline" and n > args.baseline_max:
                continue
            workers = start_workers(args.procs, name, args.baseline) if n >= args.procs_from else []
            t0 = time.monotonic()
            row = {"impl": name, "n": n, "processes": max(1, len(workers))}
            parts = {"healthy_replicated": lambda: healthy_replicated(impl, port, n, args.steps, workers),
                     "healthy": lambda: healthy(impl, port, n, args.steps if name == "new" or n <= 64 else 1, workers),
                     "failure": lambda: failure(impl, port, n, workers),
                     "admission": lambda: admission(impl, port, n, workers)}
            if name != "new":
                del parts["healthy_replicated"]
            for part, measure in parts.items():
                try:
                    row[part] = measure()
                except RuntimeError as e:  # kept in the row: one part that failed does not hide the others
                    row[part] = {"error": str(e)[:300]}
                    workers = restart_workers(workers, name, args.baseline)
            row["wall_s"] = time.monotonic() - t0
            stop_workers(workers)
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
