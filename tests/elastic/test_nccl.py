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


PER_JOB = {name for name, s in nccl_env.SETTINGS.items() if s.per_job}


def test_every_setting_is_added_to_an_environment_without_them():
    add, warnings = nccl_env.nccl_environment({}, collective_timeout_s=60)
    assert add == {name: s.value.format(t=60) for name, s in nccl_env.SETTINGS.items()}
    assert add["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2" and add["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0"
    assert add["NCCL_NVLS_ENABLE"] == "0" and add["TORCH_NCCL_NONBLOCKING_TIMEOUT"] == "60"
    assert warnings == []
    assert all(s.safe(s.value.format(t=60), 60) if s.per_job else s.safe(s.value) for s in nccl_env.SETTINGS.values())
    assert all(s.why and s.source for s in nccl_env.SETTINGS.values()), "each row says why, with its source"
    # a launcher does not know the collective timeout: the rows that follow it are the training process's
    add, _ = nccl_env.nccl_environment({})
    assert set(add) == set(nccl_env.SETTINGS) - PER_JOB and PER_JOB == {"TORCH_NCCL_NONBLOCKING_TIMEOUT"}


def test_a_user_setting_wins_and_an_unsafe_one_is_reported():
    user = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "TORCH_NCCL_DUMP_ON_TIMEOUT": "true", "TORCH_NCCL_NONBLOCKING_TIMEOUT": "60"}
    add, warnings = nccl_env.nccl_environment(user, collective_timeout_s=60)
    assert not set(add) & set(user), "what the user set is never replaced"
    assert set(add) == set(nccl_env.SETTINGS) - set(user)
    (warning,) = warnings  # 0 (no handling) and 60 s are safe; dumping on a timeout is not
    assert warning.startswith("TORCH_NCCL_DUMP_ON_TIMEOUT=true is set") and "480 s" in warning
    _, warnings = nccl_env.nccl_environment({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"})
    assert len(warnings) == 1 and "end the process" in warnings[0]


def test_nvlink_sharp_is_turned_off_unless_the_user_turned_it_on():
    add, warnings = nccl_env.nccl_environment({"NCCL_NVLS_ENABLE": "1"})
    assert "NCCL_NVLS_ENABLE" not in add
    (warning,) = warnings
    assert warning.startswith("NCCL_NVLS_ENABLE=1 is set") and "NVLink SHARP" in warning and "would set 0" in warning
    assert nccl_env.nccl_environment({"NCCL_NVLS_ENABLE": "0"})[1] == []


def test_the_non_blocking_timeout_follows_the_collective_timeout():
    add, _ = nccl_env.nccl_environment({}, collective_timeout_s=45.5)
    assert add["TORCH_NCCL_NONBLOCKING_TIMEOUT"] == "46"  # whole seconds, never below MeCeFO's own bound
    assert nccl_env.nccl_environment({}, collective_timeout_s=0.2)[0]["TORCH_NCCL_NONBLOCKING_TIMEOUT"] == "1"
    for value, reported in (("30", False), ("60", False), ("1800", True), ("0", True), ("ten", True)):
        add, warnings = nccl_env.nccl_environment({"TORCH_NCCL_NONBLOCKING_TIMEOUT": value}, collective_timeout_s=60)
        assert "TORCH_NCCL_NONBLOCKING_TIMEOUT" not in add, "the user's value is kept"
        assert bool(warnings) == reported, (value, warnings)
        if reported:
            assert "does not fit collective_timeout_s" in warnings[0] and "would set 60" in warnings[0]
    # a launcher neither sets nor judges it
    assert nccl_env.nccl_environment({"TORCH_NCCL_NONBLOCKING_TIMEOUT": "1800"}) == (
        {k: s.value for k, s in nccl_env.SETTINGS.items() if not s.per_job}, [])


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
    assert "TORCH_NCCL_NONBLOCKING_TIMEOUT" not in env  # a launcher's call
    assert nccl_env.apply(env, log=seen.append, collective_timeout_s=30) == {"TORCH_NCCL_NONBLOCKING_TIMEOUT": "30"}
    assert len(seen) == 2 and nccl_env.apply(env, log=seen.append, collective_timeout_s=30) == {}  # nothing left
    assert nccl_env.recorded(env) == {name: env[name] for name in nccl_env.SETTINGS}


def test_under_a_launcher_the_training_process_reports_only_what_the_launcher_could_not():
    env, seen = {"TORCH_NCCL_RETHROW_CUDA_ERRORS": "1", "TORCH_NCCL_NONBLOCKING_TIMEOUT": "1800"}, []
    nccl_env.apply(env, log=seen.append, collective_timeout_s=60, launcher_reported=True)
    (warning,) = seen  # the launcher reported RETHROW already
    assert warning.startswith("TORCH_NCCL_NONBLOCKING_TIMEOUT=1800")


def test_nccl_versions_are_parsed_and_known_hangs_named():
    assert nccl_env.parse_version((2, 27, 3)) == (2, 27, 3) == nccl_env.parse_version(22703)
    assert nccl_env.parse_version("2.28.5") == (2, 28, 5) and nccl_env.parse_version("2.28") is None
    assert nccl_env.parse_version(None) is None and nccl_env.parse_version("cuda") is None
    cases = {(2, 21, 5): ["150690", "149153"], (2, 25, 1): ["149153"], (2, 26, 2): [], (2, 27, 7): [],
             (2, 28, 3): ["2.28.3-2.28.8"], (2, 28, 8): ["2.28.3-2.28.8"], (2, 28, 9): [], (2, 31, 2): []}
    for version, named in cases.items():
        warnings = nccl_env.version_warnings(version)
        assert len(warnings) == len(named), (version, warnings)
        for w, n in zip(warnings, named):
            assert n in w and w.startswith("NCCL " + ".".join(map(str, version))) and nccl_env.DESIGNED_FOR in w
    assert nccl_env.version_warnings(None) == []


def test_the_started_events_version_record():
    logged = []
    assert nccl_env.version_record("nccl", log=logged.append, probe=lambda: (2, 25, 1)) == {
        "nccl_version": "2.25.1", "nccl_warnings": nccl_env.version_warnings((2, 25, 1))}
    assert logged == nccl_env.version_warnings((2, 25, 1)) and len(logged) == 1  # the rank logs each known hang
    assert nccl_env.version_record("nccl", probe=lambda: 22703) == {"nccl_version": "2.27.3", "nccl_warnings": []}
    assert nccl_env.version_record("gloo", probe=lambda: (2, 25, 1)) == {"nccl_version": None, "nccl_warnings": []}
    broken = lambda: (_ for _ in ()).throw(RuntimeError("no libnccl"))  # noqa: E731
    assert nccl_env.version_record("nccl", probe=broken) == {"nccl_version": None, "nccl_warnings": []}


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


class _NcclBackend(_Group):
    """A fake ProcessGroupNCCL: its calls go to one shared journal; shutdown must never be called."""

    def __init__(self, name, journal, **kw):
        super().__init__(**kw)
        self.name, self.journal = name, journal

    def _group_start(self):
        self.journal.append("group_start")

    def _group_end(self):
        self.journal.append("group_end")

    def abort(self):
        self.journal.append(f"abort {self.name}")
        super().abort()

    def shutdown(self):  # finalize + ncclCommDestroy: waits for a dead peer
        self.journal.append(f"shutdown {self.name}")


def test_a_generations_groups_are_aborted_as_one_where_nccl_allows_and_never_shut_down():
    journal = []
    groups.release([_NcclBackend("a", journal), None, _NcclBackend("b", journal)], 5, nccl_version=(2, 27, 3))
    assert journal == ["group_start", "abort a", "abort b", "group_end"]
    journal.clear()  # before 2.22 NCCL has no group abort: one after another
    groups.release([_NcclBackend("a", journal), _NcclBackend("b", journal)], 5, nccl_version=(2, 21, 5))
    assert journal == ["abort a", "abort b"]
    journal.clear()  # one group: its own abort groups its communicators
    groups.destroy_group(_NcclBackend("a", journal), 5)
    assert journal == ["abort a"]
    journal.clear()  # a gloo group has no group calls: plain aborts
    a, b = _Group(), _Group()
    groups.release([a, b], 5, nccl_version=(2, 27, 3))
    assert a.aborted == b.aborted == 1


def test_a_broken_group_does_not_stop_the_others_and_a_hung_one_ends_at_the_shared_deadline():
    journal = []
    broken = _NcclBackend("a", journal)
    broken.abort = lambda: (journal.append("abort a"), (_ for _ in ()).throw(RuntimeError("already aborted")))
    groups.release([broken, _NcclBackend("b", journal)], 5, nccl_version=(2, 27, 3))
    assert journal == ["group_start", "abort a", "abort b", "group_end"]
    hung, other = _NcclBackend("h", journal, abort_hangs=True), _NcclBackend("o", journal)
    journal.clear()
    t0 = time.monotonic()
    with pytest.raises(groups.AbortHung, match="aborting 2 groups did not return within 0.3 s"):
        groups.release([hung, other], 0.3, nccl_version=(2, 27, 3))
    assert 0.3 <= time.monotonic() - t0 < 10.0 and journal == ["group_start", "abort h"]
    hung.release.set()
    assert not any(j.startswith("shutdown") for j in journal)


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
    for mode in ("sequential", "grouped"):  # the abort-pair case's path, on gloo: both groups released
        result = gpu_check.run_case("abort_pair", 120, mode=mode, extra=["--backend", "gloo"])
        assert result["status"] == "ok" and result["groups_alive"] == 0, result
        assert result["nccl"] is None and result["grouped_by_release"] is False, result
        aborts = result["abort"] if mode == "sequential" else [result["abort"]]
        assert len(aborts) == (2 if mode == "sequential" else 1) and all(a.startswith("returned in") for a in aborts), result


def test_the_design_shows_the_environment_table():
    import re

    from tests.helpers import ROOT

    design = (ROOT / "docs" / "design.md").read_text()
    shown = re.search(r"<!-- nccl_env -->\n(.*?)\n<!-- /nccl_env -->", design, re.S)
    assert shown is not None and shown.group(1).strip() == nccl_env.markdown(), \
        f"docs/design.md's NCCL table is not nccl_env.SETTINGS's; it is:\n{nccl_env.markdown()}"
