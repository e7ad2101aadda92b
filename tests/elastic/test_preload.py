"""mecefo-launch --preload: ranks forked from a parent that imported the heavy modules once are real
processes of their own (signals, exit codes, output, restarts), run their site hooks again, and a
parent that cannot fork safely stops the launch before any rank starts."""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from megatron_mecefo.elastic.launch import cli, preload

ROOT = Path(__file__).resolve().parents[2]

SIGNALS = "{s.name: str(signal.getsignal(s)) for s in (signal.SIGPIPE, signal.SIGINT, signal.SIGTERM, signal.SIGCHLD)}"

RANK_SCRIPT = f"""
import json, multiprocessing.process, os, signal, sys, time
out = os.environ["OUT"]
rank, inc = int(os.environ["RANK"]), int(os.environ["MECEFO_INCARNATION"])
with open(f"/proc/{{os.getppid()}}/stat") as f:
    grandparent = int(f.read().rsplit(")", 1)[1].split()[1])
info = dict(rank=rank, inc=inc, pid=os.getpid(), ppid=os.getppid(), grandparent=grandparent, preloaded="torch" in sys.modules,
            main=__name__, argv=sys.argv[1:], cwd=os.getcwd(), path0=sys.path[0], signals={SIGNALS},
            file=__file__, mp_dir=multiprocessing.process.ORIGINAL_DIR)
with open(os.path.join(out, f"rank{{rank}}.jsonl"), "a") as f:
    f.write(json.dumps(info) + "\\n")
print(f"hello from rank {{rank}} incarnation {{inc}}")
while not os.path.exists(os.path.join(out, "stop")):
    time.sleep(0.05)
if rank == 2:
    raise RuntimeError("rank 2 fails on purpose")
"""


def _env(mode, **extra):
    """The tests' environment with the parent forked from the session's zygote server ("zygote") or
    started by the launcher ("own", and the launcher a process of its own too)."""
    env = dict(os.environ, **extra)
    if mode == "own":
        env["MECEFO_PRELOAD_SERVER"] = env["MECEFO_LAUNCHER_SERVER"] = "0"
    else:
        assert env.get("MECEFO_PRELOAD_SERVER", "0") != "0", "tests/conftest.py starts a zygote server"
    return env


def _launch(tmp_path, *launcher_args, nproc=3, env=None, script_dir=None):
    script = (script_dir or tmp_path) / "rank.py"
    script.write_text(RANK_SCRIPT)
    # the script named relative to the launcher's directory, as the checkouts' tests name pretrain_gpt.py
    cmd = [sys.executable, "-m", "megatron_mecefo.elastic.launch", "--nproc-per-node", str(nproc), "--master-port",
           "0", *launcher_args, os.path.relpath(script, tmp_path), "an", "argument"]
    env = dict(env or os.environ, OUT=str(tmp_path))
    return subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _records(tmp_path, rank):
    path = tmp_path / f"rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _wait(what, predicate, proc, timeout=120):
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None or time.monotonic() > deadline:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            raise AssertionError(f"{what}: launcher {proc.returncode}\n{out[-3000:]}\n{err[-3000:]}")
        time.sleep(0.05)


