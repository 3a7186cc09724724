"""What the supervisor does once torchrun is running: heartbeats, worker PIDs, stop requests and the
final status (succeeded, failed with the rank and why, or stopped). Runs in the supervisor."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import psutil
from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from ddpdash.db.runs import (
    add_event,
    events_of_kind,
    finish_run,
    get_run,
    rank_rows,
    set_rank_status,
    update_run,
)
from ddpdash.db.vocab import EventKind, RankStatus, RunStatus

from ..config import RunConfig
from ..control import descendants, terminate_run, wait_until_final
from ..rundir import RunDir, tail
from .failures import RankFailure, blame, exited_ranks, flight_recorder_finding, root_causes
from .node import SlurmNode
from .relay_server import RelayServer

log = logging.getLogger(__name__)
POLL_S = 0.2
HEARTBEAT_S = 2.0
# How long the supervisor waits out an unreachable database to record what it must (the start, the
# outcome): training never waits for it, and the ranks' metrics are held meanwhile (db.store.RankWriter).
OUTAGE_PATIENCE_S = 600.0
T = TypeVar("T")


def patiently(what: str, action: Callable[[], T], patience_s: float = OUTAGE_PATIENCE_S) -> T:
    """`action()`, retried while the database refuses it (locked, restarting, unreachable, read-only)."""
    deadline = time.monotonic() + patience_s
    wait = 0.5
    while True:
        try:
            return action()
        except DBAPIError as exc:
            if time.monotonic() > deadline:
                raise
            log.warning("could not record %s yet (%s); retrying in %.0f s", what, exc, wait)
            time.sleep(wait)
            wait = min(wait * 2, 10.0)


def supervise(engine: Engine, run_id: int, run_dir: RunDir, cfg: RunConfig, proc: subprocess.Popen[bytes],
              stop_requested: threading.Event, relay: RelayServer, node: SlurmNode | None = None) -> str:
    """Watch torchrun until it ends and record the outcome; for a Slurm `node`, that node's part of it."""
    # A run's PIDs are its one machine's: of a Slurm job's, the first node's are kept (the others' are Slurm's).
    keeps_pids = node is None or node.index == 0

    def record_start() -> None:
        with Session(engine) as s, s.begin():
            pids = {"torchrun_pid": proc.pid, "supervisor_pid": os.getpid()} if keeps_pids else {}
            update_run(s, run_id, status=RunStatus.RUNNING, started_at=time.time(), heartbeat_at=time.time(), **pids)
            where = "" if node is None else f"node {node.index} ({socket.gethostname()}): "
            add_event(s, run_id, EventKind.LAUNCHED,
                      f"{where}torchrun pid {proc.pid}, {cfg.ranks_per_node} of {cfg.world_size} rank(s)")

    patiently("the start", record_start)
    workers: set[int] = set()
    frozen = FrozenRanks(proc.pid, cfg.pg_timeout_s)
    last_beat = 0.0
    while proc.poll() is None:
        if stop_requested.wait(POLL_S):
            killed = terminate_run(proc.pid, sorted(workers | set(descendants(proc.pid))))
            proc.wait()
            relay.drain()  # the ranks' last metrics and statuses, before the run's own
            if node is not None and not _stop_asked(engine, run_id):
                return _ended_by_slurm(engine, run_id, node)
            return patiently("the stop", functools.partial(_record_stop, engine, run_id, killed))
        now = time.time()
        if now - last_beat >= HEARTBEAT_S or not workers:
            workers |= set(descendants(proc.pid))
            frozen.check(now)
            promote_checkpoint(run_dir, relay.written_steps(), cfg.world_size)
            _beat(engine, run_id, now, workers if keeps_pids else None)
            last_beat = now
    # torchrun is gone: make sure no worker outlived it.
    leftovers = terminate_run(None, sorted(workers), wait_s=1.0)
    relay.drain()  # every rank has exited: write what they sent before judging the outcome
    promote_checkpoint(run_dir, relay.written_steps(), cfg.world_size)
    if stop_requested.is_set():
        if node is not None and not _stop_asked(engine, run_id):
            return _ended_by_slurm(engine, run_id, node)
        return patiently("the stop", lambda: _record_stop(engine, run_id, leftovers))
    return patiently("the outcome",
                     lambda: _record_exit(engine, run_id, run_dir, proc.returncode, leftovers, frozen.stopped, node))


CAUSE_PATIENCE_S = 5.0


