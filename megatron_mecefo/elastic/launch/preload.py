"""Ranks forked from a preloaded parent (`mecefo-launch --preload`, or MECEFO_PRELOAD).

Most of a training process's start is importing torch, DeepSpeed and Megatron (5-10 s of CPU on a
2-core machine); a restarted rank pays it again before it can rejoin. With preload the launcher
starts one parent per node that imports those modules once and then forks a child for every rank
start, restarts included: the child skips the imports and runs the script.

The parent, before it forks anything:
* imports the modules asked for: by default torch, deepspeed and megatron.core (those installed)
  and every module the script imports at its top level, with the script's directory first on
  sys.path as `python script.py` would have it (so a Megatron checkout's own `megatron` is the one
  imported); or exactly the comma-separated modules named (`--preload-modules torch,megatron.core`;
  `script` in the list stands for the script's top-level imports: `--preload-modules script` for a
  Megatron-LM checkout, whose script imports everything it needs at its top);
* refuses to serve when it holds a thread besides its own or CUDA is initialised (a fork would copy
  a lock held by a thread that does not exist in the child, or a CUDA context that cannot work
  there): the launcher exits 2 and says why, as it does when a module fails to import.

A forked rank is a process of its own, as a spawned one is: a SIGKILL or SIGSTOP sent to its pid
hits it alone; it dies with the parent, which dies with the launcher (PR_SET_PDEATHSIG); it writes to
the launcher's stdout and stderr; its exit status (or the signal that ended it) reaches the launcher
through the parent. It gets its own environment, working directory and argv; the site hooks
(`sitecustomize`, `usercustomize`) run again in it, as at a fresh start; then the script runs as
`__main__`. What it shares with the parent is what was imported: modules that read the environment
at import (RANK, LOCAL_RANK) saw the launcher's. The parent imports with OMP_NUM_THREADS=1 (more
would start OpenMP's thread pool during `import torch`); a rank sets its own count after the fork
(torch.set_num_threads: its OMP_NUM_THREADS, else the CPUs it may use, as a fresh process would).

With MECEFO_PRELOAD_SERVER naming a zygote server's socket (megatron_mecefo/testing/zygotes.py,
what the test suite runs) the parent is forked from a process that imported the modules already,
gets the launcher's stdin, stdout, stderr, environment and directory, and from then on speaks the
same protocol; it ends when its channel closes (the launcher is gone). Without an answer from the
server the launcher starts its own parent.

Wire protocol (JSON lines over a socketpair the launcher made): the parent says
`{"ready": [modules], "import_s": t, "pid": p, "shared": b}` or `{"error": why}`; the launcher asks `{"start": id, "argv":
[...], "env": {...}, "cwd": dir}`; the parent answers `{"started": id, "pid": p}` and, when the
child ends, `{"exited": id, "code": c}` (negative: killed by that signal, as Popen's returncode).
"""

from __future__ import annotations

import ast
import gc
import importlib
import importlib.util
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from typing import Dict, List, Optional

from megatron_mecefo.elastic.launch.supervise import describe, die_with_parent

__all__ = ["Preloader", "ForkedProcess", "PreloadError", "modules_for", "DEFAULT_MODULES"]

DEFAULT_MODULES = ("torch", "deepspeed", "megatron.core")
"""What `--preload` without a list imports (those installed), besides the script's own imports."""


class PreloadError(RuntimeError):
    """The preloaded parent could not be made ready (an import failed, a thread or CUDA in it)."""


def script_imports(script: str) -> List[str]:
    """The absolute modules `script` imports at its top level (not inside functions, `if` or `try`)."""
    with open(script, "rb") as f:
        tree = ast.parse(f.read(), script)
    found: List[str] = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append(node.module)
    return list(dict.fromkeys(found))


def modules_for(spec: str, script: str) -> List[str]:
    """The modules to preload for `spec`: a comma-separated list in which `script` stands for the
    script's top-level imports; "auto" is DEFAULT_MODULES (those installed) and `script`."""
    if spec == "auto":
        return list(dict.fromkeys([m for m in DEFAULT_MODULES if _installed(m)] + script_imports(script)))
    found: List[str] = []
    for m in (m.strip() for m in spec.split(",")):
        found += script_imports(script) if m == "script" else [m] if m else []
    return list(dict.fromkeys(found))


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module.split(".")[0]) is not None
    except (ImportError, ValueError):
        return False


# -- the launcher's side ------------------------------------------------------------------------------

