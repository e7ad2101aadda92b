"""Tests only: a `mecefo-launch` process that runs as a launcher forked from the session's zygote
server (megatron_mecefo/testing/zygotes.py), instead of importing torch for its store again.

Every launch of the suite starts a launcher, and most of a launcher's 1.3 CPU-seconds is `import
torch` (its store is a TCPStore). With MECEFO_LAUNCHER_SERVER naming the server's socket, the
tests' site hook (testing/sitehooks/sitecustomize.py) calls `run` at the start of a `mecefo-launch`
process (`python -m megatron_mecefo.elastic.launch` or the console script): this process, which
imports nothing but the standard library, asks the server for a launcher forked from a zygote that
imported the launcher's modules once, and stands in for it:
* the launcher gets this process's stdin, stdout and stderr, its environment, directory and
  arguments, and runs `cli.main` as this process would have;
* SIGTERM, SIGINT and SIGHUP sent here are passed on to it (a test cancelling the job);
* a SIGKILL here (a test killing the launcher, or a timeout killing its session) ends it with
  SIGKILL too: it watches the connection and kills itself when this end closes, so its ranks die
  with it as with a killed launcher of their own;
* this process exits with the launcher's exit status.
Where no server answers, `run` returns and the launcher runs here as usual. The process a test
SIGSTOPs is then not the launcher: the tests that stop or kill the launcher itself to check what it
does (tests/elastic/test_launch.py) leave MECEFO_LAUNCHER_SERVER out of its environment.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
from typing import List, Optional, Tuple

__all__ = ["launcher_args", "run", "origins"]

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def launcher_args(argv: List[str]) -> Optional[Tuple[str, List[str]]]:
    """For `argv` (sys.orig_argv) that starts `mecefo-launch`: what Python puts first on sys.path (the
    directory for -m, the console script's own) and the launcher's arguments; else None."""
    args = argv[1:]
    while args and args[0].startswith("-") and args[0] != "-m":
        if args[0] == "-c":
            return None
        args = args[2:] if args[0] in ("-W", "-X") else args[1:]  # an option with a value: skip it too
    if len(args) >= 2 and args[0] == "-m" and args[1] == "megatron_mecefo.elastic.launch":
        return os.getcwd(), args[2:]
    if args and os.path.basename(args[0]) == "mecefo-launch":
        return os.path.dirname(os.path.abspath(args[0])), args[1:]
    return None


def origins(first: str) -> List[Optional[str]]:
    """Where this process would import the launcher's package and torch from (`first` is what Python
    puts first on sys.path: the directory for -m, the script's for a console script): a zygote is
    shared only by launchers that would import the same files."""
    import importlib.util

    sys.path.insert(0, first)
    try:
        return [getattr(importlib.util.find_spec(m), "origin", None) for m in ("megatron_mecefo", "torch")]
    except (ImportError, ValueError):
        return [None, None]
    finally:
        sys.path.pop(0)


def run(path: str, argv: List[str]) -> None:
    """Run this launch as a launcher forked by the zygote server at `path` and exit with its status;
    returns (having done nothing) where the server does not answer."""
    found = launcher_args(argv)
    if found is None:
        return
    first, args = found
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
        request = {"kind": "launcher", "argv": ["mecefo-launch", *args], "env": dict(os.environ), "cwd": os.getcwd(),
                   "origins": origins(first)}
        data = (json.dumps(request) + "\n").encode()
        sent = socket.send_fds(conn, [data], [0, 1, 2])
        conn.sendall(data[sent:])
        reply = _line(conn)
    except OSError:
        reply = None
    if reply is None or "pid" not in reply:
        if reply is not None:
            print(f"[forked-launcher] the zygote server did not fork a launcher: {reply.get('error')}", file=sys.stderr)
        conn.close()
        return
    pid = reply["pid"]
    for sig in FORWARDED:
        signal.signal(sig, lambda signum, _frame: _forward(pid, signum))
    status = _line(conn)
    if status is None or "status" not in status:  # it died without a word: as a killed launcher would
        os.kill(os.getpid(), signal.SIGKILL)
    sys.stdout.flush()
    os._exit(status["status"])


def _forward(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


_buf = b""


def _line(conn: socket.socket) -> Optional[dict]:
    """The next JSON line from the server's side, or None where the connection closed."""
    global _buf
    while b"\n" not in _buf:
        data = conn.recv(1 << 16)  # a forwarded signal's handler runs, then recv goes on (PEP 475)
        if not data:
            return None
        _buf += data
    line, _buf = _buf.split(b"\n", 1)
    return json.loads(line)
