"""Run rows, events and rank states: plain writes and reads with no pandas, so the trainer and the
supervisor start fast. Functions take a Session first and leave the transaction to the caller."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete, func, insert, select, update
from sqlalchemy.orm import Session

from .models import MetricChunk, MetricRollup, QueueLock, RankState, Run, RunEvent
from .vocab import RunStatus


class RunNotFound(LookupError):
    def __init__(self, run_id: int) -> None:
        super().__init__(f"no run with id {run_id}; `ddpdash runs` lists them")
        self.run_id = run_id


@dataclass(frozen=True)
class RunInfo:
    id: int
    key: str
    name: str
    status: str
    config: dict[str, Any]
    world_size: int
    run_dir: str
    host: str
    created_at: float
    started_at: float | None
    ended_at: float | None
    heartbeat_at: float | None
    total_steps: int | None
    supervisor_pid: int | None
    torchrun_pid: int | None
    worker_pids: tuple[int, ...]
    exit_code: int | None
    failed_ranks: tuple[int, ...]
    error: str
    tags: tuple[str, ...]
    notes: str
    queue_order: float = 0.0
    admitted_at: float | None = None
    sweep: str = ""
    group_name: str = ""
    job_id: str = ""  # its Slurm job, for a Slurm run
    job_state: str = ""

    @property
    def is_active(self) -> bool:
        return self.status in RunStatus.ACTIVE

    @property
    def job_line(self) -> str:
        """A Slurm run's job in words, "" for a local run: "Slurm job 12 · PENDING (Resources)" or
        "… · RUNNING on node[1-2]" (Live, the Runs page and `ddpdash show` say it alike)."""
        if not self.job_id:
            return ""
        return f"Slurm job {self.job_id} · {self.job_state or 'state not read yet'}"

    @property
    def duration_s(self) -> float | None:
        if self.started_at is None:
            return None
        return (self.ended_at or time.time()) - self.started_at


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def _info(r: Run) -> RunInfo:
    return RunInfo(
        id=r.id, key=r.key, name=r.name, status=r.status, config=json.loads(r.config_json),
        world_size=r.world_size, run_dir=r.run_dir, host=r.host, created_at=r.created_at,
        started_at=r.started_at, ended_at=r.ended_at, heartbeat_at=r.heartbeat_at, total_steps=r.total_steps,
        supervisor_pid=r.supervisor_pid, torchrun_pid=r.torchrun_pid, worker_pids=_ints(r.worker_pids),
        exit_code=r.exit_code, failed_ranks=_ints(r.failed_ranks), error=r.error,
        tags=tuple(t for t in r.tags.split(",") if t), notes=r.notes, queue_order=r.queue_order,
        admitted_at=r.admitted_at, sweep=r.sweep, group_name=r.group_name, job_id=r.job_id, job_state=r.job_state,
    )


def create_run(
    s: Session, *, key: str, name: str, config_json: str, world_size: int, run_dir: str = "", host: str = "",
    status: str = RunStatus.QUEUED, sweep: str = "", group_name: str = "", admitted: bool = True,
    trains: str = "", backend: str = "",
) -> int:
    """A new run. A launched run is created waiting (`admitted=False`) and the queue admits it; a run
    registered by its own ranks is running already, outside the queue."""
    now = time.time()
    return int(s.execute(
        insert(Run).values(
            key=key, name=name, status=status, config_json=config_json, world_size=world_size,
            run_dir=run_dir, host=host, created_at=now, queue_order=now, admitted_at=now if admitted else None,
            sweep=sweep, group_name=group_name, trains=trains[:200], backend=backend[:20],
        ).returning(Run.id)
    ).scalar_one())


def find_run_by_key(s: Session, key: str) -> int | None:
    return s.scalar(select(Run.id).where(Run.key == key))


def get_run(s: Session, run_id: int) -> RunInfo:
    r = s.get(Run, run_id)
    if r is None:
        raise RunNotFound(run_id)
    return _info(r)


def _columns(values: dict[str, Any]) -> dict[str, Any]:
    """Lists of PIDs, ranks and tags are stored as comma-separated text."""
    out = dict(values)
    for name in ("worker_pids", "failed_ranks"):
        if name in out and not isinstance(out[name], str):
            out[name] = ",".join(str(v) for v in out[name])
    if "tags" in out and not isinstance(out["tags"], str):
        out["tags"] = ",".join(clean_tags(out["tags"]))
    return out


def update_run(s: Session, run_id: int, **values: Any) -> None:
    s.execute(update(Run).where(Run.id == run_id).values(**_columns(values)))


def finish_run(s: Session, run_id: int, status: str, **values: Any) -> bool:
    """Set a final status unless one is already set (the first writer of the truth wins)."""
    values.setdefault("ended_at", time.time())
    result = s.execute(
        update(Run).where(Run.id == run_id, Run.status.not_in(RunStatus.FINAL))
        .values(status=status, **_columns(values))
    )
    return bool(result.rowcount)


def clean_tags(tags: Any) -> list[str]:
    out: list[str] = []
    for tag in tags:
        t = str(tag).strip().replace(",", " ")
        if t and t not in out:
            out.append(t[:50])
    return out


def list_runs(s: Session, *, statuses: tuple[str, ...] | None = None, limit: int | None = None) -> list[RunInfo]:
    q = select(Run).order_by(Run.id.desc())
    if statuses:
        q = q.where(Run.status.in_(statuses))
    if limit:
        q = q.limit(limit)
    return [_info(r) for r in s.execute(q).scalars()]


# ---- the queue's rows (trainer/queue.py decides) ---------------------------------------------------------
def lock_queue(s: Session) -> None:
    """First in a queue decision's transaction: holds the queue lock row until it commits."""
    s.execute(update(QueueLock).where(QueueLock.id == 1).values(decisions=QueueLock.decisions + 1))


