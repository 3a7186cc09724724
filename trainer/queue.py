"""The run queue: every launched run waits here until this machine has room for it, first in first out.

A GPU serves one run at a time; CPU runs share `cpu_slots()` ranks (DDPDASH_CPU_SLOTS, default the core
count). A run larger than all the CPU slots starts only when nothing else runs. The queue is rows in the
database (runs.queue_order, runs.admitted_at): it survives any process, and `dispatch` — called by every
launch, by each supervisor as its run ends, by cancel and by reconciliation — admits what fits, under
the queue lock (db.models.QueueLock), so two processes never admit onto the same devices. Runs started
by hand (torchrun without the launcher) are not queued, but their devices and ranks count as used.

    plan(busy, waiting, cpu_slots)   which waiting runs start now, and why each other one waits (pure)
    dispatch(engine)                 admit what fits and start its supervisors; returns the admitted ids
    admit(engine)                    the decision alone (dispatch's first half)
    waiting_states(s)                position and reason of each waiting run of this host (for the pages)
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ddpdash.db.runs import lock_queue
from ddpdash.db.vocab import EventKind, RunStatus

from .config import ConfigInvalid, RunConfig

if TYPE_CHECKING:
    from sqlalchemy import Engine
    from sqlalchemy.orm import Session

    from ddpdash.db.runs import RunInfo

CPU_SLOTS_ENV = "DDPDASH_CPU_SLOTS"


def cpu_slots() -> int:
    """How many CPU ranks may run at once on this machine (all runs together)."""
    raw = os.environ.get(CPU_SLOTS_ENV, "")
    if raw.strip().isdecimal() and int(raw) > 0:
        return int(raw)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


@dataclass(frozen=True)
class Need:
    """What a run takes while it runs: its GPUs, or CPU ranks."""

    run_id: int
    gpus: frozenset[int]
    cpu_ranks: int

    @classmethod
    def of(cls, run: RunInfo) -> Need:
        """From its config's devices; its ranks from the row (a run started by hand may have no config)."""
        try:
            devices = frozenset(RunConfig.from_dict(run.config).devices)
        except ConfigInvalid:
            devices = frozenset()
        return cls(run.id, devices, 0 if devices else run.world_size)


@dataclass(frozen=True)
class Plan:
    admit: tuple[int, ...]
    reasons: dict[int, str]  # why each waiting run that is not admitted waits
    positions: dict[int, int]  # 1 = next in line


def plan(busy: list[Need], waiting: list[Need], slots: int) -> Plan:
    """First in first out, per resource: a waiting run starts when its GPUs (or enough CPU slots) are free and
    no run ahead of it waits for them — so a large run is never overtaken for ever by small ones."""
    gpu_user = {g: n.run_id for n in busy for g in n.gpus}
    cpu_users = [n.run_id for n in busy if n.cpu_ranks]
    cpu_used = sum(n.cpu_ranks for n in busy)
    anything_runs = bool(busy)
    wanted_gpus: dict[int, int] = {}  # GPU -> the first waiting run that wants it
    cpu_waiter: int | None = None  # the first waiting CPU run that does not fit
    admit: list[int] = []
    reasons: dict[int, str] = {}
    for need in waiting:
        if need.gpus:
            taken = sorted(g for g in need.gpus if g in gpu_user)
            ahead = sorted(g for g in need.gpus if g in wanted_gpus)
            if taken:
                reasons[need.run_id] = "; ".join(f"GPU {g} is used by run #{gpu_user[g]}" for g in taken)
            elif ahead:
                reasons[need.run_id] = f"waits behind run #{wanted_gpus[ahead[0]]} for GPU {ahead[0]}"
            else:
                admit.append(need.run_id)
                gpu_user.update({g: need.run_id for g in need.gpus})
                anything_runs = True
                continue
            for g in need.gpus:
                wanted_gpus.setdefault(g, need.run_id)
            continue
        if cpu_waiter is not None:
            reasons[need.run_id] = f"waits behind run #{cpu_waiter} for CPU slots"
            continue
        if need.cpu_ranks > slots:
            if not anything_runs:
                admit.append(need.run_id)
                cpu_used, anything_runs = cpu_used + need.cpu_ranks, True
                cpu_users.append(need.run_id)
                continue
            reasons[need.run_id] = (f"needs {need.cpu_ranks} CPU ranks, more than this machine's {slots} slots: "
                                    "it starts when nothing else runs")
        elif cpu_used + need.cpu_ranks <= slots:
            admit.append(need.run_id)
            cpu_used, anything_runs = cpu_used + need.cpu_ranks, True
            cpu_users.append(need.run_id)
            continue
        else:
            users = ", ".join(f"#{r}" for r in sorted(cpu_users)) or "other runs"
            reasons[need.run_id] = (f"needs {need.cpu_ranks} CPU slot(s); {min(cpu_used, slots)} of {slots} are used "
                                    f"by run(s) {users}")
        cpu_waiter = need.run_id
    positions = {n.run_id: i for i, n in enumerate((n for n in waiting if n.run_id not in admit), start=1)}
    return Plan(tuple(admit), reasons, positions)