class ForkedProcess:
    """A rank forked by the preloaded parent, with the part of `subprocess.Popen`'s interface the
    supervisor uses (pid, returncode, poll, wait, send_signal, kill)."""

    def __init__(self, owner: "Preloader", pid: int):
        self.owner, self.pid = owner, pid
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            self.owner.pump(0.0)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            self.owner.pump(0.1 if left is None else min(0.1, left))
        return self.returncode

    def send_signal(self, sig: int) -> None:
        # the parent reaps the child before it reports the exit: a report not yet read leaves a
        # window of milliseconds in which the pid could be reused, as far as Linux reuses pids
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class Preloader:
    """The launcher's handle on its preloaded parent. Build it with `Preloader.start(...)` before the
    ranks start; `fork(env)` starts one rank of the script; `close()` ends the parent.

    Raises:
        PreloadError: from `start`, when the parent cannot serve (the message says why).
    """

    def __init__(self, proc: Optional[subprocess.Popen], channel: socket.socket, argv: List[str], modules: List[str],
                 import_s: float):
        self.proc, self.channel, self.argv = proc, channel, argv
        self.modules, self.import_s = modules, import_s
        self.shared = False
        """The parent was forked from a zygote server's zygote (not started for this launch)."""
        self._buf = b""
        self._next = 0
        self._started: Dict[int, int] = {}  # request id -> pid
        self._live: Dict[int, ForkedProcess] = {}  # request id -> process
        self.lost = False

    @classmethod
    def start(cls, script: str, script_args: List[str], modules: List[str], env: Dict[str, str],
              timeout: float = 900.0, server: Optional[str] = None) -> "Preloader":
        """Start the parent and wait until it is ready. `server`: the socket of a zygote server
        (megatron_mecefo/testing/zygotes.py, MECEFO_PRELOAD_SERVER) to fork the parent from, where
        one answers; otherwise the parent is a process of its own."""
        argv = [script, *script_args]
        # one OpenMP thread while importing: with more, importing torch starts OpenMP's pool (a thread
        # a fork would not copy); each rank sets its own count after the fork (_become). An import
        # that asks torch.cuda.is_available() asks NVML, which leaves CUDA usable in a forked child
        # (torch's documented way; on a GPU machine, untested here)
        env = dict(env, OMP_NUM_THREADS="1", PYTORCH_NVML_BASED_CUDA_CHECK="1")
        proc, channel = None, _ask_server(server, argv, modules, env) if server else None
        if channel is None:
            channel, child_end = socket.socketpair()
            proc = subprocess.Popen(
                [sys.executable, "-u", "-m", "megatron_mecefo.elastic.launch.preload", str(child_end.fileno()),
                 json.dumps(argv), ",".join(modules)],
                env=env, pass_fds=(child_end.fileno(),), preexec_fn=die_with_parent(os.getpid()))
            child_end.close()
        self = cls(proc, channel, argv, modules, 0.0)
        deadline = time.monotonic() + timeout
        while True:
            for msg in self._read(min(1.0, max(0.0, deadline - time.monotonic()))):
                if "error" in msg:
                    self.close()
                    raise PreloadError(msg["error"])
                if "ready" in msg:
                    self.import_s, self.shared = msg["import_s"], bool(msg.get("shared"))
                    return self
            code = proc.poll() if proc is not None else None
            if self.lost or code is not None:
                self.close()
                raise PreloadError(f"the preloading process ended before it was ready "
                                   f"({'its channel closed' if code is None else describe(code)})")
            if time.monotonic() > deadline:
                self.close()
                raise PreloadError(f"the preloading process was not ready after {timeout:.0f} s (importing {modules})")

    def fork(self, env: Dict[str, str], cwd: Optional[str] = None) -> ForkedProcess:
        """Start one rank of the script with environment `env`; returns once it runs.

        Raises:
            PreloadError: the parent is gone (the caller may spawn instead).
        """
        if self.lost:
            raise PreloadError("the preloading process is gone")
        rid, self._next = self._next, self._next + 1
        self._send({"start": rid, "argv": self.argv, "env": dict(env), "cwd": cwd or os.getcwd()})
        deadline = time.monotonic() + 60.0
        while rid not in self._started:
            if self.lost or time.monotonic() > deadline:
                self.lost = True
                raise PreloadError("the preloading process did not start the rank")
            self.pump(0.5)
        proc = self._live[rid] = ForkedProcess(self, self._started.pop(rid))
        return proc

    def pump(self, timeout: float) -> None:
        """Read what the parent said (waiting up to `timeout` s for the first message)."""
        for msg in self._read(timeout):
            if "started" in msg:
                self._started[msg["started"]] = msg["pid"]
            elif "exited" in msg and msg["exited"] in self._live:
                self._live.pop(msg["exited"]).returncode = msg["code"]
        if self.lost:  # the parent died: its children died with it (PR_SET_PDEATHSIG)
            for proc in self._live.values():
                proc.returncode = -signal.SIGKILL
            self._live.clear()

    def close(self) -> None:
        """End the parent (its remaining children die with it): a parent from a zygote server ends
        when its channel closes."""
        try:
            self.channel.close()
        except OSError:
            pass
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def _send(self, msg: dict) -> None:
        try:
            self.channel.sendall((json.dumps(msg) + "\n").encode())
        except OSError:
            self.lost = True

    def _read(self, timeout: float) -> List[dict]:
        if self.lost:
            return []
        try:
            ready, _, _ = select.select([self.channel], [], [], timeout)
            while ready:
                data = self.channel.recv(1 << 16)
                if not data:
                    self.lost = True
                    break
                self._buf += data
                ready, _, _ = select.select([self.channel], [], [], 0)
        except OSError:
            self.lost = True
        *lines, self._buf = self._buf.split(b"\n")
        return [json.loads(line) for line in lines if line]