def _recorded_elsewhere(engine: Engine, run_id: int, patience_s: float = CAUSE_PATIENCE_S) -> bool:
    """Whether another node records the run's outcome within `patience_s`: this node's ranks only lost
    their peers, and the node whose rank failed first-hand names the cause better."""
    return wait_until_final(engine, run_id, patience_s)


def _stop_asked(engine: Engine, run_id: int) -> bool:
    """Whether ddpdash asked this run to stop (control.stop marks it first) — else a SIGTERM to a Slurm
    node came from Slurm itself: the time limit, or an scancel by hand."""
    with Session(engine) as s:
        return get_run(s, run_id).status == RunStatus.STOPPING


def _ended_by_slurm(engine: Engine, run_id: int, node: SlurmNode) -> str:
    """Slurm ended the job (its state says why: TIMEOUT, CANCELLED): reconciliation records the outcome
    from it; the node says what it saw."""
    def record() -> None:
        with Session(engine) as s, s.begin():
            add_event(s, run_id, EventKind.STOP, f"node {node.index}: Slurm ended job {node.job_id} (SIGTERM); "
                                                 "its state gives the run's outcome")
    patiently("the end", record)
    return RunStatus.STOPPING


class FrozenRanks:
    """Ranks whose process is stopped (state T: SIGSTOP, a debugger's stop): the others wait for them in
    their next collective until the process-group timeout, and torchrun cannot end a stopped process
    with SIGTERM. A rank stopped that long is killed, so the run fails in time; a rank stopped when the
    run fails is the one blamed (`stopped`: rank -> seconds)."""

    def __init__(self, torchrun_pid: int, pg_timeout_s: float) -> None:
        self.torchrun_pid = torchrun_pid
        self.pg_timeout_s = pg_timeout_s
        self.since: dict[int, float] = {}  # pid -> when first seen stopped
        self.stopped: dict[int, float] = {}  # rank -> how long it has been stopped (or was, until killed)

    def check(self, now: float) -> None:
        for child in _ranks_of(self.torchrun_pid):
            try:
                is_stopped = child.status() == psutil.STATUS_STOPPED
            except psutil.Error:
                continue
            rank = _rank_of(child)
            if not is_stopped:
                self.since.pop(child.pid, None)
                if rank is not None:
                    self.stopped.pop(rank, None)
                continue
            since = self.since.setdefault(child.pid, now)
            if rank is not None:
                self.stopped[rank] = now - since
            if now - since >= self.pg_timeout_s:
                log.warning("rank %s (pid %d) stopped for %.0f s: killing it", rank, child.pid, now - since)
                with contextlib.suppress(psutil.Error):
                    child.kill()


def _ranks_of(torchrun_pid: int) -> list[psutil.Process]:
    """torchrun's direct children: one process per rank (DataLoader workers are theirs, not torchrun's)."""
    try:
        return psutil.Process(torchrun_pid).children()
    except psutil.Error:
        return []


def _rank_of(process: psutil.Process) -> int | None:
    try:
        raw = process.environ().get("RANK", "")
    except psutil.Error:
        return None
    return int(raw) if raw.isdigit() else None


_PROMOTING = threading.Lock()  # the watch loop and the relay's connection threads both promote


def promote_checkpoint(run_dir: RunDir, written: dict[int, int], world_size: int) -> int | None:
    """Make the newest pending checkpoint whose step every rank's stored metrics have reached the one a
    restart resumes from (older pending ones go). Returns its step, None when none qualifies."""
    if len(written) < world_size:
        return None
    reached = min(written.values())
    with _PROMOTING:
        ready = [(step, path) for step, path in run_dir.pending_checkpoints() if step <= reached]
        if not ready:
            return None
        step, path = ready[-1]
        try:
            os.replace(path, run_dir.checkpoint)  # atomic: a restart reads the old or the new one, whole
        except FileNotFoundError:
            return None  # a restarted rank 0 cleared it: it was the failed attempt's
        for _, older in ready[:-1]:
            older.unlink(missing_ok=True)
    return step


def _beat(engine: Engine, run_id: int, now: float, workers: set[int] | None) -> None:
    """The run's heartbeat and its workers' PIDs (None: this node's are not the run's); a database that
    refuses it is tried again at the next beat (a short outage must not end a healthy run)."""
    try:
        with Session(engine) as s, s.begin():
            update_run(s, run_id, heartbeat_at=now, **({} if workers is None else {"worker_pids": sorted(workers)}))
    except DBAPIError as exc:
        log.warning("heartbeat not recorded (%s); training goes on", exc)


