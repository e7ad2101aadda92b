"""The job's store: where it listens, which job it belongs to, and every key namespaced by that job.

One TCPStore per job, hosted outside the training ranks (by `mecefo-launch`, or by the daemon of
store_daemon.py under another launcher) so any rank may die. Its host:

* listens on MASTER_ADDR only (a socket bound here and handed to TCPStore through
  `master_listen_fd`; TCPStore on its own listens on every interface), falling back to every
  interface, with a warning, only when MASTER_ADDR is not an address of this machine or is a
  hostname that resolves to loopback here;
* writes the root key `mecefo/job` = {"id", "pid", "host", "created"} before any rank can read it.

A rank attaches with `attach()`: it checks that the store is its job's (the id from the launcher's
MECEFO_JOB_ID, when there is one), that the job has not ended yet (a first start), and claims
`started/{rank}/{incarnation}` once, so a rank of a new job that reaches an earlier job's store (a
rerun on the same port while the old daemon lingers) stops with JobConflict instead of reading the
old job's keys. All of MeCeFO's keys live under `mecefo/{job id}/`.

Trust model: like torch.distributed's own store, the store is unauthenticated; the job id is an
identity, not a secret (TCPStore can list its keys). Run jobs on a trusted network.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import socket
import time
import uuid
from datetime import timedelta
from typing import Callable, Optional, Tuple

import torch.distributed as dist

from megatron_mecefo.errors import JobConflict

__all__ = ["StoreHealth", "JOB_KEY", "new_job_id", "listen_socket", "host_store", "client", "job_store", "read_job", "attach",
           "describe_busy_port", "request_stop", "CountingStore"]

logger = logging.getLogger(__name__)

JOB_KEY = "mecefo/job"
STOP_KEY = "mecefo/stop"


def new_job_id() -> str:
    return uuid.uuid4().hex


def listen_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on `host`:`port` (port 0: any free port).

    When `host` is not an address of this machine (a name that resolves elsewhere, behind NAT) or a
    hostname that resolves to loopback here, it listens on every interface instead, with a warning.
    Raises OSError (EADDRINUSE) when the port is taken.
    """
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise OSError(f"cannot resolve the store address {host!r}: {e}") from None
    anywhere = ("::" if family == socket.AF_INET6 else "0.0.0.0", port)
    candidates = [addr, anywhere]
    if ipaddress.ip_address(addr[0]).is_loopback and not _names_loopback(host):
        # a hostname this machine maps to loopback (Debian's 127.0.1.1) while other nodes resolve it
        # to the real address: listening on loopback only would shut them out
        logger.warning("MASTER_ADDR %s resolves to %s here: the store listens on every interface; restrict port "
                       "%d with a firewall", host, addr[0], port)
        candidates = candidates[1:]
    for bind_addr in candidates:
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart may follow a crash (TIME_WAIT)
        try:
            sock.bind(bind_addr)
        except OSError as e:
            sock.close()
            if e.errno == 99 and bind_addr != anywhere:  # EADDRNOTAVAIL: MASTER_ADDR is not an address of this machine
                logger.warning("the store cannot listen on %s only (not an address of this machine): it listens on "
                               "every interface; restrict port %d with a firewall", host, port)
                continue
            raise
        sock.listen(1024)
        return sock
    raise AssertionError("unreachable")


def _names_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_store(host: str, port: int, job_id: str, timeout: timedelta = timedelta(seconds=300)) -> dist.TCPStore:
    """Host the job's TCPStore on `host`:`port` (0: any free port, read back from `.port`) and
    announce `job_id` in it. Raises OSError when the port is taken."""
    sock = listen_socket(host, port)
    try:
        store = dist.TCPStore(host, sock.getsockname()[1], is_master=True, timeout=timeout, wait_for_workers=False,
                              master_listen_fd=sock.fileno())
    finally:
        sock.detach()  # the store owns the descriptor now
    store.set(JOB_KEY, json.dumps({"id": job_id, "pid": os.getpid(), "host": socket.gethostname(),
                                   "created": time.time()}))
    return store


def client(host: str, port: int, timeout: timedelta) -> dist.TCPStore:
    """A client connection to a store hosted elsewhere (no job prefix)."""
    return dist.TCPStore(host, port, is_master=False, timeout=timeout, wait_for_workers=False)


def job_store(store: dist.Store, job_id: str) -> dist.PrefixStore:
    """`store` seen through the job's namespace: every MeCeFO key is `mecefo/{job_id}/...`."""
    return dist.PrefixStore(f"mecefo/{job_id}", store)


def read_job(store: dist.Store, where: str, job_id: Optional[str] = None, wait_s: float = 60.0) -> dict:
    """The job record of the store (waits up to wait_s for its host to write it).

    Raises:
        JobConflict: the store belongs to another job than `job_id`, or announces none.
    """
    deadline = time.monotonic() + wait_s
    while not store.check([JOB_KEY]):
        if time.monotonic() > deadline:
            raise JobConflict(f"the store at {where} announces no MeCeFO job (another service on that port?); "
                              "check MASTER_ADDR / MASTER_PORT")
        time.sleep(0.05)
    info = json.loads(store.get(JOB_KEY))
    if job_id is not None and info["id"] != job_id:
        raise JobConflict(
            f"the store at {where} belongs to another job (id {info['id']}, hosted by pid {info['pid']} on "
            f"{info['host']}), not to this one (id {job_id}): another job uses this port; choose another "
            "--master-port / MASTER_PORT")
    return info