def _ask_server(path: str, argv: List[str], modules: List[str], env: Dict[str, str]) -> Optional[socket.socket]:
    """A channel to a parent forked for this launch by the zygote server at `path`, or None where
    none answers. The parent gets this process's stdin, stdout and stderr, as a spawned one would."""
    channel = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        channel.connect(path)
        request = {"argv": argv, "modules": modules, "env": env, "cwd": os.getcwd()}
        sys.stdout.flush()
        sys.stderr.flush()
        data = (json.dumps(request) + "\n").encode()
        sent = socket.send_fds(channel, [data], [0, 1, 2])
        channel.sendall(data[sent:])
    except OSError:
        channel.close()
        return None
    return channel


# -- the parent's side --------------------------------------------------------------------------------

def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:  # not Linux: Python's own count
        import threading

        return threading.active_count()


def _refusal() -> Optional[str]:
    """Why this process must not fork ranks, or None."""
    if _threads() > 1:
        import threading

        names = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
        return (f"it runs {_threads() - 1} thread(s) besides its own after the imports "
                f"({', '.join(names) or 'native threads'}); a forked rank would inherit their locks but not them")
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA was initialised during the imports; a forked rank cannot use the parent's CUDA context"
    if torch is not None and _poisons_fork(torch):
        return ("CUDA's driver was initialised during the imports (torch.cuda.is_available() or device_count() "
                "without NVML); a forked rank could not use CUDA")
    return None


def _poisons_fork(torch) -> bool:
    """Whether a child forked now would be in torch's "bad fork" (the CUDA driver initialised in the
    parent: CUDA raises in the child). Asked of a probe child, where torch records it."""
    in_bad_fork = getattr(torch.cuda, "_is_in_bad_fork", None)
    if in_bad_fork is None:
        return False
    pid = os.fork()
    if pid == 0:
        os._exit(1 if in_bad_fork() else 0)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 1


def _prepare(argv: List[str], modules: List[str]) -> None:
    """Be the script's process before its imports: argv, sys.path[0], then the imports."""
    script = argv[0]
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.realpath(script))
    for module in modules:
        try:
            importlib.import_module(module)
        except BaseException as e:  # noqa: BLE001  (SystemExit from a module is a failure too)
            raise PreloadError(f"importing {module!r} failed: {type(e).__name__}: {e}") from e


def _serve(channel: socket.socket) -> Optional[dict]:
    """Fork a child per request and report its start and exit. Returns the request in a child
    (which then becomes the rank); returns None in the parent once the launcher is gone."""
    children: Dict[int, int] = {}  # pid -> request id
    buf = b""

    def send(msg: dict) -> None:
        channel.sendall((json.dumps(msg) + "\n").encode())

    while True:
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            rid = children.pop(pid, None)
            if rid is not None:
                send({"exited": rid, "code": os.waitstatus_to_exitcode(status)})
        ready, _, _ = select.select([channel], [], [], 0.05)
        if not ready:
            continue
        data = channel.recv(1 << 16)
        if not data:  # the launcher ended: so do we (the children die with us)
            return None
        buf += data
        *lines, buf = buf.split(b"\n")
        for line in lines:
            if not line:
                continue
            msg = json.loads(line)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                return msg
            children[pid] = msg["start"]
            send({"started": msg["start"], "pid": pid})


def _omp_threads(environ) -> int:
    """The intra-op threads a fresh process would start with: OMP_NUM_THREADS, else the CPUs it may use."""
    try:
        return max(1, int(environ.get("OMP_NUM_THREADS", "").split(",")[0]))
    except ValueError:
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def use_pythonpath(old: str, new: str) -> None:
    """sys.path as a process started with PYTHONPATH `new` has it, in one started with `old`: the
    entries of `old` leave, those of `new` follow sys.path[0] (the script's directory)."""
    ours = [os.path.abspath(p) for p in old.split(os.pathsep) if p]
    theirs = [os.path.abspath(p) for p in new.split(os.pathsep) if p]
    rest = [p for p in sys.path[1:] if os.path.abspath(p) not in ours + theirs]
    sys.path[:] = sys.path[:1] + theirs + rest


