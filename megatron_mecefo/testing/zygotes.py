"""Preloaded parents for a whole test session: `python -m megatron_mecefo.testing.zygotes SOCKET`
(tests/conftest.py starts one per xdist worker and names it in MECEFO_PRELOAD_SERVER).

`mecefo-launch --preload` starts one parent per launch that imports torch, DeepSpeed, Megatron and
the script's own imports (3-4 CPU-s here) and forks the ranks from it (elastic/launch/preload.py).
The suite launches about 150 jobs and so imports all that about 150 times. With MECEFO_PRELOAD_SERVER
set, a launcher asks this server for its parent instead. The server keeps one *zygote* per import
key, which imported the modules once, and forks each launch's parent from it; that parent is then
what the launcher's own would be: it says ready, forks and reports the ranks, and ends when its
launcher does (the channel closes). A launcher that finds no server starts its own parent.

Processes: the server (imports nothing heavy) -> a zygote per key (forked; imports) -> a parent per
launch, or a launcher (forked from its zygote) -> the ranks (forked from the parent, as without a server). Each
dies with the one above it (PR_SET_PDEATHSIG). The parent gets the launcher's stdin, stdout and
stderr (passed with the request, SCM_RIGHTS), its environment and working directory.

The key is what decides which files an import reads: the script's directory (first on sys.path),
the modules, and PYTHONPATH. Modules a zygote imported saw the environment of the launch that made
the zygote (as a launcher's own parent's modules see the launcher's, not a rank's).

Launchers too: a `mecefo-launch` process of the tests asks, at its start, for a launcher forked
from a zygote that imported the launcher's modules (torch for its store: 1.3 CPU-s a launch), and
stands in for it (testing/forked_launcher.py, MECEFO_LAUNCHER_SERVER). That zygote's key is
PYTHONPATH and where the launcher's package and torch are imported from.

Wire: the launcher connects and sends one JSON line {"argv", "modules", "env", "cwd"} with its fds
0, 1 and 2; from then on the connection speaks preload.py's protocol with the parent. A launcher's
request is {"kind": "launcher", "argv", "env", "cwd", "origins"}; the answer is {"pid"}, then
{"status"} when it ends. The server hands the connection, the request and the fds to the key's
zygote over a SOCK_SEQPACKET pair.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import select
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Dict, List, Optional, Tuple

from megatron_mecefo.elastic.launch import preload
from megatron_mecefo.elastic.launch.supervise import die_with_parent

__all__ = ["main", "key_of"]

LAUNCHER = "megatron_mecefo.elastic.launch.cli"
"""What a launcher's zygote imports (testing/forked_launcher.py asks for launchers)."""

MAX_REQUEST = 1 << 20
"""Bytes a request may take (its environment is most of it)."""


def key_of(request: dict) -> str:
    """The zygote a request is forked from (see the module docstring)."""
    if request.get("kind") == "launcher":
        return json.dumps(["launcher", request["env"].get("PYTHONPATH", ""), request["origins"]])
    script_dir = os.path.dirname(os.path.realpath(os.path.join(request["cwd"], request["argv"][0])))
    return json.dumps([script_dir, request["modules"], request["env"].get("PYTHONPATH", "")])


def _reap() -> List[int]:
    """The pids of the children that ended (reaped)."""
    ended = []
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return ended
        if pid == 0:
            return ended
        ended.append(pid)


def _read_request(conn: socket.socket, timeout: float = 30.0) -> Tuple[dict, List[int]]:
    """The launcher's request line and the fds that came with it."""
    conn.settimeout(timeout)
    buf, fds = b"", []
    while not buf.endswith(b"\n"):
        data, got, _, _ = socket.recv_fds(conn, 1 << 16, 3)
        fds += got
        if not data or len(buf) > MAX_REQUEST:
            raise OSError("the launcher closed the connection before its request ended")
        buf += data
    conn.settimeout(None)
    return json.loads(buf), fds


