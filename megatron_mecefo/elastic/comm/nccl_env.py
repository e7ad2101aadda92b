"""The process environment that in-process NCCL recovery needs, set before CUDA and NCCL start.

PyTorch reads these when it builds a ProcessGroupNCCL (some once per process), so they must be in
a training process's environment from its first instruction: the process that starts it sets them
(mecefo-launch, and the keeper under deepspeed / torchrun / srun / by hand, which are the parents
of every MeCeFO training process), and `init_distributed` applies them again before any process
group exists (a process started some other way). A value the user set wins; an unsafe one is
reported. Harmless without CUDA (gloo reads none of them). See docs/design.md, "NCCL". The
effects on a GPU are read from PyTorch's source, not yet verified on one (scripts/gpu_check.py is
the check).

A row whose value follows the job's configuration (TORCH_NCCL_NONBLOCKING_TIMEOUT: the collective
timeout) is set by the training process itself, in `init_distributed`, which knows it; launchers,
which do not, leave it out. PyTorch reads it at the first non-blocking communicator, after that.

`version_warnings`: the NCCL versions whose abort is known to hang, checked at start on a GPU
(the version is in each rank's `started` event).
"""

from __future__ import annotations

import math
import os
from typing import Callable, Dict, List, Mapping, NamedTuple, Optional, Tuple

__all__ = ["SETTINGS", "nccl_environment", "agent_environ", "for_children", "apply", "recorded", "parse_version",
           "version_warnings", "runtime_version", "version_record", "markdown", "DESIGNED_FOR", "GROUP_ABORT_SINCE"]

_TRUE, _FALSE = {"1", "y", "yes", "t", "true"}, {"0", "n", "no", "f", "false"}  # c10d's getCvarBool


class Setting(NamedTuple):
    value: str
    why: str
    safe: Callable[[str], bool]
    """Whether a value the user set keeps recovery working (unsafe ones are kept, and reported)."""
    source: str = ""
    per_job: bool = False
    """`value` and `safe` are formats of the collective timeout (whole seconds, `{t}`): set by the
    training process, which knows it (`apply(collective_timeout_s=...)`), never by a launcher."""


def _whole_seconds(v: str) -> Optional[int]:
    v = v.strip()
    return int(v) if v.lstrip("-").isdigit() else None


SETTINGS: Dict[str, Setting] = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": Setting(
        "2", "a failed or timed-out collective aborts its communicator only and raises in the caller; "
             "3 (PyTorch's default) and 1 end the process, survivors included",
        lambda v: v.strip() in ("0", "2"), "PyTorch's NCCL environment variables (docs)"),
    "TORCH_NCCL_DUMP_ON_TIMEOUT": Setting(
        "0", "on a data-parallel group's error the watchdog writes a dump signal into the job's store, which "
             "every process reads; the heartbeat monitor of each process's first NCCL group (kept alive) "
             "then ends it TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC (480 s) later: the whole job",
        lambda v: v.strip().lower() in _FALSE, "ProcessGroupNCCL.cpp (watchdog, heartbeat monitor)"),
    "TORCH_NCCL_RETHROW_CUDA_ERRORS": Setting(
        "0", "a CUDA error seen by the watchdog in an aborted communicator's work would be rethrown on its "
             "thread and end the process",
        lambda v: v.strip().lower() in _FALSE, "ProcessGroupNCCL.cpp; NVRx in-process restart sets it too"),
    "TORCH_NCCL_PROPAGATE_ERROR": Setting(
        "0", "one rank's communicator error must not be broadcast through the shared store to other "
             "groups (PyTorch's default, stated so a site-wide 1 is reported)",
        lambda v: v.strip().lower() in _FALSE, "ProcessGroupNCCL.hpp"),
    "NCCL_NVLS_ENABLE": Setting(
        "0", "with NVLink SHARP on, aborting a communicator can hang; NVIDIA's in-process restart requires "
             "it off (NVLS speeds up intra-node all-reduce on NVSwitch systems: a cost on H100/H200 nodes)",
        lambda v: v.strip() == "0", "nvidia-resiliency-ext, in-process restart usage guide"),
    "TORCH_NCCL_NONBLOCKING_TIMEOUT": Setting(
        "{t}", "bounds NCCL's own wait in a non-blocking communicator's init and abort (default 30 min) at "
               "collective_timeout_s, the bound MeCeFO keeps on both itself; a longer one is outlasted by "
               "MeCeFO's (the rank retires as hung instead of NCCL returning an error)",
        lambda v, t=None: (n := _whole_seconds(v)) is not None and 0 < n <= (t if t is not None else 3600),
        "ProcessGroupNCCL.cpp / NCCLUtils (nccl_nonblocking_timeout); torchft sets it to its own timeout",
        per_job=True),
}


