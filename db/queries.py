"""DataFrame queries for charts, tables and export. They take a Session first, leave the transaction to the caller, and
return plain data (frozen dataclasses, DataFrames), never ORM objects."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
from sqlalchemy import ColumnElement, func, or_, select
from sqlalchemy.orm import Session

from .chunks import read_points
from .models import ROLLUP_WIDTHS, MetricChunk, MetricRollup, RankState, Run, RunEvent
from .retention import raw_kept_from
from .vocab import Metric

DEFAULT_POINT_BUDGET = 1000  # points per line: more than a chart's width in pixels
# A chart whose buckets need at most this many steps regroups the raw points (decoded with numpy);
# wider buckets are read from the finest rollup level that fits (db.models.ROLLUP_WIDTHS).
RAW_REGROUP_MAX_WIDTH = 16


def _frame(rows: Sequence[Sequence[Any]], columns: list[str]) -> pd.DataFrame:
    """DataFrame from result rows, column by column: pandas is ~50× slower on a list of Row objects."""
    if not rows:
        return pd.DataFrame(columns=columns)
    return pd.DataFrame(dict(zip(columns, (list(c) for c in zip(*rows, strict=True)), strict=True)))


def _series_frame(rows: Sequence[Sequence[Any]]) -> pd.DataFrame:
    """The all-numeric series rows through one numpy array (the chart path's hottest conversion)."""
    if not rows:
        return pd.DataFrame(columns=SERIES_COLUMNS)
    df = pd.DataFrame(np.asarray(rows, dtype=np.float64), columns=SERIES_COLUMNS)
    return df.astype({"rank": np.int64, "step": np.int64, "count": np.int64})


# ---- events and rank state -------------------------------------------------------------------
def events(s: Session, run_id: int) -> pd.DataFrame:
    rows = s.execute(
        select(RunEvent.time, RunEvent.kind, RunEvent.rank, RunEvent.message, RunEvent.detail)
        .where(RunEvent.run_id == run_id).order_by(RunEvent.time, RunEvent.id)
    ).all()
    return _frame(rows, ["time", "kind", "rank", "message", "detail"])


def rank_states(s: Session, run_id: int) -> pd.DataFrame:
    rows = s.execute(
        select(RankState.rank, RankState.host, RankState.pid, RankState.device, RankState.status, RankState.step,
               RankState.attempt, RankState.heartbeat_at)
        .where(RankState.run_id == run_id).order_by(RankState.rank)
    ).all()
    return _frame(rows, ["rank", "host", "pid", "device", "status", "step", "attempt", "heartbeat_at"])


# ---- metrics ---------------------------------------------------------------------------------
SERIES_COLUMNS = ["rank", "step", "value", "vmin", "vmax", "time", "count"]


@dataclass(frozen=True)
class StepSpan:
    """A metric's first and last step over its ranks, and which ranks logged it."""

    first: int
    last: int
    ranks: tuple[int, ...]


def step_span(s: Session, run_id: int, name: str) -> StepSpan | None:
    """Read from the coarsest rollup: a handful of rows a rank."""
    r = MetricRollup.__table__.c
    rows = s.execute(
        select(r.rank, func.min(r.step_min), func.max(r.step_max))
        .where(r.run_id == run_id, r.name == name, r.width == ROLLUP_WIDTHS[-1]).group_by(r.rank)
    ).all()
    if not rows:
        return None
    return StepSpan(min(int(row[1]) for row in rows), max(int(row[2]) for row in rows),
                    tuple(int(row[0]) for row in rows))


def metric_series(
    s: Session, run_id: int, name: str, *, max_points: int = DEFAULT_POINT_BUDGET, after_step: int = -1
) -> pd.DataFrame:
    """One metric per rank, at most `max_points` per rank, each bucket keeping its min and max.

    `value` is the bucket's mean and `step` its last step; raw points come back unchanged when they fit.
    The rollup level read is the finest whose buckets fit the budget: an index range scan, no GROUP BY.
    """
    span = step_span(s, run_id, name)
    if span is None:
        return pd.DataFrame(columns=SERIES_COLUMNS)
    lo = max(span.first, after_step + 1)
    needed = math.ceil((span.last - lo + 1) / max(max_points - 1, 1))
    if needed <= RAW_REGROUP_MAX_WIDTH and lo < raw_kept_from(s, run_id):
        needed = ROLLUP_WIDTHS[0]  # the span's raw points were compacted away: its rollups hold it
    if needed <= 1:
        return _raw_points(s, run_id, name, after_step)
    if needed <= RAW_REGROUP_MAX_WIDTH:
        return _regroup_raw(s, run_id, name, needed, after_step)
    width = next((w for w in ROLLUP_WIDTHS if w >= needed), ROLLUP_WIDTHS[-1])
    r = MetricRollup.__table__.c  # Core columns: the ORM's per-row processing costs more than the query
    where = [r.run_id == run_id, r.name == name, r.width == width, r.step_max > after_step]
    if after_step >= 0:
        # A window of a long run: each rank's range of buckets from the key (run, name, width, rank,
        # bucket), not a scan of the level's every bucket (a bucket is step // width).
        where += [r.rank.in_(span.ranks), r.bucket >= (after_step + 1) // width]
    return _series_frame(_plain_rows(s,
        select(r.rank, r.step_max, r.vsum / r.count, r.vmin, r.vmax, r.time_max, r.count)
        .where(*where).order_by(r.rank, r.bucket)
    ))


def _plain_rows(s: Session, stmt: Any) -> list[tuple[Any, ...]]:
    """Plain DBAPI tuples: numpy turns them into an array fast, SQLAlchemy Row objects slowly."""
    result = s.connection().execute(stmt)
    rows = result.cursor.fetchall()
    result.close()
    return rows


def _raw_points(s: Session, run_id: int, name: str, after_step: int) -> pd.DataFrame:
    points = read_points(s, run_id, name=name, after_step=after_step)
    ones = np.ones(len(points.step), dtype=np.int64)
    return pd.DataFrame({"rank": points.rank, "step": points.step, "value": points.value, "vmin": points.value,
                         "vmax": points.value, "time": points.time, "count": ones}, columns=SERIES_COLUMNS)


def _regroup_raw(s: Session, run_id: int, name: str, width: int, after_step: int) -> pd.DataFrame:
    """Buckets of `width` steps from the raw points (for spans too short for the finest rollup), rolled
    up as at ingest: value is the bucket's mean, step its last step. Every rank at once, in numpy."""
    points = read_points(s, run_id, name=name, after_step=after_step)  # ordered by rank, then step
    if not len(points.step):
        return pd.DataFrame(columns=SERIES_COLUMNS)
    bucket = points.step // width
    starts = np.flatnonzero(np.r_[True, (np.diff(points.rank) != 0) | (np.diff(bucket) != 0)])
    ends = np.r_[starts[1:], len(bucket)] - 1
    counts = ends - starts + 1
    return pd.DataFrame({
        "rank": points.rank[starts], "step": points.step[ends],
        "value": np.add.reduceat(points.value, starts) / counts,
        "vmin": np.minimum.reduceat(points.value, starts), "vmax": np.maximum.reduceat(points.value, starts),
        "time": points.time[ends], "count": counts,
    }, columns=SERIES_COLUMNS)


def all_points(s: Session, run_id: int) -> pd.DataFrame:
    """Every stored point of a run (for export): rank, step, metric, value, time."""
    points = read_points(s, run_id)
    order = np.lexsort((points.name.astype(str), points.step, points.rank))
    return pd.DataFrame({"rank": points.rank[order], "step": points.step[order], "metric": points.name[order],
                         "value": points.value[order], "time": points.time[order]})


EXPORT_FORMATS = ("csv", "json")


def export_points(s: Session, run_id: int, fmt: str) -> str:
    """A run's points as CSV or JSON records (rank, step, metric, value, time): the CLI's `export` and the
    Runs page's download both serve this text."""
    points = all_points(s, run_id)
    if fmt == "csv":
        return points.to_csv(index=False)
    if fmt == "json":
        return points.to_json(orient="records") + "\n"
    raise ValueError(f"export format must be one of {', '.join(EXPORT_FORMATS)}, got {fmt!r}")


def count_points(s: Session, run_id: int, name: str | None = None) -> int:
    q = select(func.sum(MetricChunk.count)).where(MetricChunk.run_id == run_id)
    if name:
        q = q.where(MetricChunk.name == name)
    return int(s.scalar(q) or 0)


SHARE_WIDTH = 1024  # the median share is of buckets this wide: a hundred per rank in a run of 100k steps


def run_metric_summaries(s: Session, run_ids: list[int]) -> pd.DataFrame:
    """Per run: final loss (mean over ranks of each rank's last logged value), best loss (lowest value
    any rank logged), mean total samples/s (sum over ranks of each rank's mean) and the median
    communication share (of every rank's SHARE_WIDTH-step bucket means). Reads rollups only."""
    columns = ["run_id", "final_loss", "best_loss", "samples_per_s", "comm_share"]
    if not run_ids:
        return pd.DataFrame(columns=columns)
    coarse = ROLLUP_WIDTHS[-1]
    per_rank = s.execute(
        select(MetricRollup.run_id, MetricRollup.name, MetricRollup.rank, func.min(MetricRollup.vmin),
               func.sum(MetricRollup.vsum), func.sum(MetricRollup.count))
        .where(MetricRollup.run_id.in_(run_ids), MetricRollup.width == coarse,
               MetricRollup.name.in_((Metric.LOSS, Metric.SAMPLES_PER_S)))
        .group_by(MetricRollup.run_id, MetricRollup.name, MetricRollup.rank)
    ).all()
    last_bucket = (
        select(MetricRollup.run_id, MetricRollup.rank, func.max(MetricRollup.bucket).label("bucket"))
        .where(MetricRollup.run_id.in_(run_ids), MetricRollup.width == coarse, MetricRollup.name == Metric.LOSS)
        .group_by(MetricRollup.run_id, MetricRollup.rank).subquery()
    )
    last = s.execute(
        select(MetricRollup.run_id, MetricRollup.vlast)
        .join(last_bucket, (MetricRollup.run_id == last_bucket.c.run_id) & (MetricRollup.rank == last_bucket.c.rank)
              & (MetricRollup.bucket == last_bucket.c.bucket))
        .where(MetricRollup.width == coarse, MetricRollup.name == Metric.LOSS)
    ).all()
    ranks = _frame(per_rank, ["run_id", "name", "rank", "vmin", "vsum", "count"])
    out = pd.DataFrame({"run_id": run_ids}).set_index("run_id")
    loss = ranks[ranks["name"] == Metric.LOSS]
    speed = ranks[ranks["name"] == Metric.SAMPLES_PER_S]
    out["final_loss"] = _frame(last, ["run_id", "v"]).groupby("run_id")["v"].mean()
    out["best_loss"] = loss.groupby("run_id")["vmin"].min()
    out["samples_per_s"] = (speed["vsum"] / speed["count"]).groupby(speed["run_id"]).sum()
    share = _frame(s.execute(
        select(MetricRollup.run_id, MetricRollup.vsum / MetricRollup.count)
        .where(MetricRollup.run_id.in_(run_ids), MetricRollup.width == SHARE_WIDTH,
               MetricRollup.name == Metric.COMM_SHARE)
    ).all(), ["run_id", "v"])
    out["comm_share"] = share.groupby("run_id")["v"].median()
    return out.reset_index()[columns]


# ---- the Runs page: filtered, sorted and paged in SQL -------------------------------------------------------
RUN_SORT_COLUMNS: dict[str, Any] = {
    "id": Run.id, "name": Run.name, "status": Run.status, "world_size": Run.world_size, "model": Run.trains,
    "started": func.coalesce(Run.started_at, Run.created_at), "duration_s": Run.ended_at - Run.started_at,
}


def run_conditions(*, statuses: Sequence[str] = (), trains: Sequence[str] = (), backends: Sequence[str] = (),
                   tag: str = "", text: str = "", sweep: str = "") -> list[ColumnElement[bool]]:
    """The Runs page's filters as SQL conditions (text: a case-insensitive substring of the name or notes)."""
    where: list[ColumnElement[bool]] = []
    if statuses:
        where.append(Run.status.in_(statuses))
    if trains:
        where.append(Run.trains.in_(trains))
    if backends:
        where.append(Run.backend.in_(backends))
    if sweep:
        where.append(Run.sweep == sweep)
    if tag:
        padded = "," + Run.tags + ","
        where.append(padded.contains(f",{tag},", autoescape=True))
    if text:
        needle = text.lower()
        where.append(or_(func.lower(Run.name).contains(needle, autoescape=True),
                         func.lower(Run.notes).contains(needle, autoescape=True)))
    return where


def run_ids_page(s: Session, where: list[ColumnElement[bool]], sort_by: str = "id", descending: bool = True,
                 offset: int = 0, limit: int | None = 50) -> list[int]:
    """The ids of one page of the runs that match, sorted by a column of theirs (all of them: limit None)."""
    column = RUN_SORT_COLUMNS[sort_by]
    order = column.desc() if descending else column.asc()
    query = select(Run.id).where(*where).order_by(order.nulls_last(), Run.id.desc()).offset(offset)
    return list(s.scalars(query.limit(limit) if limit is not None else query))


def count_runs(s: Session, where: Sequence[ColumnElement[bool]] = ()) -> int:
    return int(s.scalar(select(func.count()).select_from(Run).where(*where)) or 0)


def run_filter_options(s: Session) -> dict[str, list[str]]:
    """What the Runs page's filters offer: every value stored (one DISTINCT each, not a read of every run)."""
    def distinct(column: Any) -> list[str]:
        return sorted(v for v in s.scalars(select(column).distinct()) if v)

    tags = sorted({t.strip() for cell in distinct(Run.tags) for t in cell.split(",") if t.strip()})
    return {"trains": distinct(Run.trains), "backends": distinct(Run.backend), "tags": tags,
            "sweeps": sorted(distinct(Run.sweep), reverse=True)}

