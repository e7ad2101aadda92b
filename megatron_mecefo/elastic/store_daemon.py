"""A store that outlives every training rank, for launchers that do not host one.

`mecefo-launch` hosts the job's TCPStore itself. Under another launcher (the `deepspeed` launcher,
torchrun, Slurm) the first rank starts this daemon in its own session, so the store survives that
rank's death:

    python -m megatron_mecefo.elastic.store_daemon --host 0.0.0.0 --port 29500

It exits once the job has set `job/finished` (after a grace period for late readers), or when no
rank's heartbeat has moved for --idle-timeout seconds.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from datetime import timedelta

import torch.distributed as dist

__all__ = ["spawn_store_daemon", "main"]


def spawn_store_daemon(host: str, port: int) -> subprocess.Popen:
    """Start the daemon detached (own session); returns at once. Ranks then connect as clients."""
    return subprocess.Popen(
        [sys.executable, "-m", "megatron_mecefo.elastic.store_daemon", "--host", host, "--port", str(port)],
        start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--grace", type=float, default=10.0, help="seconds to stay after job/finished")
    p.add_argument("--idle-timeout", type=float, default=900.0)
    args = p.parse_args(argv)
    try:
        store = dist.TCPStore(args.host, args.port, is_master=True, timeout=timedelta(seconds=60), wait_for_workers=False)
    except Exception as e:  # another rank's daemon already serves this port
        print(f"store daemon: not started ({e})", file=sys.stderr)
        return 0
    last_beats, last_change = None, time.monotonic()
    while True:
        time.sleep(1.0)
        if store.check(["job/finished"]):
            time.sleep(args.grace)
            return 0
        hb = tuple(store.add(f"hb/{r}", 0) for r in range(store.add("mecefo/world", 0)))
        if hb != last_beats:
            last_beats, last_change = hb, time.monotonic()
        elif time.monotonic() - last_change > args.idle_timeout:
            return 0


if __name__ == "__main__":
    sys.exit(main())
