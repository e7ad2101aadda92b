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
MECEFO_MAX_RESTARTS (what a trace may count on), MECEFO_LAUNCHER=1 and the NCCL settings in-process
recovery needs (nccl_env.py; a value the user set is kept, and reported when unsafe).

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

`--preload` (or MECEFO_PRELOAD=1 in the environment; `--no-preload` wins over it) starts every rank,
restarts included, by forking one parent per node that imported torch, DeepSpeed, Megatron-Core and
the script's own top-level imports once (or the modules `--preload-modules` / MECEFO_PRELOAD names):
a restarted rank skips seconds of imports on its way back (preload.py). A module that fails to import
there, or a parent left with a thread or CUDA after its imports, ends the launcher with exit 2 before
any rank starts, saying which and why. With MECEFO_PRELOAD_SERVER naming the socket of a zygote
server (the tests': megatron_mecefo/testing/zygotes.py) the parent is forked from a process that
imported them already, and started as above where none answers.

Exit status otherwise: 0 when every rank that ended on its own ended with 0 and at least one did;
ranks killed by a signal (crashes absorbed by MeCeFO) do not count; otherwise the first non-zero
code. A rank still stopped (SIGSTOP, a hang) once all others have ended is killed and reported.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from datetime import timedelta

from megatron_mecefo.elastic.comm import nccl_env
from megatron_mecefo.elastic.comm import store as job_store
from megatron_mecefo.elastic.launch import preload
from megatron_mecefo.elastic.launch.supervise import Rank, Supervisor
from megatron_mecefo.errors import USAGE_EXIT_CODE
from megatron_mecefo.version import __version__

__all__ = ["main"]

logger = logging.getLogger("mecefo-launch")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="mecefo-launch", description=__doc__.split("\n\n")[0])
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
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
    p.add_argument("--preload", action="store_true",
                   help="fork every rank, restarts included, from a parent that imported torch, deepspeed, "
                        "megatron.core and the script's top-level imports once (also: MECEFO_PRELOAD=1)")
    p.add_argument("--preload-modules", default=None, metavar="M1,M2",
                   help="with --preload: import exactly these modules in the parent; `script` stands for the "
                        "script's top-level imports (also: MECEFO_PRELOAD=M1,M2)")
    p.add_argument("--no-preload", action="store_true", help="spawn every rank (wins over MECEFO_PRELOAD)")
    p.add_argument("script")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    if args.nproc_per_node < 1 or args.nnodes < 1 or not 0 <= args.node_rank < args.nnodes:
        p.error("need nproc-per-node >= 1, nnodes >= 1 and 0 <= node-rank < nnodes")
    if args.master_port == 0 and (args.nnodes > 1 or args.external_store):
        p.error("--master-port 0 works on a single node that hosts the store only")
    # what to preload: None (spawn), "auto" or a module list (preload.modules_for)
    env = os.environ.get("MECEFO_PRELOAD", "").strip()
    if args.no_preload:
        args.preload = None
    elif args.preload or args.preload_modules:
        args.preload = args.preload_modules or "auto"
    else:
        args.preload = None if env in ("", "0") else "auto" if env == "1" else env
    return args


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
    ranks = [Rank(args.node_rank * args.nproc_per_node + i, i) for i in range(args.nproc_per_node)]
    max_restarts = args.max_restarts if args.restart_failed_after is not None else 0
    nccl = nccl_env.for_children(logger.warning)  # before the ranks' CUDA/NCCL start

    def env_for(r: Rank) -> dict:
        return dict(
            os.environ, **nccl, RANK=str(r.rank), LOCAL_RANK=str(r.local_rank), WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(args.nproc_per_node), MASTER_ADDR=args.master_addr, MASTER_PORT=str(port),
            TORCHELASTIC_USE_AGENT_STORE="1", MECEFO_INCARNATION=str(r.incarnation), MECEFO_LAUNCHER="1",
            MECEFO_JOB_ID=job_id, MECEFO_MAX_RESTARTS=str(max_restarts),
        )

    forker = None
    if args.preload is not None:
        try:
            modules = preload.modules_for(args.preload, args.script)
            server = os.environ.get("MECEFO_PRELOAD_SERVER", "")
            forker = preload.Preloader.start(args.script, args.script_args, modules, dict(os.environ, **nccl),
                                             server=server if server not in ("", "0") else None)
        except (OSError, SyntaxError, preload.PreloadError) as e:
            logger.error("--preload: %s (run without --preload, or name the modules to preload: --preload-modules M1,M2)", e)
            return USAGE_EXIT_CODE
        logger.info("preloaded %s in %.1f s%s: ranks are forked from it", ", ".join(modules) or "nothing",
                    forker.import_s, " (forked from a zygote of MECEFO_PRELOAD_SERVER)" if forker.shared else "")
    try:
        return Supervisor(ranks, [sys.executable, "-u", args.script, *args.script_args], env_for, client,
                          restart_failed_after=args.restart_failed_after, max_restarts=args.max_restarts,
                          give_up_grace=args.give_up_grace, term_grace=args.term_grace, whole_job=args.nnodes == 1,
                          logger=logger, forker=forker).run()
    finally:
        if forker is not None:
            forker.close()


if __name__ == "__main__":
    sys.exit(main())
