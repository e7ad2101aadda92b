"""Shared fixtures: a single-process Megatron world, a tiny LLaMA-style GPT, saved-bytes meter."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
# every mecefo-launch of the tests forks its ranks from a preloaded parent (elastic/launch/preload.py):
# most of a rank's start is imports; the tests that cover the plain spawn pass --no-preload
os.environ.setdefault("MECEFO_PRELOAD", "1")

import pytest


@pytest.fixture(scope="session", autouse=True)
def preload_server():
    """One zygote server per test process (megatron_mecefo/testing/zygotes.py): the launches of the
    session fork their preloaded parents from zygotes that imported torch, DeepSpeed and Megatron
    once, instead of importing them again for every launch; and every `mecefo-launch` process of the
    session stands in for a launcher forked from it (MECEFO_LAUNCHER_SERVER, testing/forked_launcher.py).
    MECEFO_PRELOAD_SERVER=0 leaves the server out, MECEFO_LAUNCHER_SERVER=0 the launchers only."""
    if os.environ.get("MECEFO_PRELOAD_SERVER") is not None:
        yield os.environ.get("MECEFO_PRELOAD_SERVER")
        return
    import subprocess
    import sys
    import tempfile
    import time

    where = tempfile.mkdtemp(prefix="mecefo-zygotes-")  # short: a socket path has at most 107 bytes
    path = os.path.join(where, "socket")
    with open(os.path.join(where, "server.log"), "w") as log:
        server = subprocess.Popen([sys.executable, "-m", "megatron_mecefo.testing.zygotes", path], stdout=log,
                                  stderr=subprocess.STDOUT)
    while not os.path.exists(path):  # it appears once the server accepts connections
        if server.poll() is not None:
            raise RuntimeError(f"the zygote server ended: {open(os.path.join(where, 'server.log')).read()[-2000:]}")
        time.sleep(0.05)
    launchers = os.environ.get("MECEFO_LAUNCHER_SERVER") != "0"  # =0: launchers of their own
    os.environ["MECEFO_PRELOAD_SERVER"] = path
    if launchers:
        os.environ["MECEFO_LAUNCHER_SERVER"] = path
    yield path
    del os.environ["MECEFO_PRELOAD_SERVER"]
    if launchers:
        del os.environ["MECEFO_LAUNCHER_SERVER"]
    server.terminate()  # its zygotes die with it
    server.wait()
    import shutil

    shutil.rmtree(where, ignore_errors=True)


@pytest.fixture(scope="session")
def megatron_world():
    """torch.distributed (gloo, world size 1, in-memory store) + Megatron parallel_state, TP=PP=1."""
    import torch.distributed as dist

    from megatron_mecefo.layers.model import init_model_parallel

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    init_model_parallel(1, 1, seed=1234)
    yield
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


@pytest.fixture
def tiny_config(megatron_world):
    from megatron_mecefo.layers.model import llama_config

    from tests.helpers import TINY

    return llama_config(**TINY)


@pytest.fixture(scope="session")
def shared_run(tmp_path_factory):
    """`shared_run(name, args, run)`: `run()`'s CompletedProcess, computed once per test session for
    (`name`, `args`) and read back by any other test (on any xdist worker) that asks for the same
    run: the fault-free reference runs several tests compare against. A file lock serialises the
    first computation; a failed run is not kept."""
    import fcntl
    import hashlib
    import json
    import subprocess

    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # the workers' temp dirs sit in the session's
        base = base.parent
    root = base / "shared-runs"
    root.mkdir(exist_ok=True)

    def get(name, args, run):
        # paths (a worker's checkout, a test's ds_config) do not make another run: `name` says what
        # the files hold
        flags = ["<path>" if os.sep in str(a) else str(a) for a in args]
        key = f"{name}-{hashlib.sha256(json.dumps(flags).encode()).hexdigest()[:16]}"
        with open(root / f"{key}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            path = root / f"{key}.json"
            if path.exists():
                kept = json.loads(path.read_text())
                return subprocess.CompletedProcess(kept["args"], kept["returncode"], kept["stdout"], kept["stderr"])
            proc = run()
            if proc.returncode == 0:
                path.write_text(json.dumps({"args": [str(a) for a in proc.args], "returncode": proc.returncode,
                                            "stdout": proc.stdout, "stderr": proc.stderr}))
            return proc

    return get


def pytest_configure(config):
    """Before any test (on the controller, before the xdist workers start and inherit the environment):
    torch's JIT extensions in the checkout's own directory, unlocked and built (testing/extensions.py)."""
    if hasattr(config, "workerinput"):
        return
    from megatron_mecefo.testing.extensions import prepare

    prepare(config.rootpath)


# The longest tests first (mean seconds a test, measured 2026-12-07): with two workers the suite
# ends when the later one does, and a 90-second Megatron-LM test handed out last kept one core busy
# alone for minutes. Longest-first leaves only short tests for the end.
LONGEST_FIRST = (
    "tests/integrations/test_megatron_lm.py",
    "tests/integrations/test_megatron_deepspeed.py",
    "tests/elastic/test_stragglers.py",
    "tests/data/test_pretrain_gpt_overlap.py",
    "tests/data/test_pretrain_gpt_launchers.py",
    "tests/data/test_pretrain_gpt_layouts.py",
    "tests/data/test_pretrain_gpt_resume.py",
    "tests/data/test_pretrain_gpt_sharded.py",
    "tests/data/test_pretrain_gpt_chaos.py",
    "tests/elastic/test_zero.py",
    "tests/deepspeed_hook/test_engine.py",
    "tests/elastic/test_chaos.py",
    "tests/elastic/test_fault_tolerance.py",
)


def pytest_collection_modifyitems(config, items):
    """Order the tests longest file first (LONGEST_FIRST, then the rest as collected); every xdist
    worker sorts alike, as xdist requires."""
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


def pytest_addoption(parser):
    parser.addoption("--cpu-times", metavar="FILE", default=None,
                     help="append each test's wall time and CPU seconds (its own and its ended processes') to "
                          "FILE, one JSON line per test: the suite is bound by CPU, so this is what a test costs")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    out = item.config.getoption("--cpu-times")
    if not out:
        yield
        return
    import json
    import resource
    import time

    def cpu(who):
        r = resource.getrusage(who)
        return r.ru_utime + r.ru_stime

    own, ended, t0 = cpu(resource.RUSAGE_SELF), cpu(resource.RUSAGE_CHILDREN), time.time()
    yield
    with open(out, "a") as f:  # short appends: the xdist workers share the file
        f.write(json.dumps({"test": item.nodeid, "wall_s": round(time.time() - t0, 2),
                            "cpu_s": round(cpu(resource.RUSAGE_SELF) - own + cpu(resource.RUSAGE_CHILDREN) - ended, 2)})
                + "\n")