def front_of_queue(s: Session) -> float | None:
    """The queue_order of the first waiting run."""
    return s.scalar(select(func.min(Run.queue_order)).where(Run.status == RunStatus.QUEUED,
                                                            Run.admitted_at.is_(None)))


def list_sweeps(s: Session) -> list[str]:
    """Sweep names, newest first."""
    rows = s.execute(select(Run.sweep, func.max(Run.id)).where(Run.sweep != "").group_by(Run.sweep)
                     .order_by(func.max(Run.id).desc()))
    return [name for name, _ in rows]


def sweep_run_ids(s: Session, sweep: str) -> list[int]:
    return list(s.scalars(select(Run.id).where(Run.sweep == sweep).order_by(Run.id)))


def delete_run_rows(s: Session, run_id: int) -> None:
    for model in (MetricChunk, MetricRollup, RankState, RunEvent):
        s.execute(delete(model).where(model.run_id == run_id))
    s.execute(delete(Run).where(Run.id == run_id))


def add_event(s: Session, run_id: int, kind: str, message: str, *, rank: int | None = None, detail: str = "") -> None:
    s.execute(insert(RunEvent).values(run_id=run_id, time=time.time(), kind=kind, rank=rank, message=message,
                                      detail=detail))


@dataclass(frozen=True)
class EventRow:
    time: float
    kind: str
    rank: int | None
    message: str
    detail: str


def events_of_kind(s: Session, run_id: int, kind: str) -> list[EventRow]:
    rows = s.execute(select(RunEvent.time, RunEvent.kind, RunEvent.rank, RunEvent.message, RunEvent.detail)
                     .where(RunEvent.run_id == run_id, RunEvent.kind == kind).order_by(RunEvent.time, RunEvent.id))
    return [EventRow(*row) for row in rows]


def events_after(s: Session, run_id: int, after_id: int, kinds: tuple[str, ...]) -> list[tuple[int, EventRow]]:
    """The run's events of `kinds` newer than event id `after_id`, oldest first, with their ids."""
    rows = s.execute(select(RunEvent.id, RunEvent.time, RunEvent.kind, RunEvent.rank, RunEvent.message,
                            RunEvent.detail)
                     .where(RunEvent.run_id == run_id, RunEvent.id > after_id, RunEvent.kind.in_(kinds))
                     .order_by(RunEvent.id))
    return [(row[0], EventRow(*row[1:])) for row in rows]


def set_rank_status(s: Session, run_id: int, rank: int, status: str) -> None:
    s.execute(update(RankState).where(RankState.run_id == run_id, RankState.rank == rank).values(status=status))


@dataclass(frozen=True)
class RankRow:
    rank: int
    status: str
    step: int
    heartbeat_at: float


def rank_rows(s: Session, run_id: int) -> list[RankRow]:
    rows = s.execute(
        select(RankState.rank, RankState.status, RankState.step, RankState.heartbeat_at)
        .where(RankState.run_id == run_id).order_by(RankState.rank)
    ).all()
    return [RankRow(*row) for row in rows]
