"""What the supervisor does once torchrun is running: heartbeats, worker PIDs, stop requests and the
final status (succeeded, failed with the rank and why, or stopped). Runs in the supervisor."""

from __future__ import annotations

import logging
import os
import subprocess
import threading
import time

from sqlalchemy import Engine
from sqlalchemy.orm import Session

from ddpdash.db.runs import add_event, finish_run, get_run, rank_rows, set_rank_status, update_run
from ddpdash.db.vocab import EventKind, RankStatus, RunStatus

from ..config import RunConfig
from ..control import descendants, terminate_run
from ..rundir import RunDir
from .failures import read_failures, root_causes
from .relay_server import RelayServer

log = logging.getLogger(__name__)
POLL_S = 0.2
HEARTBEAT_S = 2.0


def supervise(engine: Engine, run_id: int, run_dir: RunDir, cfg: RunConfig, proc: subprocess.Popen[bytes],
              stop_requested: threading.Event, relay: RelayServer) -> str:
    with Session(engine) as s, s.begin():
        update_run(s, run_id, status=RunStatus.RUNNING, started_at=time.time(), torchrun_pid=proc.pid,
                   supervisor_pid=os.getpid(), heartbeat_at=time.time())
        add_event(s, run_id, EventKind.LAUNCHED, f"torchrun pid {proc.pid}, {cfg.world_size} rank(s)")
    workers: set[int] = set()
    last_beat = 0.0
    while proc.poll() is None:
        if stop_requested.wait(POLL_S):
            killed = terminate_run(proc.pid, sorted(workers | set(descendants(proc.pid))))
            proc.wait()
            relay.drain()  # the ranks' last metrics and statuses, before the run's own
            return _record_stop(engine, run_id, killed)
        now = time.time()
        if now - last_beat >= HEARTBEAT_S or not workers:
            current = set(descendants(proc.pid))
            if current - workers:
                workers |= current
            with Session(engine) as s, s.begin():
                update_run(s, run_id, heartbeat_at=now, worker_pids=sorted(workers))
            last_beat = now
    # torchrun is gone: make sure no worker outlived it.
    leftovers = terminate_run(None, sorted(workers), wait_s=1.0)
    relay.drain()  # every rank has exited: write what they sent before judging the outcome
    if stop_requested.is_set():
        return _record_stop(engine, run_id, leftovers)
    return _record_exit(engine, run_id, run_dir, proc.returncode, leftovers)


def _record_stop(engine: Engine, run_id: int, killed: list[int]) -> str:
    with Session(engine) as s, s.begin():
        _close_ranks(s, run_id, RankStatus.STOPPED)
        if finish_run(s, run_id, RunStatus.STOPPED):
            note = f"; killed {len(killed)} process(es) that ignored SIGTERM" if killed else ""
            add_event(s, run_id, EventKind.STOPPED, f"stopped on request{note}")
    return RunStatus.STOPPED


def _record_exit(engine: Engine, run_id: int, run_dir: RunDir, code: int, leftovers: list[int]) -> str:
    with Session(engine) as s:
        states = rank_rows(s, run_id)
        world = get_run(s, run_id).world_size
    finished = len(states) == world and all(r.status == RankStatus.DONE for r in states)
    with Session(engine) as s, s.begin():
        if code == 0 or finished:
            if code != 0:
                # Training finished on every rank; a worker misbehaved during teardown (NOTES: SIGABRT at exit).
                add_event(s, run_id, EventKind.EXIT_WARNING,
                          f"torchrun exited {code} after every rank finished training")
            finish_run(s, run_id, RunStatus.SUCCEEDED, exit_code=code)
            add_event(s, run_id, EventKind.FINISHED, "all ranks finished")
            return RunStatus.SUCCEEDED
        failures = read_failures(run_dir)
        causes = root_causes(failures)
        ranks = [f.rank for f in causes]
        others = [f for f in failures if f not in causes]
        error = "\n\n".join(
            f"rank {f.rank}: {f.message}\n{f.traceback}\n--- stderr (tail) ---\n{f.stderr_tail}" for f in causes
        ) or f"torchrun exited with code {code} and no rank left an error file; see torchrun.log"
        if others:
            error += "\n\nalso failed as a consequence: " + "; ".join(
                f"rank {f.rank}: {f.message.splitlines()[0][:200] if f.message else '?'}" for f in others)
        _close_ranks(s, run_id, RankStatus.FAILED)
        finish_run(s, run_id, RunStatus.FAILED, exit_code=code, failed_ranks=ranks, error=error)
        summary = f"rank(s) {ranks} failed" if ranks else f"torchrun exited {code}"
        if leftovers:
            summary += f"; killed {len(leftovers)} leftover worker(s)"
        add_event(s, run_id, EventKind.FAILED, summary, rank=ranks[0] if ranks else None, detail=error)
    return RunStatus.FAILED


def _close_ranks(s: Session, run_id: int, status: str) -> None:
    for r in rank_rows(s, run_id):
        if r.status in RankStatus.ACTIVE:
            set_rank_status(s, run_id, r.rank, status)