def markdown() -> str:
    """The table docs/design.md shows (tests/elastic/test_nccl.py keeps the two equal)."""
    rows = ["| Setting | Value | Why | Source |", "| --- | --- | --- | --- |"]
    for name, s in SETTINGS.items():
        value = "`collective_timeout_s` (whole seconds), set by the training process" if s.per_job else s.value
        rows.append(f"| `{name}` | {value} | {s.why} | {s.source} |")
    return "\n".join(rows)


def nccl_environment(environ: Mapping[str, str], agent_environ: Optional[Mapping[str, str]] = None,
                     collective_timeout_s: Optional[float] = None) -> Tuple[Dict[str, str], List[str]]:
    """The settings to add to `environ` and one warning per unsafe value it already holds.

    `agent_environ`: under torchrun, the agent's own environment. torchrun's agent gives its
    workers TORCH_NCCL_ASYNC_ERROR_HANDLING=1 when its own environment does not set it; that value
    is torchrun's, not the user's, so it is replaced (a 1 set for the agent is the user's: kept).
    `collective_timeout_s`: the job's; None (a launcher) leaves out the rows that follow it.
    """
    add, warnings = {}, []
    t = None if collective_timeout_s is None else max(1, math.ceil(collective_timeout_s))
    for name, s in SETTINGS.items():
        if s.per_job and t is None:
            continue
        mine = s.value.format(t=t) if s.per_job else s.value
        value = environ.get(name)
        if name == "TORCH_NCCL_ASYNC_ERROR_HANDLING" and agent_environ is not None and value == "1" \
                and name not in agent_environ:
            value = None
        if value is None:
            add[name] = mine
        elif s.per_job and not s.safe(value, t):
            warnings.append(f"{name}={value} is set: it does not fit collective_timeout_s ({s.why}); MeCeFO would "
                            f"set {mine}")
        elif not s.per_job and not s.safe(value):
            warnings.append(f"{name}={value} is set: MeCeFO cannot recover in-process from NCCL failures with it "
                            f"({s.why}); MeCeFO would set {mine}")
    return add, warnings


def agent_environ(environ: Mapping[str, str]) -> Optional[Dict[str, str]]:
    """Under torchrun (TORCHELASTIC_RUN_ID), the environment the agent (this process's parent) was
    started with; {} when it cannot be read (then torchrun's 1 is taken for its default)."""
    if "TORCHELASTIC_RUN_ID" not in environ:
        return None
    try:
        with open(f"/proc/{os.getppid()}/environ", "rb") as f:
            pairs = (item.decode(errors="replace").partition("=") for item in f.read().split(b"\0") if item)
            return {k: v for k, _, v in pairs}
    except OSError:
        return {}


def for_children(log: Callable[[str], None]) -> Dict[str, str]:
    """What a launcher (mecefo-launch, the keeper) adds to its training processes' environment,
    from its own; unsafe values the user set are reported through `log`."""
    add, warnings = nccl_environment(os.environ, agent_environ(os.environ))
    for w in warnings:
        log(w)
    return add