# ---- the database side ----------------------------------------------------------------------------------
def _busy_and_waiting(s: Session, host: str) -> tuple[list[RunInfo], list[RunInfo]]:
    from ddpdash.db.runs import list_runs

    active = [r for r in list_runs(s, statuses=RunStatus.ACTIVE) if r.host in (host, "")]
    waiting = sorted((r for r in active if is_waiting(r)), key=lambda r: (r.queue_order, r.id))
    return [r for r in active if not is_waiting(r)], waiting


def is_waiting(run: RunInfo) -> bool:
    """Queued and not yet admitted — and fully queued: enqueue records the run's folder last, after its config and
    environment are written, so a decision taken meanwhile (another run ending) cannot start it half-made."""
    return run.status == RunStatus.QUEUED and run.admitted_at is None and bool(run.run_dir)


def waiting_states(s: Session, host: str | None = None) -> dict[int, tuple[int, str]]:
    """Each waiting run of this host: (its place in line, what it waits for)."""
    busy, waiting = _busy_and_waiting(s, host or socket.gethostname())
    p = plan([Need.of(r) for r in busy], [Need.of(r) for r in waiting], cpu_slots())
    return {r.id: (p.positions.get(r.id, 0), p.reasons.get(r.id, "starting")) for r in waiting}


def dispatch(engine: Engine) -> list[int]:
    """Admit the waiting runs of this host that fit now and start their supervisors."""
    from .control import start_supervisor

    admitted = admit(engine)
    for run_id in admitted:
        start_supervisor(engine, run_id)
    return admitted


def admit(engine: Engine) -> list[int]:
    """The decision alone, under the queue lock: mark the waiting runs that fit now as admitted."""
    from sqlalchemy.orm import Session

    from ddpdash.db.runs import add_event, update_run

    host = socket.gethostname()
    with Session(engine) as s, s.begin():
        lock_queue(s)  # first: every decision below sees what the previous one committed
        busy, waiting = _busy_and_waiting(s, host)
        if not waiting:
            return []
        decided = plan([Need.of(r) for r in busy], [Need.of(r) for r in waiting], cpu_slots())
        now = time.time()
        for run_id in decided.admit:
            update_run(s, run_id, admitted_at=now)
            add_event(s, run_id, EventKind.ADMITTED, "admitted by the queue: its devices are free")
    return list(decided.admit)


def cancel(engine: Engine, run_id: int) -> bool:
    """Take a waiting run out of the queue (status cancelled). False when it is no longer waiting."""
    from sqlalchemy.orm import Session

    from ddpdash.db.runs import add_event, finish_run, get_run

    with Session(engine) as s, s.begin():
        lock_queue(s)
        if not is_waiting(get_run(s, run_id)):
            return False
        finish_run(s, run_id, RunStatus.CANCELLED)
        add_event(s, run_id, EventKind.CANCELLED, "cancelled while queued")
    dispatch(engine)  # a run behind it may fit now
    return True


def move_to_front(engine: Engine, run_id: int) -> bool:
    """Put a waiting run first in line. False when it is no longer waiting."""
    from sqlalchemy.orm import Session

    from ddpdash.db.runs import front_of_queue, get_run, update_run

    with Session(engine) as s, s.begin():
        lock_queue(s)
        if not is_waiting(get_run(s, run_id)):
            return False
        update_run(s, run_id, queue_order=(front_of_queue(s) or time.time()) - 1.0)
    dispatch(engine)
    return True
