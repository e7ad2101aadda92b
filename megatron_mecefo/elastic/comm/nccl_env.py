"""The process environment that in-process NCCL recovery needs, set before CUDA and NCCL start.

PyTorch reads these when it builds a ProcessGroupNCCL (some once per process), so they must be in
a training process's environment from its first instruction: the process that starts it sets them
(mecefo-launch, and the keeper under deepspeed / torchrun / srun / by hand, which are the parents
of every MeCeFO training process), and `init_distributed` applies them again before any process
group exists (a process started some other way). A value the user set wins; an unsafe one is
reported. Harmless without CUDA (gloo reads none of them). See docs/design.md, "NCCL". The
effects on a GPU are read from PyTorch 2.13's source, not yet verified on one
(scripts/gpu_check.py is the check).
"""

from __future__ import annotations

import os
from typing import Callable, Dict, List, Mapping, NamedTuple, Optional, Tuple

__all__ = ["SETTINGS", "nccl_environment", "agent_environ", "for_children", "apply", "recorded"]

_TRUE, _FALSE = {"1", "y", "yes", "t", "true"}, {"0", "n", "no", "f", "false"}  # c10d's getCvarBool


class Setting(NamedTuple):
    value: str
    why: str
    safe: Callable[[str], bool]
    """Whether a value the user set keeps recovery working (unsafe ones are kept, and reported)."""


SETTINGS: Dict[str, Setting] = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": Setting(
        "2", "a failed or timed-out collective aborts its communicator only and raises in the caller; "
             "3 (PyTorch's default) and 1 end the process, survivors included",
        lambda v: v.strip() in ("0", "2")),
    "TORCH_NCCL_DUMP_ON_TIMEOUT": Setting(
        "0", "on a data-parallel group's error the watchdog writes a dump signal into the job's store, which "
             "every process reads; the heartbeat monitor of each process's first NCCL group (kept alive) "
             "then ends it TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC (480 s) later: the whole job",
        lambda v: v.strip().lower() in _FALSE),
    "TORCH_NCCL_RETHROW_CUDA_ERRORS": Setting(
        "0", "a CUDA error seen by the watchdog in an aborted communicator's work would be rethrown on its "
             "thread and end the process",
        lambda v: v.strip().lower() in _FALSE),
    "TORCH_NCCL_PROPAGATE_ERROR": Setting(
        "0", "one rank's communicator error must not be broadcast through the shared store to other "
             "groups (PyTorch's default, stated so a site-wide 1 is reported)",
        lambda v: v.strip().lower() in _FALSE),
    "TORCH_NCCL_NONBLOCKING_TIMEOUT": Setting(
        "300", "bounds NCCL's own wait in a non-blocking communicator's init and abort (default 30 min); "
               "MeCeFO bounds both itself too (collective_timeout_s)",
        lambda v: v.strip().lstrip("-").isdigit() and 0 < int(v) <= 3600),
}


def nccl_environment(environ: Mapping[str, str], agent_environ: Optional[Mapping[str, str]] = None
                     ) -> Tuple[Dict[str, str], List[str]]:
    """The settings to add to `environ` and one warning per unsafe value it already holds.

    `agent_environ`: under torchrun, the agent's own environment. torchrun's agent gives its
    workers TORCH_NCCL_ASYNC_ERROR_HANDLING=1 when its own environment does not set it; that value
    is torchrun's, not the user's, so it is replaced (a 1 set for the agent is the user's: kept).
    """
    add, warnings = {}, []
    for name, s in SETTINGS.items():
        value = environ.get(name)
        if name == "TORCH_NCCL_ASYNC_ERROR_HANDLING" and agent_environ is not None and value == "1" \
                and name not in agent_environ:
            value = None
        if value is None:
            add[name] = s.value
        elif not s.safe(value):
            warnings.append(f"{name}={value} is set: MeCeFO cannot recover in-process from NCCL failures with it "
                            f"({s.why}); MeCeFO would set {s.value}")
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


def apply(environ=None, log: Optional[Callable[[str], None]] = None) -> Dict[str, str]:
    """Set the missing settings in `environ` (os.environ by default; before CUDA/NCCL start) and
    report unsafe ones through `log`. Returns what was added."""
    environ = os.environ if environ is None else environ
    add, warnings = nccl_environment(environ, agent_environ(environ))
    environ.update(add)
    for w in warnings:
        if log is not None:
            log(w)
    return add


def recorded(environ: Optional[Mapping[str, str]] = None) -> Dict[str, Optional[str]]:
    """The values this process runs with (for the event log)."""
    environ = os.environ if environ is None else environ
    return {name: environ.get(name) for name in SETTINGS}
