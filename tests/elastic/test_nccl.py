"""What of the NCCL path runs without a GPU: the process environment chosen for NCCL recovery
(nccl_env.py), the options of a generation's NCCL group, and the bounds on connecting and aborting a
group (groups.py) with fake groups that never return. Under every launcher the training process's
own environment is checked by the launcher tests (events "started": test_fault_tolerance.py,
test_pretrain_gpt_launchers.py); the GPU path itself is scripts/gpu_check.py."""

import threading
import time
import types
from datetime import timedelta

import pytest

from megatron_mecefo.elastic.comm import groups, nccl_env


def test_every_setting_is_added_to_an_environment_without_them():
    add, warnings = nccl_env.nccl_environment({})
    assert add == {name: s.value for name, s in nccl_env.SETTINGS.items()}
    assert add["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2" and add["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0"
    assert warnings == []
    assert all(s.safe(s.value) for s in nccl_env.SETTINGS.values()), "each default passes its own check"


def test_a_user_setting_wins_and_an_unsafe_one_is_reported():
    user = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "TORCH_NCCL_DUMP_ON_TIMEOUT": "true", "TORCH_NCCL_NONBLOCKING_TIMEOUT": "60"}
    add, warnings = nccl_env.nccl_environment(user)
    assert not set(add) & set(user), "what the user set is never replaced"
    assert set(add) == set(nccl_env.SETTINGS) - set(user)
    (warning,) = warnings  # 0 (no handling) and 60 s are safe; dumping on a timeout is not
    assert warning.startswith("TORCH_NCCL_DUMP_ON_TIMEOUT=true is set") and "480 s" in warning
    _, warnings = nccl_env.nccl_environment({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"})
    assert len(warnings) == 1 and "end the process" in warnings[0]


def test_torchruns_own_default_is_replaced_but_a_value_set_for_its_agent_is_kept():
    worker = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "TORCHELASTIC_RUN_ID": "x"}  # torchrun's default
    add, warnings = nccl_env.nccl_environment(worker, agent_environ={})
    assert add["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2" and warnings == []
    add, warnings = nccl_env.nccl_environment(worker, agent_environ={"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"})
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in add and len(warnings) == 1


def test_apply_sets_the_environment_once_and_reports_through_the_log():
    env, seen = {"TORCH_NCCL_RETHROW_CUDA_ERRORS": "1"}, []
    added = nccl_env.apply(env, log=seen.append)
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2" and env["TORCH_NCCL_RETHROW_CUDA_ERRORS"] == "1"
    assert "TORCH_NCCL_RETHROW_CUDA_ERRORS" not in added and len(seen) == 1
    assert nccl_env.apply(env, log=seen.append) == {} and len(seen) == 2  # nothing left to add
    assert nccl_env.recorded(env) == {name: env[name] for name in nccl_env.SETTINGS}


class _Options:  # torch's CPU build has no ProcessGroupNCCL: its Options' shape (torch 2.13 .pyi)
    def __init__(self):
        self.config = types.SimpleNamespace(blocking=1)
        self._timeout = timedelta(minutes=10)


def test_nccl_options_are_non_blocking_with_the_collective_timeout():
    opts = groups.nccl_options(timedelta(seconds=7), options_type=_Options)
    assert opts.config.blocking == 0 and opts._timeout == timedelta(seconds=7)


class _Group:
    """A backend whose connect and abort block until released (NCCL's can hang)."""

    def __init__(self, connect_hangs=False, abort_hangs=False, connect_error=None):
        self.release = threading.Event()
        self.aborted = 0
        self.connect_hangs, self.abort_hangs, self.connect_error = connect_hangs, abort_hangs, connect_error

    def eager_connect_single_device(self, device):
        if self.connect_error:
            raise self.connect_error
        if self.connect_hangs:
            self.release.wait()

    def abort(self):
        self.aborted += 1
        if self.abort_hangs:
            self.release.wait()


def test_an_abort_that_never_returns_is_abandoned_at_its_deadline():
    group = _Group(abort_hangs=True)
    t0 = time.monotonic()
    with pytest.raises(groups.AbortHung, match="within 0.3 s"):
        groups.destroy_group(group, 0.3)
    assert 0.3 <= time.monotonic() - t0 < 10.0 and group.aborted == 1
    group.release.set()
    groups.destroy_group(_Group(), 0.3)  # one that returns: nothing raised
    broken = _Group()
    broken.abort = lambda: (_ for _ in ()).throw(RuntimeError("already aborted"))
    groups.destroy_group(broken, 0.3)  # one already broken: nothing more to release


def test_a_connect_that_never_returns_ends_at_the_deadline_or_a_peers_abort_and_aborts_the_group():
    group = _Group(connect_hangs=True)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        groups.connect(group, "cuda:0", timedelta(seconds=0.3))
    assert 0.3 <= time.monotonic() - t0 < 10.0 and group.aborted == 1
    group, t0 = _Group(connect_hangs=True), time.monotonic()
    flag = threading.Timer(0.2, lambda: None)
    flag.start()
    with pytest.raises(groups.PeerAborted):  # a member declared the generation failed
        groups.connect(group, "cuda:0", timedelta(seconds=30), should_abort=lambda: not flag.is_alive())
    assert time.monotonic() - t0 < 10.0 and group.aborted == 1
    group = _Group(connect_error=RuntimeError("ncclCommInitRank failed"))
    with pytest.raises(RuntimeError, match="ncclCommInitRank"):
        groups.connect(group, "cuda:0", timedelta(seconds=30))
    assert group.aborted == 1
    group = _Group(connect_hangs=True, abort_hangs=True)  # and then its abort hangs too
    with pytest.raises(groups.AbortHung):
        groups.connect(group, "cuda:0", timedelta(seconds=0.2))


def test_gpu_check_says_there_is_no_cuda_and_its_generation_loop_runs_on_gloo():
    """scripts/gpu_check.py on a machine without CUDA: exit 0, saying so. Its generations case,
    run through the parent's subprocess harness with gloo, builds, uses and aborts each generation's
    group and frees it (the GPU run measures the same loop on NCCL)."""
    import subprocess
    import sys

    from tests.helpers import ROOT

    script = ROOT / "scripts" / "gpu_check.py"
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "no CUDA" in proc.stdout, proc.stdout + proc.stderr
    sys.path.insert(0, str(script.parent))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(script.parent))
    result = gpu_check.run_case("generations", 120, extra=["--backend", "gloo", "--generations", "3"])
    assert result["status"] == "ok", result
    assert [r["generation"] for r in result["generations"]] == [0, 1, 2] and result["all_results_ok"]
    assert result["groups_alive_last"] == 0 and result["thread_drift"] == 0, result
