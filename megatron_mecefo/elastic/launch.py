"""mecefo-launch: start the ranks of a job, host its store, and keep survivors running.

    mecefo-launch --nproc-per-node 4 [--restart-failed-after 20] train.py --mecefo ...

Unlike torchrun or the `deepspeed` launcher, a rank that dies does not take the others down: the
launcher reports the exit and lets the survivors recover in-process (MeCeFO). With
`--restart-failed-after S` a failed rank is started again after S seconds (environment
MECEFO_INCARNATION > 0) and rejoins at a step boundary.

The store (a TCPStore) lives in this process on node 0, so any training rank may die without
taking the rendezvous with it. Ranks get RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT (the store; TORCHELASTIC_USE_AGENT_STORE=1 makes torch's env:// init
connect to it as a client), MECEFO_INCARNATION and MECEFO_LAUNCHER=1.

Exit status: 0 when every rank that ended on its own ended with 0 and at least one did; ranks
killed by a signal (crashes absorbed by MeCeFO) do not count; otherwise the first non-zero code.
A rank still stopped (SIGSTOP, a hang) once all others have ended is killed and reported.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

__all__ = ["main", "host_store"]

logger = logging.getLogger("mecefo-launch")


def host_store(host: str, port: int) -> dist.TCPStore:
    """Host the job's TCPStore (port 0: any free port; read it back from `.port`)."""
    return dist.TCPStore(host, port, is_master=True, timeout=timedelta(seconds=300), wait_for_workers=False)


def _stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except OSError:
        return False


def _describe(code: int) -> str:
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


class _Rank:
    def __init__(self, rank: int, local_rank: int):
        self.rank, self.local_rank = rank, local_rank
        self.proc: Optional[subprocess.Popen] = None
        self.incarnation = 0
        self.final: Optional[int] = None
        self.restart_at: Optional[float] = None


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="mecefo-launch", description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=1)
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", "--node_rank", type=int, default=0)
    p.add_argument("--master-addr", "--master_addr", default="127.0.0.1")
    p.add_argument("--master-port", "--master_port", type=int, default=29500, help="store port (0: any free port, node 0 only)")
    p.add_argument("--restart-failed-after", type=float, default=None, metavar="SECONDS",
                   help="restart a failed rank after this many seconds so it rejoins")
    p.add_argument("--max-restarts", type=int, default=3, help="restarts per rank (3)")
    p.add_argument("script")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    if args.nproc_per_node < 1 or args.nnodes < 1 or not 0 <= args.node_rank < args.nnodes:
        p.error("need nproc-per-node >= 1, nnodes >= 1 and 0 <= node-rank < nnodes")
    if args.master_port == 0 and args.nnodes > 1:
        p.error("--master-port 0 works on a single node only")
    return args


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="[mecefo-launch] %(message)s")
    args = parse_args(argv)
    world = args.nnodes * args.nproc_per_node
    store = host_store("0.0.0.0" if args.nnodes > 1 else args.master_addr, args.master_port) if args.node_rank == 0 else None
    port = store.port if store is not None else args.master_port
    ranks = [_Rank(args.node_rank * args.nproc_per_node + i, i) for i in range(args.nproc_per_node)]
    client = store if store is not None else dist.TCPStore(
        args.master_addr, port, is_master=False, timeout=timedelta(seconds=300), wait_for_workers=False)

    def report_exit(rank: int) -> None:
        """Tell the survivors at once (membership reads `exited/{rank}`)."""
        try:
            client.set(f"exited/{rank}", "1")
        except Exception as e:
            logger.info("could not record the exit of rank %d in the store: %s", rank, e)

    def spawn(r: _Rank) -> None:
        env = dict(
            os.environ, RANK=str(r.rank), LOCAL_RANK=str(r.local_rank), WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(args.nproc_per_node), MASTER_ADDR=args.master_addr, MASTER_PORT=str(port),
            TORCHELASTIC_USE_AGENT_STORE="1", MECEFO_INCARNATION=str(r.incarnation), MECEFO_LAUNCHER="1",
        )
        r.proc = subprocess.Popen([sys.executable, "-u", args.script, *args.script_args], env=env)
        logger.info("rank %d started (pid %d, incarnation %d)", r.rank, r.proc.pid, r.incarnation)

    def forward_signal(signum, _frame):
        for r in ranks:
            if r.proc is not None and r.proc.poll() is None:
                r.proc.send_signal(signum)

    signal.signal(signal.SIGTERM, forward_signal)
    signal.signal(signal.SIGINT, forward_signal)
    for r in ranks:
        spawn(r)
    first_error: Optional[int] = None
    ok_exits = 0
    while True:
        now = time.monotonic()
        for r in ranks:
            if r.proc is None:
                if r.restart_at is not None and now >= r.restart_at:
                    r.restart_at = None
                    r.incarnation += 1
                    spawn(r)
                continue
            code = r.proc.poll()
            if code is None:
                continue
            logger.info("rank %d (pid %d) ended: %s", r.rank, r.proc.pid, _describe(code))
            r.proc, r.final = None, code
            if code != 0:
                report_exit(r.rank)
            if code == 0:
                ok_exits += 1
                continue
            if code > 0 and first_error is None:
                first_error = code
            others_running = any(o.proc is not None and o.proc.poll() is None for o in ranks if o is not r)
            if args.restart_failed_after is not None and r.incarnation < args.max_restarts and others_running:
                r.restart_at = now + args.restart_failed_after
                logger.info("rank %d will restart in %.1f s", r.rank, args.restart_failed_after)
        live = [r for r in ranks if r.proc is not None]
        if live and all(_stopped(r.proc.pid) for r in live) and not any(r.restart_at for r in ranks):
            for r in live:
                logger.info("rank %d is stopped (hung) and all others ended: killing it", r.rank)
                r.proc.kill()
                r.proc.wait()
                r.proc, r.final = None, -signal.SIGKILL
                report_exit(r.rank)
        if not any(r.proc is not None or r.restart_at is not None for r in ranks):
            break
        time.sleep(0.1)
    if first_error is not None:
        return first_error
    return 0 if ok_exits else 1


if __name__ == "__main__":
    sys.exit(main())
