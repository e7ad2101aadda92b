"""mecefo-launch: start the ranks of a job, host its store, and keep survivors running.

    mecefo-launch --nproc-per-node 4 [--restart-failed-after 20] train.py --mecefo ...

Unlike torchrun or the `deepspeed` launcher, a rank that dies does not take the others down: the
launcher reports the exit and lets the survivors recover in-process (MeCeFO). With
`--restart-failed-after S` a failed rank is started again after S seconds (environment
MECEFO_INCARNATION > 0) and rejoins at a step boundary.

The store (a TCPStore) lives in this process on node 0, so any training rank may die without
taking the rendezvous with it. It listens on --master-addr only (127.0.0.1 by default) and belongs
to one job: the launcher makes the job's id (node 0; the other nodes read it from the store) and
every key lives under it. For multi-node jobs that must survive the loss of node 0 too, run the
store on a head node (`mecefo-store --host HEAD --port PORT`) and start every node's launcher with
`--external-store --master-addr HEAD --master-port PORT`: then every launcher is a client. A port already taken (say, by the lingering store of an earlier run) ends
the launcher with exit status 2 and a message saying what holds it. Ranks get RANK, LOCAL_RANK,
WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT (the store; TORCHELASTIC_USE_AGENT_STORE=1
makes torch's env:// init connect to it as a client), MECEFO_INCARNATION, MECEFO_JOB_ID,
MECEFO_MAX_RESTARTS (what a trace may count on) and MECEFO_LAUNCHER=1.

The job ends early, with no more restarts, when:
* a rank gives up (exit status 3, or `job/failed` in the store: no cover possible, no member with
  the state left): the others end on their own (they read the store; `--give-up-grace` seconds for
  the checkpoint), hung ranks are killed, and the launcher exits 3 naming the reason and checkpoint;
* it receives SIGTERM or SIGINT (a scheduler cancelling the job): every rank gets SIGTERM (SIGKILL
  after `--term-grace` s), and the launcher exits 128 + the signal number;
* (single node) no rank is left running: a failed rank is not restarted into a job with no member;
* a rank exits with status 2 (bad input, found before training): the others get SIGTERM and the
  launcher exits 2.
Ranks die with the launcher (Linux PR_SET_PDEATHSIG), so a killed launcher leaves none behind.

Exit status otherwise: 0 when every rank that ended on its own ended with 0 and at least one did;
ranks killed by a signal (crashes absorbed by MeCeFO) do not count; otherwise the first non-zero
code. A rank still stopped (SIGSTOP, a hang) once all others have ended is killed and reported.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from typing import Optional

from megatron_mecefo.elastic import store as job_store
from megatron_mecefo.errors import GAVE_UP_EXIT_CODE, RETIRED_EXIT_CODE, USAGE_EXIT_CODE

__all__ = ["main"]

logger = logging.getLogger("mecefo-launch")


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
    p.add_argument("--master-addr", "--master_addr", default="127.0.0.1",
                   help="node 0's address; the store listens on it only (127.0.0.1)")
    p.add_argument("--master-port", "--master_port", type=int, default=29500, help="store port (0: any free port, node 0 only)")
    p.add_argument("--external-store", action="store_true",
                   help="the store runs elsewhere (mecefo-store on a head node at --master-addr:--master-port); "
                        "node 0 does not host it, so losing any node is survived")
    p.add_argument("--restart-failed-after", type=float, default=None, metavar="SECONDS",
                   help="restart a failed rank after this many seconds so it rejoins")
    p.add_argument("--max-restarts", type=int, default=3, help="restarts per rank (3)")
    p.add_argument("--give-up-grace", type=float, default=300.0, metavar="SECONDS",
                   help="when the job gives up, how long ranks get to write the checkpoint and end (300)")
    p.add_argument("--term-grace", type=float, default=10.0, metavar="SECONDS",
                   help="after SIGTERM/SIGINT, how long ranks get to end before SIGKILL (10)")
    p.add_argument("script")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    if args.nproc_per_node < 1 or args.nnodes < 1 or not 0 <= args.node_rank < args.nnodes:
        p.error("need nproc-per-node >= 1, nnodes >= 1 and 0 <= node-rank < nnodes")
    if args.master_port == 0 and (args.nnodes > 1 or args.external_store):
        p.error("--master-port 0 works on a single node that hosts the store only")
    return args


def _die_with_parent(parent: int):
    """preexec_fn: the rank gets SIGKILL when the launcher dies (Linux PR_SET_PDEATHSIG), so ranks
    never outlive a killed launcher (whose store they need anyway)."""
    def setup():
        try:
            import ctypes

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
        except Exception:  # not Linux: the ranks end when their store connection breaks instead
            return
        if os.getppid() != parent:  # the launcher died before prctl took effect
            os._exit(1)
    return setup


def _job_outcome(client) -> Optional[dict]:
    """The store's record of a give-up (`job/failed`), or None."""
    try:
        if client.check(["job/failed"]):
            out = json.loads(client.get("job/failed"))
            if client.check(["job/checkpoint"]):
                out["checkpoint"] = json.loads(client.get("job/checkpoint"))
            return out
    except Exception as e:  # the store is unreachable: the local view decides
        logger.info("could not read the job's outcome from the store: %s", e)
    return None


