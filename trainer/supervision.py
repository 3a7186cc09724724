"""What the supervisor does once torchrun is running: heartbeats, worker PIDs, stop requests and the
final status (succeeded, failed with the rank and why, or stopped). Entry point: trainer/supervisor.py."""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import threading
import time
from pathlib import Path

from sqlalchemy import Engine
from sqlalchemy.orm import Session

from db.runs import add_event, finish_run, get_run, rank_statuses, set_rank_status, update_run
from trainer.config import RunConfig
from trainer.launcher import descendants, read_failures, root_causes, terminate_run
from trainer.relay_server import RelayServer

log = logging.getLogger("trainer.supervisor")
POLL_S = 0.2
HEARTBEAT_S = 2.0


def yield_cpu_to_training(nice: int) -> None:
    """Lower the supervisor's CPU priority, so that writing the ranks' metrics waits for a free core
    rather than preempt a rank: with DDP, a rank held back holds every rank back at the next
    all-reduce. Call it once torchrun is started (which keeps the workers' priority) and before any
    thread starts (they inherit it).

    Two settings, because Linux weighs one or the other: with autogroups (the default on desktops and
    most servers, for processes outside a CPU cgroup), the scheduler first shares the CPUs between
    sessions, and torchrun gives each worker a session of its own, so the weight of the supervisor's
    session (itself and the torchrun agent) is what counts; otherwise each thread's nice value does.
    `nice`: trainer.launcher.supervisor_nice(). Best effort: where either is refused, it is left as it
    was."""
    for _ in range(3):  # the kernel takes one change of an autogroup per 0.1 s, machine-wide
        try:
            with open("/proc/self/autogroup", "w") as f:
                f.write(str(nice))
            break
        except BlockingIOError:
            time.sleep(0.11)
        except OSError:
            break
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, 0, min(19, os.getpriority(os.PRIO_PROCESS, 0) + nice))


def supervise(engine: Engine, run_id: int, run_dir: Path, cfg: RunConfig, proc: subprocess.Popen[bytes],
              stop_requested: threading.Event, relay: RelayServer) -> str:
    with Session(engine) as s, s.begin():
        update_run(s, run_id, status="running", started_at=time.time(), torchrun_pid=proc.pid,
                   supervisor_pid=os.getpid(), heartbeat_at=time.time())
        add_event(s, run_id, "launched", f"torchrun pid {proc.pid}, {cfg.world_size} rank(s)")
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
        _close_ranks(s, run_id, "stopped")
        if finish_run(s, run_id, "stopped"):
            note = f"; killed {len(killed)} process(es) that ignored SIGTERM" if killed else ""
            add_event(s, run_id, "stopped", f"stopped on request{note}")
    return "stopped"


def _record_exit(engine: Engine, run_id: int, run_dir: Path, code: int, leftovers: list[int]) -> str:
    with Session(engine) as s:
        states = rank_statuses(s, run_id)
        world = get_run(s, run_id).world_size
    finished = len(states) == world and all(r.status == "done" for r in states)
    with Session(engine) as s, s.begin():
        if code == 0 or finished:
            if code != 0:
                # Training finished on every rank; a worker misbehaved during teardown (NOTES: SIGABRT at exit).
                add_event(s, run_id, "exit_warning", f"torchrun exited {code} after every rank finished training")
            finish_run(s, run_id, "succeeded", exit_code=code)
            add_event(s, run_id, "finished", "all ranks finished")
            return "succeeded"
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
        _close_ranks(s, run_id, "failed")
        finish_run(s, run_id, "failed", exit_code=code, failed_ranks=ranks, error=error)
        summary = f"rank(s) {ranks} failed" if ranks else f"torchrun exited {code}"
        if leftovers:
            summary += f"; killed {len(leftovers)} leftover worker(s)"
        add_event(s, run_id, "failed", summary, rank=ranks[0] if ranks else None, detail=error)
    return "failed"


def _close_ranks(s: Session, run_id: int, status: str) -> None:
    for r in rank_statuses(s, run_id):
        if r.status in ("running", "starting"):
            set_rank_status(s, run_id, r.rank, status)