def _record_stop(engine: Engine, run_id: int, killed: list[int]) -> str:
    with Session(engine) as s, s.begin():
        _close_ranks(s, run_id, RankStatus.STOPPED)
        if finish_run(s, run_id, RunStatus.STOPPED):
            note = f"; killed {len(killed)} process(es) that ignored SIGTERM" if killed else ""
            add_event(s, run_id, EventKind.STOPPED, f"stopped on request{note}")
    return RunStatus.STOPPED


def _record_exit(engine: Engine, run_id: int, run_dir: RunDir, code: int, leftovers: list[int],
                 frozen: dict[int, float], node: SlurmNode | None = None) -> str:
    with Session(engine) as s:
        states = rank_rows(s, run_id)
        world = get_run(s, run_id).world_size
    finished = len(states) == world and all(r.status == RankStatus.DONE for r in states)
    with Session(engine) as s, s.begin():
        if code == 0 and not finished and node is not None and node.count > 1:
            # This node is done; another's ranks are not yet: the last node to finish records the outcome
            # (each node's ranks are stored before it looks, so the later of two always sees both).
            add_event(s, run_id, EventKind.NODE_DONE, f"node {node.index}: its ranks finished")
            return RunStatus.RUNNING
        if code == 0 or finished:
            if code != 0:
                # Training finished on every rank; a worker misbehaved during teardown (NOTES: SIGABRT at exit).
                add_event(s, run_id, EventKind.EXIT_WARNING,
                          f"torchrun exited {code} after every rank finished training")
            finish_run(s, run_id, RunStatus.SUCCEEDED, exit_code=code)
            add_event(s, run_id, EventKind.FINISHED, "all ranks finished")
            return RunStatus.SUCCEEDED
        causes, others = blame(run_dir, frozen)
        if not causes:  # no error file (mpirun, or a rank without @record): what the ranks said themselves
            causes = failures_from_events(s, run_id, run_dir) or root_causes(exited_ranks(run_dir))
        # This node's ranks only lost their peers: the node where it began names the cause, if it records
        # in time (nothing is written in this transaction yet; multi-node runs are on PostgreSQL, where
        # waiting in a read blocks no one).
        lost_peers_only = node is not None and node.count > 1 and all(f.is_consequence for f in causes)
        if lost_peers_only and _recorded_elsewhere(engine, run_id):
            return RunStatus.FAILED
        ranks = [f.rank for f in causes]
        error = "\n\n".join(
            f"rank {f.rank}: {f.message}\n{f.traceback}\n--- stderr (tail) ---\n{f.stderr_tail}" for f in causes
        ) or f"torchrun exited with code {code} and no rank left an error file; see torchrun.log"
        if others:
            error += "\n\nalso failed as a consequence: " + "; ".join(
                f"rank {f.rank}: {f.message.splitlines()[0][:200] if f.message else '?'}" for f in others)
        finding = flight_recorder_finding(run_dir, world)
        if finding:
            error += f"\n\nFlight Recorder: {finding}"
        _close_ranks(s, run_id, RankStatus.FAILED)
        if not finish_run(s, run_id, RunStatus.FAILED, exit_code=code, failed_ranks=ranks, error=error):
            return RunStatus.FAILED  # another node recorded the failure first: the first cause stands
        summary = f"rank(s) {ranks} failed" if ranks else f"torchrun exited {code}"
        if leftovers:
            summary += f"; killed {len(leftovers)} leftover worker(s)"
        add_event(s, run_id, EventKind.FAILED, summary, rank=ranks[0] if ranks else None, detail=error)
    return RunStatus.FAILED


def failures_from_events(s: Session, run_id: int, run_dir: RunDir) -> list[RankFailure]:
    """The ranks' own `rank_failed` events (message and traceback), first-hand failures first."""
    reported = []
    for e in events_of_kind(s, run_id, EventKind.RANK_FAILED):
        if e.rank is None:
            continue
        log = RunDir(run_dir.path).rank_log(e.rank)  # the run's folder: the rank may be another node's
        reported.append(RankFailure(e.rank, e.message, e.detail, tail(log, 40) if log else "", e.time))
    return root_causes(reported)


def _close_ranks(s: Session, run_id: int, status: str) -> None:
    for r in rank_rows(s, run_id):
        if r.status in RankStatus.ACTIVE:
            set_rank_status(s, run_id, r.rank, status)