def _job_finished(client) -> bool:
    try:
        return bool(client.check(["job/finished"]))
    except Exception:
        return False


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="[mecefo-launch] %(message)s")
    args = parse_args(argv)
    world = args.nnodes * args.nproc_per_node
    timeout = timedelta(seconds=300)
    try:
        if args.node_rank == 0 and not args.external_store:
            job_id = job_store.new_job_id()
            raw = job_store.host_store(args.master_addr, args.master_port, job_id, timeout)
        else:
            raw = job_store.client(args.master_addr, args.master_port, timeout)
            job_id = job_store.read_job(raw, f"{args.master_addr}:{args.master_port}")["id"]
    except OSError as e:
        busy = e.errno == 98  # EADDRINUSE
        logger.error("cannot host the job's store: %s", job_store.describe_busy_port(args.master_addr, args.master_port)
                     if busy else e)
        return USAGE_EXIT_CODE
    except Exception as e:  # JobConflict, or node 0 unreachable
        logger.error("cannot reach the job's store at %s:%d: %s", args.master_addr, args.master_port, e)
        return USAGE_EXIT_CODE
    port = raw.port if args.node_rank == 0 and not args.external_store else args.master_port
    client = job_store.job_store(raw, job_id)
    logger.info("job %s: store on %s:%d", job_id, args.master_addr, port)
    ranks = [_Rank(args.node_rank * args.nproc_per_node + i, i) for i in range(args.nproc_per_node)]
    max_restarts = args.max_restarts if args.restart_failed_after is not None else 0

    def report_exit(r: _Rank) -> None:
        """Tell the survivors at once (membership reads `exited/{rank}`; a replica's rendezvous reads
        `exited/{rank}/{incarnation}`, which is never cleared)."""
        try:
            client.set(f"exited/{r.rank}", "1")
            client.set(f"exited/{r.rank}/{r.incarnation}", "1")
        except Exception as e:
            logger.info("could not record the exit of rank %d in the store: %s", r.rank, e)

    def spawn(r: _Rank) -> None:
        env = dict(
            os.environ, RANK=str(r.rank), LOCAL_RANK=str(r.local_rank), WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(args.nproc_per_node), MASTER_ADDR=args.master_addr, MASTER_PORT=str(port),
            TORCHELASTIC_USE_AGENT_STORE="1", MECEFO_INCARNATION=str(r.incarnation), MECEFO_LAUNCHER="1",
            MECEFO_JOB_ID=job_id, MECEFO_MAX_RESTARTS=str(max_restarts),
        )
        r.proc = subprocess.Popen([sys.executable, "-u", args.script, *args.script_args], env=env,
                                  preexec_fn=_die_with_parent(os.getpid()))
        logger.info("rank %d started (pid %d, incarnation %d)", r.rank, r.proc.pid, r.incarnation)

    # Why the job ends early, if it does: ("signal", signum) from a scheduler's SIGTERM / SIGINT,
    # ("gave_up", None) when a rank gave up (exit 3 or job/failed), ("no_rank", None) when no rank
    # of this single-node job is left running to restart into, ("usage", None) when a rank found
    # bad input (exit 2).
    ending: list = []
    end_deadline = [None]

    def terminate_all(why: tuple) -> None:
        """End the job now: no restarts, SIGTERM to every running rank (SIGKILL to stopped ones)."""
        ending[:] = [why]
        end_deadline[0] = time.monotonic() + args.term_grace
        for r in ranks:
            r.restart_at = None
            if r.proc is not None and r.proc.poll() is None:
                if _stopped(r.proc.pid):
                    r.proc.kill()
                else:
                    r.proc.send_signal(signal.SIGTERM)

    def on_signal(signum, _frame):
        if not ending or ending[0][0] != "signal":
            logger.info("received %s: ending every rank, no restarts", signal.Signals(signum).name)
            terminate_all(("signal", signum))

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    for r in ranks:
        spawn(r)
    first_error: Optional[int] = None
    ok_exits = 0
    while True:
        now = time.monotonic()
        if not ending and _job_outcome(client) is not None:
            ending[:] = [("gave_up", None)]
        if ending and end_deadline[0] is None:
            end_deadline[0] = now + (args.give_up_grace if ending[0][0] == "gave_up" else args.term_grace)
        for r in ranks:
            if r.proc is None:
                if ending or _job_finished(client):
                    r.restart_at = None
                if r.restart_at is not None and now >= r.restart_at:
                    r.restart_at = None
                    r.incarnation += 1
                    spawn(r)
                continue
            code = r.proc.poll()
            if code is None:
                if ending and _stopped(r.proc.pid):  # a hung rank cannot end on its own
                    logger.info("rank %d is stopped (hung) and the job is ending: killing it", r.rank)
                    r.proc.kill()
                continue
            logger.info("rank %d (pid %d) ended: %s", r.rank, r.proc.pid, _describe(code))
            r.proc, r.final = None, code
            if code != 0:
                report_exit(r)
            if code == 0:
                ok_exits += 1
                continue
            if code == GAVE_UP_EXIT_CODE and not ending:
                ending[:] = [("gave_up", None)]
            if code == USAGE_EXIT_CODE and not ending:
                logger.info("rank %d found bad input (exit 2): ending the job, no restarts", r.rank)
                terminate_all(("usage", None))
            if code > 0 and code != RETIRED_EXIT_CODE and first_error is None:  # a retired rank is no error
                first_error = code
            others_running = any(o.proc is not None and o.proc.poll() is None and not _stopped(o.proc.pid)
                                 for o in ranks if o is not r)
            if ending:
                continue
            if args.restart_failed_after is not None and r.incarnation < args.max_restarts:
                if others_running or args.nnodes > 1:
                    r.restart_at = now + args.restart_failed_after
                    logger.info("rank %d will restart in %.1f s", r.rank, args.restart_failed_after)
                else:
                    logger.info("rank %d is not restarted: no rank of the job is left running to rejoin", r.rank)
        live = [r for r in ranks if r.proc is not None]
        # every rank crashed or hangs (and none failed on its own: that error is reported as it is)
        if not ending and args.nnodes == 1 and first_error is None and not any(not _stopped(r.proc.pid) for r in live) \
                and (live or any((r.final or 0) < 0 for r in ranks)) and not _job_finished(client):
            ending[:] = [("no_rank", None)]
            logger.info("no rank of the job is left running: pending restarts are cancelled")
            try:
                client.compare_set("job/failed", "", json.dumps(
                    {"reason": "no rank of the job is left running (every rank holding the state failed)"}))
            except Exception as e:
                logger.info("could not record the outcome in the store: %s", e)
            for r in ranks:
                r.restart_at = None
        if live and all(_stopped(r.proc.pid) for r in live) and not any(r.restart_at for r in ranks):
            for r in live:
                logger.info("rank %d is stopped (hung) and all others ended: killing it", r.rank)
                r.proc.kill()
                r.proc.wait()
                r.proc, r.final = None, -signal.SIGKILL
                report_exit(r)
        if ending and end_deadline[0] is not None and now > end_deadline[0]:
            for r in live:
                if r.proc.poll() is None:
                    logger.info("rank %d did not end within the grace period: killing it", r.rank)
                    r.proc.kill()
            end_deadline[0] = now + 5.0
        if not any(r.proc is not None or r.restart_at is not None for r in ranks):
            break
        time.sleep(0.1)
    if ending and ending[0][0] == "signal":
        return 128 + ending[0][1]
    if ending and ending[0][0] == "usage":
        return USAGE_EXIT_CODE
    outcome = _job_outcome(client)
    if outcome is not None or (ending and ending[0][0] in ("gave_up", "no_rank")):
        reason = (outcome or {}).get("reason", "a rank exited with status 3")
        ckpt = (outcome or {}).get("checkpoint")
        where = (f"checkpoint of step {ckpt['step']} at {ckpt['path']}" if ckpt else "no checkpoint was written")
        logger.error("the job gave up: %s; %s", reason, where)
        return GAVE_UP_EXIT_CODE
    if first_error is not None:
        return first_error
    return 0 if ok_exits else 1


if __name__ == "__main__":
    sys.exit(main())
