"""Watching training processes: report a crash to the job's store at once, restart the rank so it
rejoins, end with the job. Shared by `mecefo-launch` (every rank of a node) and the keeper (one
rank, under a launcher that is not ours).

A rank's process is started with `command` and an environment made per (rank, incarnation); it dies
with its supervisor (Linux PR_SET_PDEATHSIG). The supervisor ends early, restarting nobody, when:
* a rank gives up (exit status 3, or `job/failed` in the store): the others end on their own
  (`give_up_grace` seconds for the checkpoint), hung ranks are killed; it returns 3;
* it receives SIGTERM or SIGINT (a scheduler cancelling the job): every rank gets SIGTERM (SIGKILL
  after `term_grace` s); it returns 128 + the signal number;
* it sees every rank of the job (`whole_job`) and none is left running: a failed rank is not
  restarted into a job with no member;
* a rank exits with status 2 (bad input, found before training): the others get SIGTERM; it
  returns 2.
Otherwise it returns 0 when every rank that ended on its own ended with 0 and at least one did
(ranks killed by a signal, crashes absorbed by MeCeFO, do not count), else the first non-zero code.
A supervisor that does not see the whole job (`await_job`: the keeper, one of many) waits, once its
rank is gone for good, for the job's outcome in the store and returns 0 (finished) or 3 (gave up).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import time
from typing import Callable, Dict, List, Optional, Sequence

from megatron_mecefo.elastic.membership import keys
from megatron_mecefo.errors import GAVE_UP_EXIT_CODE, RETIRED_EXIT_CODE, USAGE_EXIT_CODE

__all__ = ["Rank", "Supervisor"]


def stopped(pid: int) -> bool:
    """Whether `pid` is stopped (SIGSTOP: a hang)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except OSError:
        return False


def describe(code: int) -> str:
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


def die_with_parent(parent: int):
    """preexec_fn: the rank gets SIGKILL when its supervisor dies (Linux PR_SET_PDEATHSIG), so ranks
    never outlive a killed launcher or keeper."""
    def setup():
        try:
            import ctypes

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
        except Exception:  # not Linux: the ranks end when their store connection breaks instead
            return
        if os.getppid() != parent:  # the supervisor died before prctl took effect
            os._exit(1)
    return setup


class Rank:
    """One rank's process across its restarts."""

    def __init__(self, rank: int, local_rank: int = 0, incarnation: int = 0):
        self.rank, self.local_rank = rank, local_rank
        self.proc: Optional[subprocess.Popen] = None
        self.incarnation = incarnation
        self.final: Optional[int] = None
        self.restart_at: Optional[float] = None