def apply(environ=None, log: Optional[Callable[[str], None]] = None, collective_timeout_s: Optional[float] = None,
          launcher_reported: bool = False) -> Dict[str, str]:
    """Set the missing settings in `environ` (os.environ by default; before CUDA/NCCL start) and
    report unsafe ones through `log`. Returns what was added. `collective_timeout_s`: the job's
    (the training process's call); None: a launcher's, without the rows that follow it.
    `launcher_reported`: the process's launcher reported the other rows already; only the rows
    that follow the job's configuration are reported here."""
    environ = os.environ if environ is None else environ
    add, warnings = nccl_environment(environ, agent_environ(environ), collective_timeout_s)
    environ.update(add)
    per_job = tuple(f"{name}=" for name, s in SETTINGS.items() if s.per_job)
    for w in warnings:
        if log is not None and (not launcher_reported or w.startswith(per_job)):
            log(w)
    return add


def recorded(environ: Optional[Mapping[str, str]] = None) -> Dict[str, Optional[str]]:
    """The values this process runs with (for the event log)."""
    environ = os.environ if environ is None else environ
    return {name: environ.get(name) for name in SETTINGS}


# -- versions -------------------------------------------------------------------------------------

DESIGNED_FOR = "NCCL >= 2.26.2, outside 2.28.3-2.28.8; torch 2.13"
"""What recovery was designed against (docs/design.md, "NCCL"): NVIDIA's in-process restart's
requirements, which meet the hangs below."""
GROUP_ABORT_SINCE = (2, 22, 0)
"""ProcessGroupNCCL aborts its communicators inside one ncclGroupStart/End from this NCCL on
(abortCommsFromMap; pytorch#150690)."""

_KNOWN_HANGS = (
    (lambda v: v < GROUP_ABORT_SINCE, "communicators are aborted one after another, not as a group, and that "
     "can hang (pytorch#150690; grouped from NCCL 2.22)"),
    (lambda v: v < (2, 26, 2), "ncclCommAbort can hang (pytorch#149153 with 2.25.1; fixed in 2.26.2, which "
     "NVIDIA's in-process restart requires)"),
    (lambda v: (2, 28, 3) <= v <= (2, 28, 8), "NVIDIA's in-process restart guide says to avoid NCCL "
     "2.28.3-2.28.8 (a known hang in recovery)"),
)


def parse_version(v) -> Optional[Tuple[int, int, int]]:
    """(major, minor, patch) from torch.cuda.nccl.version()'s tuple or int (2.x: major*10000 +
    minor*100 + patch), or from a "2.27.3" string; None when it cannot be read."""
    if isinstance(v, (tuple, list)) and len(v) >= 3 and all(isinstance(x, int) for x in v[:3]):
        return tuple(v[:3])
    if isinstance(v, int) and v >= 10000:
        return v // 10000, v // 100 % 100, v % 100
    if isinstance(v, str):
        parts = v.strip().split(".")
        if len(parts) >= 3 and all(p.isdigit() for p in parts[:3]):
            return tuple(int(p) for p in parts[:3])
    return None


def version_warnings(version: Optional[Tuple[int, int, int]]) -> List[str]:
    """One line per known hang of this NCCL version (none for an unknown version)."""
    if version is None:
        return []
    dotted = ".".join(map(str, version))
    return [f"NCCL {dotted}: {why}; recovery was designed against {DESIGNED_FOR}"
            for applies, why in _KNOWN_HANGS if applies(version)]


def runtime_version(probe: Optional[Callable[[], object]] = None) -> Optional[Tuple[int, int, int]]:
    """The NCCL this process loads (torch.cuda.nccl.version() asks the library: the runtime
    version), or None without CUDA. `probe`: tests fake it."""
    if probe is None:
        import torch

        if not torch.cuda.is_available():
            return None
        probe = torch.cuda.nccl.version
    try:
        return parse_version(probe())
    except Exception:
        return None


def version_record(backend: str, log: Optional[Callable[[str], None]] = None,
                   probe: Optional[Callable[[], object]] = None) -> Dict[str, object]:
    """For the `started` event: the NCCL version this process runs (None on gloo or without CUDA)
    and the known hangs of that version, each also reported through `log`."""
    version = runtime_version(probe) if backend == "nccl" else None
    warnings = version_warnings(version)
    for w in warnings if log is not None else ():
        log(w)
    return {"nccl_version": ".".join(map(str, version)) if version else None, "nccl_warnings": warnings}