def _become(msg: dict, parent: int) -> None:
    """In the forked child: take the rank's environment, directory, argv and site hooks."""
    # the dispositions a fresh interpreter starts with: SIGPIPE stays ignored (Python's own start-up
    # ignores it, so a write to a dead peer's socket raises instead of killing the rank)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    die_with_parent(parent)()
    old_path = os.environ.get("PYTHONPATH", "")
    os.environ.clear()
    os.environ.update(msg["env"])  # putenv too: gloo, NCCL and OpenMP read the C environment
    os.chdir(msg["cwd"])
    use_pythonpath(old_path, os.environ.get("PYTHONPATH", ""))
    if "torch" in sys.modules:  # the parent ran single-threaded (main()); the rank gets its own threads
        sys.modules["torch"].set_num_threads(_omp_threads(os.environ))
    sys.argv = list(msg["argv"])
    sys.orig_argv = [sys.executable, "-u", *sys.argv]  # what a spawned rank's command line would be
    process = sys.modules.get("multiprocessing.process")
    if process is not None:  # the directory a fresh process starts in: multiprocessing's spawn finds
        process.ORIGINAL_DIR = os.path.abspath(os.getcwd())  # a relative __main__ from it
    sys.path[0] = os.path.dirname(os.path.realpath(sys.argv[0]))
    for stream in (sys.stdout, sys.stderr):  # flushed at every line, as with `python -u`
        try:
            stream.reconfigure(line_buffering=True)
        except (AttributeError, ValueError):
            pass
    for hook in ("sitecustomize", "usercustomize"):  # per-process start-up hooks run again, as at a fresh start
        if hook in sys.modules:
            importlib.reload(sys.modules[hook])


def _run_as_main(script: str) -> None:
    """Run `script` as `python script.py` does: in a fresh `__main__` module."""
    import builtins
    import types
    from importlib.machinery import SourceFileLoader

    main = types.ModuleType("__main__")
    script = os.path.abspath(script)  # as `python script.py` sets __main__.__file__ (Python >= 3.9)
    main.__dict__.update(__file__=script, __builtins__=builtins, __spec__=None, __cached__=None,
                         __loader__=SourceFileLoader("__main__", script))
    sys.modules["__main__"] = main
    with open(script, "rb") as f:
        code = compile(f.read(), script, "exec")
    try:
        exec(code, main.__dict__)
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as e:  # noqa: BLE001  the traceback `python script.py` prints: the script's frames
        tb = e.__traceback__.tb_next
        sys.excepthook(type(e), e.with_traceback(tb), tb)
        sys.exit(1)


def serve_launcher(channel: socket.socket, argv: List[str], modules: List[str], *, shared: bool = False) -> None:
    """Be a launcher's preloaded parent: import `modules` (those not imported yet), refuse or say
    ready, fork the ranks it asks for; returns only in a rank, once it is the script's process
    (then run `_run_as_main`), and exits once the launcher is gone. `shared`: this process was forked
    from a zygote that imported the modules (megatron_mecefo/testing/zygotes.py), not started for the launch."""
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))  # close(): nothing of ours to tear down
    t0 = time.perf_counter()
    try:
        if os.environ.get("OMP_NUM_THREADS") != "1":  # else importing torch starts OpenMP's pool, one thread
            raise PreloadError("the preloading process must start with OMP_NUM_THREADS=1 (Preloader.start sets it)")
        _prepare(argv, modules)
        why = _refusal()
        if why is not None:
            raise PreloadError(f"the preloading process will not fork ranks: {why}")
    except PreloadError as e:
        channel.sendall((json.dumps({"error": str(e)}) + "\n").encode())
        sys.exit(2)
    channel.sendall((json.dumps({"ready": modules, "import_s": round(time.perf_counter() - t0, 3), "pid": os.getpid(),
                                 "shared": shared}) + "\n").encode())
    # what the children inherit stays out of the collector's reach: their first collections would
    # otherwise walk, and so copy page by page, every object imported here (measured: a third of a
    # forked rank's CPU and two thirds of its page faults)
    gc.freeze()
    msg = _serve(channel)
    if msg is None:
        sys.exit(0)
    channel.close()
    _become(msg, os.getppid())


def main() -> None:
    fd, argv, modules = int(sys.argv[1]), json.loads(sys.argv[2]), [m for m in sys.argv[3].split(",") if m]
    serve_launcher(socket.socket(fileno=fd), argv, modules)
    _run_as_main(sys.argv[0])


if __name__ == "__main__":
    main()