def attach(host: str, port: int, *, rank: int, incarnation: int, job_id: Optional[str] = None,
           timeout: timedelta = timedelta(seconds=300)) -> Tuple[dist.PrefixStore, str]:
    """Connect rank `rank` (its `incarnation`) to its job's store. Returns (namespaced store, job id).

    Raises:
        JobConflict: the store is another job's, the job already ended (a first start that reached
            a lingering store of an earlier run), or this (rank, incarnation) already started in it.
    """
    where = f"{host}:{port}"
    raw = client(host, port, timeout)
    info = read_job(raw, where, job_id)
    store = job_store(raw, info["id"])
    remedy = (f"the store at {where} is left over from an earlier run (job {info['id']}, store pid {info['pid']} on "
              f"{info['host']}). Wait for it to exit, stop it with `mecefo-store "
              f"--stop --host {host} --port {port}`, or use another MASTER_PORT")
    if job_id is None and incarnation == 0 and (store.check(["job/finished"]) or store.check(["job/failed"])):
        raise JobConflict(f"[rank {rank}] that job has already ended: {remedy}")
    nonce = uuid.uuid4().hex
    if store.compare_set(f"started/{rank}/{incarnation}", "", nonce).decode() != nonce:
        raise JobConflict(f"[rank {rank}] rank {rank} (incarnation {incarnation}) already started in that job: {remedy}")
    return store, info["id"]


def describe_busy_port(host: str, port: int) -> str:
    """Why `port` is taken, for the error message: a lingering MeCeFO store (which job, how to stop
    it) or something else."""
    try:
        raw = client(host, port, timedelta(seconds=5))
        info = read_job(raw, f"{host}:{port}", wait_s=2.0)
    except Exception:
        return (f"port {port} on {host} is in use by another program; choose another --master-port / MASTER_PORT")
    store = job_store(raw, info["id"])
    state = ("finished" if store.check(["job/finished"]) else "gave up" if store.check(["job/failed"])
             else "not finished (its ranks were killed, or it is still running)")
    return (f"port {port} on {host} is held by the store of another MeCeFO job (id {info['id']}, store pid "
            f"{info['pid']} on {info['host']}, started {time.strftime('%H:%M:%S', time.localtime(info['created']))}, "
            f"{state}). If that job is over, stop its store with `mecefo-store "
            f"--stop --host {host} --port {port}` (it also exits on its own once its ranks' heartbeats have stopped "
            "for a minute); otherwise choose another MASTER_PORT / --master-port")


def request_stop(host: str, port: int) -> dict:
    """Ask the store daemon on `port` to exit; returns its job record."""
    raw = client(host, port, timedelta(seconds=10))
    info = read_job(raw, f"{host}:{port}", wait_s=5.0)
    raw.set(STOP_KEY, "1")
    return info


class CountingStore:
    """A store client that counts its calls (`calls`, and `on_call()` per call): what each step
    record's `store_calls` reports, and how tests and benchmarks/control_plane.py measure the control
    plane. `raw` is the client itself, for the torch.distributed APIs that need a real Store."""

    CALLS = frozenset({"set", "get", "add", "check", "compare_set", "wait", "multi_get", "multi_set", "append",
                       "delete_key", "num_keys"})

    def __init__(self, store, on_call=None) -> None:
        self.raw = getattr(store, "raw", store)
        self.calls = 0
        self._on_call = on_call

    def __getattr__(self, name):
        attr = getattr(self.raw, name)
        if name not in self.CALLS:
            return attr

        def call(*args, **kwargs):
            self.calls += 1
            if self._on_call is not None:
                self._on_call()
            return attr(*args, **kwargs)

        return call


class StoreHealth:
    """Whether this rank found the job's store gone: its heartbeat thread (`heartbeat_lost_since`)
    or a store call of its own (`failed`). A lost store ends the job with a checkpoint; this holds
    when it was seen and the message that says so."""

    def __init__(self, address: str, heartbeat_lost_since: Callable[[], Optional[float]], log) -> None:
        self.address = address
        self._heartbeat_lost_since = heartbeat_lost_since
        self._log = log
        self._failed_at: Optional[float] = None

    def failed(self, error: BaseException) -> None:
        """A store call of this rank's failed."""
        if self._failed_at is None:
            self._failed_at = time.time()
            self._log.error("the store did not answer: %s", error)

    def lost_since(self) -> Optional[float]:
        """When this rank found the store gone (time.time()), or None."""
        return self._heartbeat_lost_since() or self._failed_at

    def message(self, step: int, at_commit: bool = True) -> str:
        since = self.lost_since()
        seen = f"since {time.strftime('%H:%M:%S', time.localtime(since))} on this rank" if since else "on another rank"
        ends = f"every member ends before committing step {step}" if at_commit else f"this rank ends at step {step}"
        return (f"the job's store ({self.address}) stopped answering ({seen}): no failure could be absorbed "
                f"any more, so {ends}; restart the job from the checkpoint (and its store: mecefo-launch, or "
                "mecefo-store)")