# -- a zygote ---------------------------------------------------------------------------------------

def _zygote(channel: socket.socket, request: dict, server: int) -> Tuple[socket.socket, List[int], dict, int]:
    """Import the request's modules once (a launcher's: its own), then fork a launch's parent (a
    launcher) for every connection the server hands over. Returns only in such a child: its
    connection, stdio fds, request and zygote."""
    die_with_parent(server)()
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    launcher = request.get("kind") == "launcher"
    # one OpenMP thread while importing torch (as Preloader.start): a launcher gets its own env back
    _start_as(dict(request["env"], OMP_NUM_THREADS="1") if launcher else request["env"])
    os.chdir(request["cwd"])  # a relative script path is the launcher's
    error: Optional[str] = None
    try:
        if launcher:
            importlib.import_module(LAUNCHER)
        else:
            preload._prepare(request["argv"], request["modules"])
        why = preload._refusal()
        if why is not None:
            error = f"the preloading process will not fork ranks: {why}"
    except preload.PreloadError as e:
        error = str(e)
    gc.freeze()  # as a parent does: the forks do not copy what the collector would walk
    me = os.getpid()
    while True:
        _reap()
        ready, _, _ = select.select([channel], [], [], 0.5)
        if not ready:
            continue
        data, fds, _, _ = socket.recv_fds(channel, MAX_REQUEST, 4)
        if not data:  # the server ended
            os._exit(0)
        conn, stdio = socket.socket(fileno=fds[0]), fds[1:]
        if error is None:
            sys.stdout.flush()
            sys.stderr.flush()
            if os.fork() == 0:
                channel.close()
                return conn, stdio, json.loads(data), me
        else:
            conn.sendall((json.dumps({"error": error}) + "\n").encode())
        conn.close()
        for fd in stdio:
            os.close(fd)


def _start_as(env: Dict[str, str]) -> None:
    """Be what `python` started with `env` would be before its imports: that environment
    (OMP_NUM_THREADS=1 among it: Preloader.start), sys.path from its PYTHONPATH instead of the
    server's, and its site hooks run (a launcher's own parent runs them at its start)."""
    old = os.environ.get("PYTHONPATH", "")
    os.environ.clear()
    os.environ.update(env)
    preload.use_pythonpath(old, env.get("PYTHONPATH", ""))
    for hook in ("sitecustomize", "usercustomize"):
        sys.modules.pop(hook, None)
        try:
            importlib.import_module(hook)
        except ImportError:
            pass
        except Exception as e:  # what `site` does with a failing hook: say so and go on
            print(f"Error in {hook}; {type(e).__name__}: {e}", file=sys.stderr, flush=True)


def _take_over(stdio: List[int], request: dict, zygote: int) -> None:
    """In a child of a zygote: die with it, and take the asking process's stdio, environment and
    directory."""
    die_with_parent(zygote)()
    for target, fd in enumerate(stdio):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])


def _become_parent(conn: socket.socket, stdio: List[int], request: dict, zygote: int) -> None:
    """In a child of the zygote: the launcher's stdio, environment and directory, then its parent
    (preload.serve_launcher), which returns only in a rank."""
    _take_over(stdio, request, zygote)
    preload.serve_launcher(conn, request["argv"], request["modules"], shared=True)


def _become_launcher(conn: socket.socket, stdio: List[int], request: dict, zygote: int) -> None:
    """In a child of a launcher's zygote: the process that asked (testing/forked_launcher.py) as a
    launcher. It runs `mecefo-launch` with that process's stdio, environment, directory and
    arguments, tells it its pid and then its exit status, and kills itself when that process dies
    (as a killed launcher's ranks die with it). Never returns."""
    _take_over(stdio, request, zygote)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    sys.argv = list(request["argv"])
    conn.sendall((json.dumps({"pid": os.getpid()}) + "\n").encode())
    threading.Thread(target=_die_with, args=(conn,), daemon=True).start()
    try:
        code = importlib.import_module(LAUNCHER).main(sys.argv[1:])
    except SystemExit as e:  # argparse's usage errors
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        conn.sendall((json.dumps({"status": code}) + "\n").encode())
    except OSError:
        pass
    os._exit(code)