def _state(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


@pytest.mark.dist
@pytest.mark.fault
@pytest.mark.parametrize("mode", ["own", "zygote"])
def test_a_forked_rank_is_a_process_of_its_own(tmp_path, mode):
    proc = _launch(tmp_path, "--preload-modules", "torch", "--restart-failed-after", "0.2", env=_env(mode))
    try:
        _wait("three ranks started", lambda: all(_records(tmp_path, r) for r in range(3)), proc)
        first = {r: _records(tmp_path, r)[0] for r in range(3)}
        parents = {i["ppid"] for i in first.values()}
        assert len(parents) == 1 and proc.pid not in parents, first  # one preloaded parent, not the launcher
        # the signal dispositions of a fresh interpreter (SIGPIPE ignored: a write to a dead peer's
        # socket raises; a forked rank that took the default died of SIGPIPE when its peer died)
        # (as the launcher's child: the launcher handles SIGINT, so a spawned rank starts with the
        # default even where the test runs with SIGINT ignored, as a background job of a script does)
        fresh = json.loads(subprocess.run([sys.executable, "-c", f"import json, signal; print(json.dumps({SIGNALS}))"],
                                          capture_output=True, text=True, check=True,
                                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)).stdout)
        assert fresh["SIGPIPE"] == str(signal.SIG_IGN), fresh
        for r, info in first.items():
            assert info["signals"] == fresh, (info["signals"], fresh)
            assert info["preloaded"] and info["main"] == "__main__" and info["argv"] == ["an", "argument"], info
            assert info["cwd"] == str(tmp_path) and info["path0"] == str(tmp_path) and info["inc"] == 0, info
            # what multiprocessing's spawn (a checkpoint writer's) reruns `__main__` from: the script's
            # absolute path, and the directory the rank started in
            assert info["file"] == str(tmp_path / "rank.py") and info["mp_dir"] == str(tmp_path), info

        os.kill(first[0]["pid"], signal.SIGSTOP)  # a hang stops that rank alone
        time.sleep(0.3)
        assert _state(first[0]["pid"]) == "T" and {_state(first[r]["pid"]) for r in (1, 2)} <= {"S", "R"}
        os.kill(first[0]["pid"], signal.SIGCONT)

        os.kill(first[1]["pid"], signal.SIGKILL)  # a kill too; the launcher restarts it, forked again
        _wait("rank 1 restarted", lambda: len(_records(tmp_path, 1)) == 2, proc)
        again = _records(tmp_path, 1)[1]
        assert again["inc"] == 1 and again["preloaded"] and again["ppid"] in parents and again["pid"] != first[1]["pid"]
        assert {_state(first[r]["pid"]) for r in (0, 2)} <= {"S", "R"}

        (tmp_path / "stop").touch()
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1, err  # rank 2's exception: exit status 1, as a spawned rank's
    assert f"rank 1 (pid {first[1]['pid']}) ended: killed by SIGKILL" in err
    assert f"rank 2 (pid {first[2]['pid']}) ended: exit code 1" in err
    assert re.search(r"rank 0 \(pid \d+\) ended: exit code 0", err) and err.count("forked from the preloaded parent") >= 4
    assert ("forked from a zygote of MECEFO_PRELOAD_SERVER" in err) == (mode == "zygote"), err
    for r in range(3):
        assert f"hello from rank {r} incarnation 0" in out
    assert "hello from rank 1 incarnation 1" in out
    # the traceback a spawned rank prints: the script's frames, none of the preloading process's
    assert "RuntimeError: rank 2 fails on purpose" in err and 'rank.py", line' in err and "preload.py" not in err