class Supervisor:
    """Start, watch and restart `ranks` (see the module docstring).

    Args:
        ranks: the ranks this supervisor owns.
        command: the process to start for a rank.
        env_for: (rank) -> its process environment (rank.incarnation is set).
        client: the job's namespaced store (exits are recorded there; the job's outcome read).
        restart_failed_after: seconds before a failed rank is started again (None: never).
        max_restarts: restarts per rank.
        whole_job: this supervisor sees every rank of the job (a single-node mecefo-launch).
        await_job: once its ranks are gone for good, wait for the job's outcome in the store.
        forker: start ranks by forking a preloaded parent (preload.py) instead of `command`; if
            the parent is gone, ranks are spawned with `command` again.
    """

    def __init__(self, ranks: Sequence[Rank], command: List[str], env_for: Callable[[Rank], Dict[str, str]], client, *,
                 restart_failed_after: Optional[float], max_restarts: int, give_up_grace: float, term_grace: float,
                 whole_job: bool, await_job: bool = False, logger: logging.Logger, forker=None):
        self.ranks, self.command, self.env_for, self.client = list(ranks), command, env_for, client
        self.restart_failed_after, self.max_restarts = restart_failed_after, max_restarts
        self.give_up_grace, self.term_grace = give_up_grace, term_grace
        self.whole_job, self.await_job, self.log = whole_job, await_job, logger
        self.forker = forker
        # why the job ends early, if it does: ("signal", signum), ("gave_up", None), ("no_rank", None), ("usage", None)
        self.ending: list = []
        self.end_deadline: Optional[float] = None
        self.unreachable_since: Optional[float] = None
        self._said_unreachable = False

    # -- the store ---------------------------------------------------------------------------------

    def job_outcome(self) -> Optional[dict]:
        """The store's record of a give-up (`job/failed`), or None."""
        try:
            if self.client.check(["job/failed"]):
                out = json.loads(self.client.get("job/failed"))
                if self.client.check(["job/checkpoint"]):
                    out["checkpoint"] = json.loads(self.client.get("job/checkpoint"))
                return out
        except Exception as e:  # the store is unreachable: the local view decides
            if not self._said_unreachable:  # once: this is polled while the ranks end
                self.log.info("could not read the job's outcome from the store: %s", e)
                self._said_unreachable = True
        return None

    def job_finished(self) -> bool:
        try:
            return bool(self.client.check(["job/finished"]))
        except Exception:
            return False

    def store_reachable(self, now: float, patience_s: float = 60.0) -> bool:
        """False once the store has not answered for patience_s."""
        try:
            self.client.check(["job/finished"])
            self.unreachable_since = None
        except Exception:
            self.unreachable_since = self.unreachable_since or now
        return self.unreachable_since is None or now - self.unreachable_since < patience_s

    def report_exit(self, r: Rank) -> None:
        """Tell the survivors at once (membership/keys.py: its heartbeat marked below 0; a
        replica's rendezvous reads `exited/{rank}/{incarnation}`, which is never cleared)."""
        try:
            keys.mark_exited(self.client, r.rank, r.incarnation)
        except Exception as e:
            self.log.info("could not record the exit of rank %d in the store: %s", r.rank, e)

    # -- processes ---------------------------------------------------------------------------------

    def spawn(self, r: Rank) -> None:
        env = self.env_for(r)
        if self.forker is not None:
            try:
                r.proc = self.forker.fork(env)
                self.log.info("rank %d started (pid %d, incarnation %d, forked from the preloaded parent)",
                              r.rank, r.proc.pid, r.incarnation)
                return
            except Exception as e:  # the parent is gone: spawning still works
                self.log.warning("cannot fork rank %d from the preloaded parent (%s): spawning it", r.rank, e)
                self.forker = None
        r.proc = subprocess.Popen(self.command, env=env, preexec_fn=die_with_parent(os.getpid()))
        self.log.info("rank %d started (pid %d, incarnation %d)", r.rank, r.proc.pid, r.incarnation)

    def terminate_all(self, why: tuple) -> None:
        """End the job now: no restarts, SIGTERM to every running rank (SIGKILL to stopped ones)."""
        self.ending[:] = [why]
        self.end_deadline = time.monotonic() + self.term_grace
        for r in self.ranks:
            r.restart_at = None
            if r.proc is not None and r.proc.poll() is None:
                if stopped(r.proc.pid):
                    r.proc.kill()
                else:
                    r.proc.send_signal(signal.SIGTERM)

    def on_signal(self, signum, _frame) -> None:
        if not self.ending or self.ending[0][0] != "signal":
            self.log.info("received %s: ending every rank, no restarts", signal.Signals(signum).name)
            self.terminate_all(("signal", signum))

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self.on_signal)
        signal.signal(signal.SIGINT, self.on_signal)
        for r in self.ranks:
            self.spawn(r)
        first_error: Optional[int] = None
        ok_exits = 0
        while True:
            now = time.monotonic()
            if not self.ending and self.job_outcome() is not None:
                self.ending[:] = [("gave_up", None)]
            if self.ending and self.end_deadline is None:
                self.end_deadline = now + (self.give_up_grace if self.ending[0][0] == "gave_up" else self.term_grace)
            for r in self.ranks:
                if r.proc is None:
                    if self.ending or self.job_finished():
                        r.restart_at = None
                    if r.restart_at is not None and now >= r.restart_at:
                        r.restart_at = None
                        r.incarnation += 1
                        self.spawn(r)
                    continue
                code = r.proc.poll()
                if code is None:
                    if self.ending and stopped(r.proc.pid):  # a hung rank cannot end on its own
                        self.log.info("rank %d is stopped (hung) and the job is ending: killing it", r.rank)
                        r.proc.kill()
                    continue
                self.log.info("rank %d (pid %d) ended: %s", r.rank, r.proc.pid, describe(code))
                r.proc, r.final = None, code
                if code != 0:
                    self.report_exit(r)
                if code == 0:
                    ok_exits += 1
                    continue
                if code == GAVE_UP_EXIT_CODE and not self.ending:
                    self.ending[:] = [("gave_up", None)]
                if code == USAGE_EXIT_CODE and not self.ending:
                    self.log.info("rank %d found bad input (exit 2): ending the job, no restarts", r.rank)
                    self.terminate_all(("usage", None))
                if code > 0 and code != RETIRED_EXIT_CODE and first_error is None:  # a retired rank is no error
                    first_error = code
                others_running = any(o.proc is not None and o.proc.poll() is None and not stopped(o.proc.pid)
                                     for o in self.ranks if o is not r)
                if self.ending:
                    continue
                if self.restart_failed_after is not None and r.incarnation < self.max_restarts:
                    if others_running or not self.whole_job:
                        r.restart_at = now + self.restart_failed_after
                        self.log.info("rank %d will restart in %.1f s", r.rank, self.restart_failed_after)
                    else:
                        self.log.info("rank %d is not restarted: no rank of the job is left running to rejoin", r.rank)
            live = [r for r in self.ranks if r.proc is not None]
            # every rank crashed or hangs (and none failed on its own: that error is reported as it is)
            if not self.ending and self.whole_job and first_error is None and not any(not stopped(r.proc.pid) for r in live) \
                    and (live or any((r.final or 0) < 0 for r in self.ranks)) and not self.job_finished():
                self.ending[:] = [("no_rank", None)]
                self.log.info("no rank of the job is left running: pending restarts are cancelled")
                try:
                    self.client.compare_set("job/failed", "", json.dumps(
                        {"reason": "no rank of the job is left running (every rank holding the state failed)"}))
                except Exception as e:
                    self.log.info("could not record the outcome in the store: %s", e)
                for r in self.ranks:
                    r.restart_at = None
            # a hung rank cannot end on its own: killed once all others ended (or, for a keeper, the job)
            if live and all(stopped(r.proc.pid) for r in live) and not any(r.restart_at for r in self.ranks) and \
                    (not self.await_job or self.job_finished() or self.job_outcome() is not None):
                for r in live:
                    self.log.info("rank %d is stopped (hung) and all others ended: killing it", r.rank)
                    r.proc.kill()
                    r.proc.wait()
                    r.proc, r.final = None, -signal.SIGKILL
                    self.report_exit(r)
            if self.ending and self.end_deadline is not None and now > self.end_deadline:
                for r in live:
                    if r.proc.poll() is None:
                        self.log.info("rank %d did not end within the grace period: killing it", r.rank)
                        r.proc.kill()
                self.end_deadline = now + 5.0
            if not any(r.proc is not None or r.restart_at is not None for r in self.ranks):
                if not (self.await_job and not self.ending and first_error is None and not ok_exits):
                    break
                # a keeper whose rank is gone for good: the job goes on elsewhere; end with it
                if self.job_finished():
                    return 0
                if self.job_outcome() is not None:
                    self.ending[:] = [("gave_up", None)]
                    break
                if not self.store_reachable(now):
                    self.log.error("the job's store is unreachable: cannot learn how the job ended")
                    return 1
            time.sleep(0.1)
        return self.exit_code(first_error, ok_exits)

    def exit_code(self, first_error: Optional[int], ok_exits: int) -> int:
        if self.ending and self.ending[0][0] == "signal":
            return 128 + self.ending[0][1]
        if self.ending and self.ending[0][0] == "usage":
            return USAGE_EXIT_CODE
        outcome = self.job_outcome()
        if outcome is not None or (self.ending and self.ending[0][0] in ("gave_up", "no_rank")):
            reason = (outcome or {}).get("reason", "a rank exited with status 3")
            ckpt = (outcome or {}).get("checkpoint")
            if ckpt:
                where = f"checkpoint of step {ckpt['step']} at {ckpt['path']}"
            elif outcome is not None:
                where = "no checkpoint was written"
            else:  # the store is lost: the ranks' own messages name the checkpoint
                where = "the store did not say whether a checkpoint was written (see the ranks' messages above)"
            self.log.error("the job gave up: %s; %s", reason, where)
            return GAVE_UP_EXIT_CODE
        if first_error is not None:
            return first_error
        return 0 if ok_exits else 1
