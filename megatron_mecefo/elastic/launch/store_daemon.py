"""A store that outlives every training rank: `mecefo-store`, and the daemon of other launchers.

Two uses:
* a head-node store for multi-node jobs (`mecefo-store`, then `mecefo-launch --external-store` on
  every node): no training node hosts it, so losing any node, node 0 included, is survived:

      mecefo-store --host HEAD_ADDR --port 29500        # prints the job id; ends with the job

* under another launcher (the `deepspeed` launcher, torchrun, Slurm) rank 0 starts it in its own
  session, so the store survives that rank's death (`spawn_store_daemon`; it reports whether it
  could take the port before rank 0 goes on).

It ends with its job: once `job/finished` or `job/failed` is set (after a grace period for late
readers), when the launcher process it watches is gone, when no rank's heartbeat has moved for
--idle-timeout seconds (every rank killed; 0: never), or when asked to (`--stop`, e.g. to free the
port of a job whose ranks were killed).
"""

from __future__ import annotations

import argparse
import os
import select
import subprocess
import sys
import time

from megatron_mecefo.elastic.comm.store import STOP_KEY, describe_busy_port, host_store, job_store, new_job_id, request_stop
from megatron_mecefo.errors import JobConflict
from megatron_mecefo.version import __version__

__all__ = ["spawn_store_daemon", "main"]


def spawn_store_daemon(host: str, port: int, job_id: str, watch_pid: int, wait_s: float = 60.0) -> subprocess.Popen:
    """Start the daemon detached (own session) and wait until it holds the port.

    Raises:
        JobConflict: the port is taken (by a lingering store of an earlier job: the message says
            which and how to stop it).
    """
    proc = subprocess.Popen(
        [sys.executable, "-m", "megatron_mecefo.elastic.launch.store_daemon", "--host", host, "--port", str(port),
         "--job-id", job_id, "--watch-pid", str(watch_pid)],
        start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
    )
    ready, _, _ = select.select([proc.stdout], [], [], wait_s)
    line = proc.stdout.readline().decode().strip() if ready else ""
    proc.stdout.close()
    if line.startswith("ready"):
        return proc
    if line.startswith("busy"):
        raise JobConflict(describe_busy_port(host, port))
    proc.kill()
    raise RuntimeError(f"the store daemon for port {port} did not start: {line or 'no answer within %.0f s' % wait_s}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="mecefo-store", description=__doc__.split("\n\n")[0])
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (the job's MASTER_ADDR)")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--job-id", default=None, help="the job's id (default: a new one, printed)")
    p.add_argument("--watch-pid", type=int, default=None, help="exit when this process (the launcher) is gone")
    p.add_argument("--grace", type=float, default=10.0, help="seconds to stay after the job ended")
    p.add_argument("--idle-timeout", type=float, default=60.0,
                   help="exit when no rank's heartbeat has moved for this long, once one has beaten (0: never)")
    p.add_argument("--start-timeout", type=float, default=900.0,
                   help="exit when no rank has beaten for this long after the start (0: never)")
    p.add_argument("--stop", action="store_true", help="ask the daemon on --host:--port to exit, then return")
    args = p.parse_args(argv)
    if args.stop:
        try:
            info = request_stop(args.host, args.port)
        except Exception as e:
            print(f"no MeCeFO store daemon answers on {args.host}:{args.port}: {e}", file=sys.stderr)
            return 1
        print(f"asked the store of job {info['id']} (pid {info['pid']}) on {args.host}:{args.port} to exit")
        return 0
    job_id = args.job_id or new_job_id()
    try:
        raw = host_store(args.host, args.port, job_id)
    except OSError as e:
        print(f"busy {e}", flush=True)
        if e.errno == 98:  # EADDRINUSE
            print(describe_busy_port(args.host, args.port), file=sys.stderr)
        return 1
    print(f"ready: the store of job {job_id} listens on {args.host}:{raw.port}", flush=True)
    if args.watch_pid is not None:  # spawned by rank 0, which stopped reading
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
    store = job_store(raw, job_id)
    last_beats, last_change, started = None, time.monotonic(), time.monotonic()
    while True:
        time.sleep(1.0)
        if raw.check([STOP_KEY]):
            return 0
        if store.check(["job/finished"]) or store.check(["job/failed"]):
            time.sleep(args.grace)
            return 0
        if args.watch_pid is not None and not _alive(args.watch_pid):
            time.sleep(args.grace)
            return 0
        hb = tuple(store.add(f"hb/{r}", 0) for r in range(store.add("mecefo/world", 0)))
        now = time.monotonic()
        if hb != last_beats:
            last_beats, last_change = hb, now
        beaten = any(hb)
        if (beaten and args.idle_timeout and now - last_change > args.idle_timeout) or \
                (not beaten and args.start_timeout and now - started > args.start_timeout):
            return 0


if __name__ == "__main__":
    sys.exit(main())