@pytest.mark.dist
@pytest.mark.parametrize("mode", ["own", "zygote"])
def test_site_hooks_run_again_in_each_forked_rank(tmp_path, mode):
    """A per-process start-up hook (here one that logs its pid; slow_start/'s delay is one too) sees
    every forked rank, as it sees every spawned one; and the process that imports for the ranks:
    the launcher's own parent, or the zygote (made for this PYTHONPATH), not the parent forked from it."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(
        "import os\nwith open(os.environ['HOOK_LOG'], 'a') as f:\n    f.write(f'{os.getpid()}\\n')\n")
    env = _env(mode, PYTHONPATH=str(hooks), HOOK_LOG=str(tmp_path / "hook.log"))
    proc = _launch(tmp_path, "--preload-modules", "json", nproc=2, env=env)
    try:
        _wait("two ranks started", lambda: all(_records(tmp_path, r) for r in range(2)), proc)
        (tmp_path / "stop").touch()
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0
    started = {int(line) for line in (tmp_path / "hook.log").read_text().split()}
    ranks = {_records(tmp_path, r)[0]["pid"] for r in range(2)}
    importer = {_records(tmp_path, r)[0]["ppid" if mode == "own" else "grandparent"] for r in range(2)}
    assert ranks <= started and len(importer) == 1 and importer <= started, (started, importer)


@pytest.mark.dist
@pytest.mark.fault
def test_launches_fork_their_parents_from_one_zygote_and_end_with_their_launcher(tmp_path):
    """Two launches of one script: each has a parent of its own, forked from the same zygote (it
    imported once). A SIGKILLed launcher takes its parent and ranks with it (the parent reads its
    channel's end), the zygote stays for the next launch."""
    runs = [tmp_path / "a", tmp_path / "b"]
    for out in runs:
        out.mkdir()
    first = _launch(runs[0], "--preload-modules", "json", nproc=2, env=_env("zygote"), script_dir=tmp_path)
    try:
        _wait("two ranks started", lambda: all(_records(runs[0], r) for r in range(2)), first)
        (runs[0] / "stop").touch()
        first.communicate(timeout=60)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    assert first.returncode == 0
    second = _launch(runs[1], "--preload-modules", "json", nproc=2, env=_env("zygote"), script_dir=tmp_path)
    try:
        _wait("two ranks started", lambda: all(_records(runs[1], r) for r in range(2)), second)
        a, b = ([_records(out, r)[0] for r in range(2)] for out in runs)
        assert len({i["ppid"] for i in a}) == len({i["ppid"] for i in b}) == 1 and a[0]["ppid"] != b[0]["ppid"]
        assert a[0]["grandparent"] == b[0]["grandparent"] not in (first.pid, second.pid), (a, b)
        doomed = [b[0]["ppid"]] + [i["pid"] for i in b]
        os.kill(second.pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while any(_state(pid) not in ("gone", "Z") for pid in doomed) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(_state(pid) in ("gone", "Z") for pid in doomed), [_state(pid) for pid in doomed]
        assert _state(a[0]["grandparent"]) in ("S", "R"), "the zygote serves on"
    finally:
        if second.poll() is None:
            os.killpg(second.pid, signal.SIGKILL)


THREADS = "import threading, time\nthreading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
CUDA = ("import sys, types\ntorch = types.ModuleType('torch')\n"
        "torch.cuda = types.SimpleNamespace(is_initialized=lambda: True)\nsys.modules['torch'] = torch\n")
# the CUDA driver initialised without a context (is_available() without NVML): torch marks the
# child of a fork "bad", and CUDA raises there; the parent asks a probe child
POISONED = ("import os, sys, types\ntorch = types.ModuleType('torch')\nparent = os.getpid()\n"
            "torch.cuda = types.SimpleNamespace(is_initialized=lambda: False, _is_in_bad_fork=lambda: os.getpid() != parent)\n"
            "sys.modules['torch'] = torch\n")


@pytest.mark.parametrize("module, source, message", [
    ("no_such_module_here", None, "importing 'no_such_module_here' failed: ModuleNotFoundError"),
    ("starts_a_thread", THREADS, "it runs 1 thread(s) besides its own after the imports"),
    ("initialises_cuda", CUDA, "CUDA was initialised during the imports"),
    ("poisons_fork", POISONED, "CUDA's driver was initialised during the imports"),
], ids=["import-fails", "thread", "cuda", "cuda-driver"])
def test_a_parent_that_cannot_fork_safely_stops_the_launch(tmp_path, module, source, message):
    if source is not None:
        (tmp_path / f"{module}.py").write_text(source)
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    proc = _launch(tmp_path, "--preload-modules", f"json,{module}", env=env)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, err
    assert message in err and "--preload:" in err, err
    assert "started (pid" not in err and not any(_records(tmp_path, r) for r in range(3))


def test_preload_is_asked_for_by_flag_or_environment(monkeypatch):
    def preload(*argv, env=None):
        if env is None:
            monkeypatch.delenv("MECEFO_PRELOAD", raising=False)
        else:
            monkeypatch.setenv("MECEFO_PRELOAD", env)
        return cli.parse_args([*argv, "train.py", "--lr", "1"]).preload

    assert preload() is None and preload(env="0") is None and preload(env="") is None
    assert preload("--preload") == "auto" and preload(env="1") == "auto"
    assert preload(env="torch,json") == "torch,json" and preload("--preload-modules", "a,b", env="1") == "a,b"
    assert preload("--no-preload", env="1") is None and preload("--no-preload", "--preload") is None


def test_auto_preloads_the_heavy_stack_and_the_scripts_top_level_imports(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import os, json as j
        from collections import OrderedDict
        from . import sibling
        try:
            import not_at_top_level
        except ImportError:
            pass
        def main():
            import inside_a_function
    """))
    assert preload.script_imports(str(script)) == ["os", "json", "collections"]
    auto = preload.modules_for("auto", str(script))
    assert auto[:1] == ["torch"] and auto[-3:] == ["os", "json", "collections"]
    assert [m for m in auto if m in preload.DEFAULT_MODULES] == [m for m in preload.DEFAULT_MODULES
                                                                if preload._installed(m)]
    assert preload.modules_for("torch, numpy,", str(script)) == ["torch", "numpy"]
    assert preload.modules_for("script,torch,json", str(script)) == ["os", "json", "collections", "torch"]