def _die_with(conn: socket.socket) -> None:
    """A launcher's watch on the process it stands for: that one sends nothing, so the connection
    reads its end only when it died (a SIGKILL too)."""
    try:
        while conn.recv(1 << 10):
            pass
    except OSError:
        pass
    os.kill(os.getpid(), signal.SIGKILL)


# -- the server -------------------------------------------------------------------------------------

class _Server:
    def __init__(self, path: str) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path + ".new")
        self.listener.listen(64)
        os.rename(path + ".new", path)  # the path appears once a connection can be accepted
        self.zygotes: Dict[str, Tuple[int, socket.socket]] = {}  # key -> (pid, channel)
        self.pid = os.getpid()
        self.child: Optional[Tuple[socket.socket, dict, int]] = None
        """Set in a newly forked zygote: what `_zygote` starts from."""

    def run(self) -> Tuple[socket.socket, dict, int]:
        """Serve until SIGTERM; returns only in a newly forked zygote (its channel, first request, the
        server's pid)."""
        stopping = []
        signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
        while not stopping:
            ended = set(_reap())
            for key in [k for k, (pid, _) in self.zygotes.items() if pid in ended]:
                self.zygotes.pop(key)[1].close()
            ready, _, _ = select.select([self.listener], [], [], 0.5)
            if not ready:
                continue
            conn, _ = self.listener.accept()
            try:
                request, fds = _read_request(conn)
                self._hand_over(conn, request, fds)
            except (OSError, ValueError, KeyError) as e:
                print(f"[zygotes] a request failed: {e}", file=sys.stderr, flush=True)
            finally:
                conn.close()  # in a new zygote too: the connection reaches it over its channel
            if self.child is not None:
                return self.child
        # the zygotes end and are reaped here, so that their CPU counts in the server's parent
        for pid, channel in self.zygotes.values():
            channel.close()
            os.kill(pid, signal.SIGTERM)
        for pid, _ in self.zygotes.values():
            os.waitpid(pid, 0)
        sys.exit(0)

    def _hand_over(self, conn: socket.socket, request: dict, fds: List[int]) -> None:
        key = key_of(request)
        try:
            for _ in range(2):  # a zygote that died since the last request is made again, once
                if key not in self.zygotes:
                    self._start(key, request)
                    if self.child is not None:
                        return
                pid, channel = self.zygotes[key]
                try:
                    socket.send_fds(channel, [json.dumps(request).encode()], [conn.fileno(), *fds])
                    return
                except OSError:
                    self.zygotes.pop(key)[1].close()
            raise OSError("its zygote ended twice")
        finally:  # the zygote has its own copies now (in a new zygote: the server's copies, closed)
            for fd in fds:
                os.close(fd)

    def _start(self, key: str, request: dict) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            ours.close()
            self.listener.close()
            for _, channel in self.zygotes.values():
                channel.close()
            self.child = (theirs, request, self.pid)
            return
        theirs.close()
        self.zygotes[key] = (pid, ours)


def main() -> None:
    path = sys.argv[1]
    for stale in (path, path + ".new"):
        if os.path.exists(stale):
            os.unlink(stale)
    print(f"[zygotes] serving on {path} (pid {os.getpid()})", file=sys.stderr, flush=True)
    zygote = _Server(path).run()  # returns in a zygote
    child = _zygote(*zygote)  # returns in a launch's parent or a launcher
    if child[2].get("kind") == "launcher":
        _become_launcher(*child)  # never returns
    _become_parent(*child)  # returns in a rank
    preload._run_as_main(sys.argv[0])


if __name__ == "__main__":
    main()
