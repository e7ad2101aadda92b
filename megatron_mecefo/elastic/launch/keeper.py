"""The keeper: fault tolerance under a launcher that is not ours (deepspeed, torchrun, srun, by hand).

Those launchers end (deepspeed) or restart (torchrun) every rank of a node when one exits non-zero,
so a crashed rank would take the others with it. With MeCeFO on, the process such a launcher starts
stays a small supervisor, the keeper: it runs the training in a child (the same command line, again),
records the child's abnormal exit in the job's store at once (the survivors need not wait out a
heartbeat timeout), restarts it after `restart_failed_after` seconds so it rejoins, and exits only
with the job: 0 when training finished, 3 when it gave up, 2 on bad input, 128 + N when a signal N
(SIGTERM, SIGINT: the launcher or scheduler) ends it, which it forwards to the child first. The child
dies with its keeper (PR_SET_PDEATHSIG). The keeper holds no model, no data and no accelerator.

The job's store (elastic/comm/store.py), in order of preference:
* `store` = HOST:PORT: a `mecefo-store` on a node that does not train; losing any node is survived;
* under torchrun: the agent's own store (MASTER_ADDR:MASTER_PORT, TORCHELASTIC_USE_AGENT_STORE),
  the job named after torchrun's run id and restart count; it lives as long as the agent that hosts
  it (node 0's, or the rendezvous endpoint's);
* otherwise rank 0's keeper starts a store daemon on MASTER_ADDR:MASTER_PORT that outlives the ranks
  (it ends with the launcher that started rank 0).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import time
from datetime import timedelta
from typing import NoReturn, Optional, Tuple

from megatron_mecefo.config import LaunchEnv
from megatron_mecefo.elastic.comm import nccl_env
from megatron_mecefo.elastic.comm import store as job_store
from megatron_mecefo.elastic.launch.store_daemon import spawn_store_daemon
from megatron_mecefo.elastic.launch.supervise import Rank, Supervisor
from megatron_mecefo.errors import USAGE_EXIT_CODE, JobConflict, exit_now

__all__ = ["keep", "keep_early", "job_store_for"]


def _logger(rank: int) -> logging.Logger:
    log = logging.getLogger(f"mecefo-keeper.{rank}")
    if not log.handlers:  # the host may have configured logging its own way: keep ours apart
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(f"[mecefo-keeper rank {rank}] %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    return log


def job_store_for(env: LaunchEnv, store: Optional[str], timeout: timedelta = timedelta(seconds=300)) -> Tuple:
    """(raw store client, host, port, job id) of the job this rank belongs to (see the module
    docstring for which store). Rank 0 of a job without an external store or an agent store starts
    the store daemon.

    Raises:
        JobConflict: the store at that address belongs to another job (or to no MeCeFO job).
    """
    if store is not None:
        host, _, port = store.rpartition(":")
        raw = job_store.client(host, int(port), timeout)
        return raw, host, int(port), job_store.read_job(raw, store)["id"]
    host, port = env.master_addr, env.master_port
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and "TORCHELASTIC_RUN_ID" in os.environ:
        job_id = f"torchrun-{os.environ['TORCHELASTIC_RUN_ID']}-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        raw = job_store.client(host, port, timeout)
        # every keeper of this round writes the same id (an earlier round's is replaced); the host is the agent
        raw.set(job_store.JOB_KEY, json.dumps({"id": job_id, "pid": os.getppid(), "host": socket.gethostname(),
                                                            "created": time.time()}))
        return raw, host, port, job_store.read_job(raw, f"{host}:{port}", job_id)["id"]
    if env.rank == 0:
        job_id = job_store.new_job_id()
        spawn_store_daemon(host, port, job_id, watch_pid=os.getppid())  # raises JobConflict on a taken port
        return job_store.client(host, port, timeout), host, port, job_id
    raw = job_store.client(host, port, timeout)
    return raw, host, port, job_store.read_job(raw, f"{host}:{port}")["id"]


def keep(env: LaunchEnv, *, restart_failed_after: Optional[float], max_restarts: int, store: Optional[str],
         give_up_grace: float = 300.0, term_grace: float = 10.0) -> NoReturn:
    """Become this rank's keeper: start the training again as a child process (this same command
    line, with MECEFO_LAUNCHER=1 so it takes the mecefo-launch path), supervise it, and end the
    process with the job's exit status. Never returns."""
    log = _logger(env.rank)
    try:
        raw, host, port, job_id = job_store_for(env, store)
    except JobConflict as e:
        exit_now(USAGE_EXIT_CODE, f"error: {e}")
    restarts = max_restarts if restart_failed_after is not None else 0
    log.info("job %s: store on %s:%d; training runs in a child process (restarts: %s)", job_id, host, port,
             f"after {restart_failed_after:g} s, at most {restarts}" if restart_failed_after is not None else "none")

    # before the training process's CUDA/NCCL start; under torchrun, its agent's default
    # TORCH_NCCL_ASYNC_ERROR_HANDLING=1 (a survivor torn down on a communicator error) is replaced
    nccl = nccl_env.for_children(log.warning)

    def env_for(r: Rank) -> dict:
        return dict(os.environ, MASTER_ADDR=host, MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="1",
                    MECEFO_INCARNATION=str(r.incarnation), MECEFO_LAUNCHER="1", MECEFO_KEEPER="1",
                    MECEFO_JOB_ID=job_id, MECEFO_MAX_RESTARTS=str(restarts), **nccl)

    command = [sys.executable, *sys.orig_argv[1:]]
    code = Supervisor([Rank(env.rank, env.local_rank, env.incarnation)], command, env_for,
                      job_store.job_store(raw, job_id), restart_failed_after=restart_failed_after,
                      max_restarts=max_restarts, give_up_grace=give_up_grace, term_grace=term_grace,
                      whole_job=False, await_job=True, logger=log).run()
    exit_now(code)  # nothing of the host's (atexit hooks, process groups) ran here to tear down



def keep_early(argv) -> None:
    """For a script's entry point, before its heavy imports: with `--mecefo` (flag or ds_config
    block, `--deepspeed_config`) under a launcher other than mecefo-launch, become the rank's keeper
    now (never returns), so the keeper process does not import DeepSpeed or Megatron for nothing.
    Otherwise, or when the flags do not parse, return: the script reports bad input itself."""
    import argparse

    from megatron_mecefo.config import MeCeFOConfig

    if os.environ.get("MECEFO_LAUNCHER") == "1" or "RANK" not in os.environ:
        return
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--deepspeed_config", "--deepspeed-config", default=None)
    MeCeFOConfig.add_cli_args(parser)
    try:
        args, _ = parser.parse_known_args(argv)
        block = None
        if args.deepspeed_config:
            with open(args.deepspeed_config) as f:
                block = json.load(f).get("mecefo")
        cfg = MeCeFOConfig.from_args(args, block)
        env = LaunchEnv.read()
    except (SystemExit, Exception):  # the script's own parsing says what is wrong
        return
    if cfg.enable:
        keep(env, restart_failed_after=cfg.restart_failed_after, max_restarts=cfg.max_restarts, store=cfg.store)
