"""Query and write functions. They take a Session first, leave the transaction to the caller, and
return plain data (frozen dataclasses, DataFrames), never ORM objects."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from typing import Any

import pandas as pd
from sqlalchemy import Engine, delete, func, insert, literal, select, update
from sqlalchemy.orm import Session

from db.migrate import upgrade
from db.models import ROLLUP_WIDTHS, MetricPoint, MetricRollup, RankState, Run, RunEvent

ACTIVE_STATUSES = ("queued", "running", "stopping")
FINAL_STATUSES = ("succeeded", "failed", "stopped", "lost")
DEFAULT_POINT_BUDGET = 2000


class RunNotFound(LookupError):
    def __init__(self, run_id: int) -> None:
        super().__init__(f"no run with id {run_id}; `ddpdash runs` lists them")
        self.run_id = run_id


def open_store(url: str | None = None) -> Engine:
    """The engine for `url` (default: DDPDASH_DB_URL or $DDPDASH_HOME/ddpdash.db), migrated to the newest schema."""
    from db.engine import make_engine

    engine = make_engine(url)
    upgrade(engine)
    return engine


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

    @property
    def is_active(self) -> bool:
        return self.status in ACTIVE_STATUSES

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
        tags=tuple(t for t in r.tags.split(",") if t), notes=r.notes,
    )


# ---- runs ------------------------------------------------------------------------------------
def create_run(
    s: Session, *, key: str, name: str, config_json: str, world_size: int, run_dir: str = "", host: str = "",
    status: str = "queued",
) -> int:
    return int(s.execute(
        insert(Run).values(
            key=key, name=name, status=status, config_json=config_json, world_size=world_size,
            run_dir=run_dir, host=host, created_at=time.time(),
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
        update(Run).where(Run.id == run_id, Run.status.not_in(FINAL_STATUSES))
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


def delete_run_rows(s: Session, run_id: int) -> None:
    for model in (MetricPoint, MetricRollup, RankState, RunEvent):
        s.execute(delete(model).where(model.run_id == run_id))
    s.execute(delete(Run).where(Run.id == run_id))


# ---- events and rank state -------------------------------------------------------------------
def add_event(s: Session, run_id: int, kind: str, message: str, *, rank: int | None = None, detail: str = "") -> None:
    s.execute(insert(RunEvent).values(run_id=run_id, time=time.time(), kind=kind, rank=rank, message=message,
                                      detail=detail))


def events(s: Session, run_id: int) -> pd.DataFrame:
    rows = s.execute(
        select(RunEvent.time, RunEvent.kind, RunEvent.rank, RunEvent.message, RunEvent.detail)
        .where(RunEvent.run_id == run_id).order_by(RunEvent.time, RunEvent.id)
    ).all()
    return pd.DataFrame(rows, columns=["time", "kind", "rank", "message", "detail"])


def rank_states(s: Session, run_id: int) -> pd.DataFrame:
    rows = s.execute(
        select(RankState.rank, RankState.host, RankState.pid, RankState.device, RankState.status, RankState.step,
               RankState.attempt, RankState.heartbeat_at)
        .where(RankState.run_id == run_id).order_by(RankState.rank)
    ).all()
    return pd.DataFrame(rows, columns=["rank", "host", "pid", "device", "status", "step", "attempt", "heartbeat_at"])


def set_rank_status(s: Session, run_id: int, rank: int, status: str) -> None:
    s.execute(update(RankState).where(RankState.run_id == run_id, RankState.rank == rank).values(status=status))


# ---- metrics ---------------------------------------------------------------------------------
SERIES_COLUMNS = ["rank", "step", "value", "vmin", "vmax", "time", "count"]


def metric_names(s: Session, run_id: int) -> list[str]:
    width = ROLLUP_WIDTHS[-1]
    return list(s.scalars(
        select(MetricRollup.name).where(MetricRollup.run_id == run_id, MetricRollup.width == width)
        .distinct().order_by(MetricRollup.name)
    ))


def step_span(s: Session, run_id: int, name: str) -> tuple[int, int] | None:
    """First and last step of a metric, read from the coarsest rollup (a handful of rows)."""
    lo, hi = s.execute(
        select(func.min(MetricRollup.step_min), func.max(MetricRollup.step_max))
        .where(MetricRollup.run_id == run_id, MetricRollup.name == name, MetricRollup.width == ROLLUP_WIDTHS[-1])
    ).one()
    return None if lo is None else (int(lo), int(hi))


def metric_series(
    s: Session, run_id: int, name: str, *, max_points: int = DEFAULT_POINT_BUDGET, after_step: int = -1
) -> pd.DataFrame:
    """One metric per rank, at most `max_points` per rank, each bucket keeping its min and max.

    `value` is the bucket's mean and `step` its last step; raw points come back unchanged when they fit.
    """
    span = step_span(s, run_id, name)
    if span is None:
        return pd.DataFrame(columns=SERIES_COLUMNS)
    lo = max(span[0], after_step + 1)
    needed = math.ceil((span[1] - lo + 1) / max(max_points - 1, 1))
    if needed <= 1:
        return _raw_points(s, run_id, name, after_step)
    usable = [w for w in ROLLUP_WIDTHS if w <= needed]
    if not usable:
        return _regroup_raw(s, run_id, name, needed, after_step)
    width = usable[-1]
    target = math.ceil(needed / width) * width  # a multiple of width keeps bucket edges aligned
    new_bucket = (MetricRollup.bucket * width) // target
    rows = s.execute(
        select(
            MetricRollup.rank, func.max(MetricRollup.step_max), func.sum(MetricRollup.vsum),
            func.min(MetricRollup.vmin), func.max(MetricRollup.vmax), func.max(MetricRollup.time_max),
            func.sum(MetricRollup.count),
        )
        .where(MetricRollup.run_id == run_id, MetricRollup.name == name, MetricRollup.width == width,
               MetricRollup.step_max > after_step)
        .group_by(MetricRollup.rank, new_bucket)
        .order_by(MetricRollup.rank, new_bucket)
    ).all()
    df = pd.DataFrame(rows, columns=["rank", "step", "vsum", "vmin", "vmax", "time", "count"])
    df.insert(2, "value", df["vsum"] / df["count"])
    return df[SERIES_COLUMNS]


def _raw_points(s: Session, run_id: int, name: str, after_step: int) -> pd.DataFrame:
    rows = s.execute(
        select(MetricPoint.rank, MetricPoint.step, MetricPoint.value, MetricPoint.value, MetricPoint.value,
               MetricPoint.time, literal(1))
        .where(MetricPoint.run_id == run_id, MetricPoint.name == name, MetricPoint.step > after_step)
        .order_by(MetricPoint.rank, MetricPoint.step)
    ).all()
    return pd.DataFrame(rows, columns=SERIES_COLUMNS)


def _regroup_raw(s: Session, run_id: int, name: str, width: int, after_step: int) -> pd.DataFrame:
    bucket = MetricPoint.step // width
    rows = s.execute(
        select(MetricPoint.rank, func.max(MetricPoint.step), func.avg(MetricPoint.value), func.min(MetricPoint.value),
               func.max(MetricPoint.value), func.max(MetricPoint.time), func.count())
        .where(MetricPoint.run_id == run_id, MetricPoint.name == name, MetricPoint.step > after_step)
        .group_by(MetricPoint.rank, bucket).order_by(MetricPoint.rank, bucket)
    ).all()
    return pd.DataFrame(rows, columns=SERIES_COLUMNS)


def all_points(s: Session, run_id: int) -> pd.DataFrame:
    """Every stored point of a run (for export): rank, step, metric, value, time."""
    rows = s.execute(
        select(MetricPoint.rank, MetricPoint.step, MetricPoint.name, MetricPoint.value, MetricPoint.time)
        .where(MetricPoint.run_id == run_id).order_by(MetricPoint.rank, MetricPoint.step, MetricPoint.name)
    ).all()
    return pd.DataFrame(rows, columns=["rank", "step", "metric", "value", "time"])


def count_points(s: Session, run_id: int, name: str | None = None) -> int:
    q = select(func.count()).select_from(MetricPoint).where(MetricPoint.run_id == run_id)
    if name:
        q = q.where(MetricPoint.name == name)
    return int(s.scalar(q) or 0)
