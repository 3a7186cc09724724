"""The metrics store's façade: how a rank's batches become rows. Both writers call it — the supervisor's
relay server for the ranks it launched, and a hand-started rank for itself — and nothing else writes
metrics.

    cursor = register_rank(session, run_id, rank, ...)     # the rank's row; a restart discards its future
    cursor = write_batch(connection, cursor, batch, alive_at)   # points, rollups, events, heartbeat, step
    RankWriter(engine, run_id, rank, ...)                  # the same, holding batches the database refused

`write_batch` is a function of the connection, the cursor and the batch: it keeps no state, and returns
the cursor the next batch needs (the rollup buckets still filling, the rank's step). A batch the database
refuses leaves the old cursor valid, so retrying it never counts a point twice.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from sqlalchemy import ClauseElement, Connection, Engine, bindparam, delete, func, insert, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from .chunks import CHUNK_COLUMNS, chunk_rows, discard_after, read_points
from .columns import MAX_BUFFERED_LOGS, Batch, Event, Group, last_step, merge_batches, steps_in
from .models import ROLLUP_WIDTHS, MetricChunk, MetricRollup, RankState, Run, RunEvent
from .rollup import Bucket, roll_up, sorted_by_step
from .vocab import EventKind, RankStatus

log = logging.getLogger(__name__)

ROLLUP_COLUMNS = ("run_id", "name", "width", "rank", "bucket", "step_min", "step_max", "vmin", "vmax", "vsum",
                  "count", "time_max", "vlast")
CLOSE_DEADLINE_S = 180.0  # a rank's last batches wait out a database outage of up to this long
OUTAGE_EVENT_S = 120.0  # an outage longer than this is recorded as an event once the database is back

OpenBuckets = Mapping[str, Mapping[int, Bucket]]  # metric -> width -> its last bucket, still filling


@dataclass(frozen=True)
class RankCursor:
    """What writing one rank's next batch needs to know of the batches before it."""

    run_id: int
    rank: int
    open_buckets: OpenBuckets = field(default_factory=dict)
    step: int = 0  # the last step written: the rank's progress
    status: str = RankStatus.RUNNING
    total_steps: int | None = None  # the run's step count as last written (written once per change)


# ---- the statements of every batch, compiled once (execute_many) ------------------------------
_INSERT_CHUNKS = insert(MetricChunk)
_INSERT_ROLLUPS = insert(MetricRollup)
_DELETE_ROLLUPS_FROM = delete(MetricRollup).where(
    MetricRollup.run_id == bindparam("r"), MetricRollup.rank == bindparam("k"), MetricRollup.name == bindparam("n"),
    MetricRollup.width == bindparam("w"), MetricRollup.bucket >= bindparam("b"),
)
_DELETE_ROLLUPS_PARAMS = ("r", "k", "n", "w", "b")


def _upsert_rollups(dialect_insert: Callable[[type[MetricRollup]], Any]) -> Any:
    statement = dialect_insert(MetricRollup)
    key = [c.name for c in MetricRollup.__table__.primary_key]
    return statement.on_conflict_do_update(
        index_elements=key, set_={c: statement.excluded[c] for c in ROLLUP_COLUMNS if c not in key})


# A batch's rollup rows replace the buckets still filling: in one upsert where the dialect has one (no
# delete statement per metric and width: about a third of the supervisor's database time per batch),
# else by deleting the buckets they rewrite, then inserting.
_UPSERT_ROLLUPS = {"sqlite": _upsert_rollups(sqlite.insert), "postgresql": _upsert_rollups(postgresql.insert)}
_UPDATE_RANK = update(RankState).where(RankState.run_id == bindparam("r"), RankState.rank == bindparam("k")).values(
    status=bindparam("st"), step=bindparam("sp"), heartbeat_at=bindparam("hb"))
_UPDATE_RANK_PARAMS = ("st", "sp", "hb", "r", "k")


# ---- the façade ------------------------------------------------------------------------------
def write_batch(conn: Connection, cursor: RankCursor, batch: Batch, alive_at: float) -> RankCursor:
    """Write one rank's batch in the caller's transaction: its points as chunks, the rollups they touch,
    its events, the run's step count, and the rank's status, step and heartbeat (`alive_at`)."""
    run_id, rank = cursor.run_id, cursor.rank
    rows, rewrite_from, still_open = roll_up_series(run_id, rank, _series(batch.groups), cursor.open_buckets)
    execute_many(conn, _INSERT_CHUNKS, CHUNK_COLUMNS, chunk_rows(run_id, rank, batch.groups))
    upsert = _UPSERT_ROLLUPS.get(conn.dialect.name)
    if upsert is None and rows:
        execute_many(conn, _DELETE_ROLLUPS_FROM, _DELETE_ROLLUPS_PARAMS, [
            (run_id, rank, name, width, bucket) for (name, width), bucket in rewrite_from.items()
        ])
    execute_many(conn, upsert if upsert is not None else _INSERT_ROLLUPS, ROLLUP_COLUMNS, rows)
    if batch.events:
        conn.execute(insert(RunEvent), [
            {"run_id": run_id, "time": e.time, "kind": e.kind, "rank": rank, "message": e.message, "detail": e.detail}
            for e in batch.events
        ])
    total = cursor.total_steps if batch.total_steps is None else batch.total_steps
    if total != cursor.total_steps:
        conn.execute(update(Run).where(Run.id == run_id).values(total_steps=total))
    status = batch.status or cursor.status
    step = last_step(batch.groups)
    step = cursor.step if step is None else step
    execute_many(conn, _UPDATE_RANK, _UPDATE_RANK_PARAMS, [(status, step, alive_at, run_id, rank)])
    return RankCursor(run_id, rank, {**cursor.open_buckets, **still_open}, step, status, total)


def register_rank(s: Session, run_id: int, rank: int, *, device: str, attempt: int, host: str, pid: int,
                  resume_after_step: int | None = None) -> RankCursor:
    """The rank's row (a restarted attempt takes over its previous one), and the cursor its batches
    start from. A restarted attempt repeats the steps after its checkpoint: what the failed attempt
    wrote after `resume_after_step` is discarded, and the rank's rollups rebuilt from what remains."""
    state = {"host": host, "pid": pid, "device": device, "status": RankStatus.RUNNING, "attempt": attempt,
             "heartbeat_at": time.time()}
    exists = s.scalar(select(func.count()).select_from(RankState)
                      .where(RankState.run_id == run_id, RankState.rank == rank))
    if exists:
        s.execute(update(RankState).where(RankState.run_id == run_id, RankState.rank == rank).values(**state))
    else:
        s.execute(insert(RankState), [{"run_id": run_id, "rank": rank, "step": 0, **state}])
    if resume_after_step is None:
        # A rank that wrote before (its supervisor gone, it now writes itself) goes on from its last buckets:
        # an empty cursor would overwrite each of them with the new points alone.
        return RankCursor(run_id, rank, open_buckets_of(s, run_id, rank)) if exists else RankCursor(run_id, rank)
    return discard_after_step(s, RankCursor(run_id, rank), resume_after_step)


def open_buckets_of(s: Session, run_id: int, rank: int) -> dict[str, dict[int, Bucket]]:
    """The rank's newest rollup bucket of each metric and width, as its writer left them."""
    r = MetricRollup
    newest = (select(r.name, r.width, func.max(r.bucket).label("bucket"))
              .where(r.run_id == run_id, r.rank == rank).group_by(r.name, r.width).subquery())
    rows = s.execute(
        select(r.name, r.width, r.bucket, r.step_min, r.step_max, r.vmin, r.vmax, r.vsum, r.count, r.time_max,
               r.vlast)
        .join(newest, (r.name == newest.c.name) & (r.width == newest.c.width) & (r.bucket == newest.c.bucket))
        .where(r.run_id == run_id, r.rank == rank)
    ).all()
    out: dict[str, dict[int, Bucket]] = {}
    for name, width, *bucket in rows:
        out.setdefault(name, {})[int(width)] = Bucket(*bucket)
    return out


def discard_after_step(s: Session, cursor: RankCursor, step: int) -> RankCursor:
    """Drop the rank's points after `step` and rebuild its rollups from the rest: the cursor then fits."""
    run_id, rank = cursor.run_id, cursor.rank
    discard_after(s, run_id, rank, step)
    s.execute(delete(MetricRollup).where(MetricRollup.run_id == run_id, MetricRollup.rank == rank))
    points = read_points(s, run_id, rank=rank)
    rows, _, still_open = roll_up_series(run_id, rank, [
        ((name, ), metric.step, metric.value[np.newaxis, :], metric.time) for name, metric in points.per_metric()
    ], {})
    execute_many(s.connection(), _INSERT_ROLLUPS, ROLLUP_COLUMNS, rows)
    return RankCursor(run_id, rank, still_open, step, cursor.status, cursor.total_steps)


# ---- rollups ---------------------------------------------------------------------------------
# Metrics that share their steps: (names, steps, values as metrics × steps, times).
Series = tuple[tuple[str, ...], np.ndarray, np.ndarray, np.ndarray]


def roll_up_series(run_id: int, rank: int, series: list[Series], open_buckets: OpenBuckets
                   ) -> tuple[list[tuple[object, ...]], dict[tuple[str, int], int], dict[str, dict[int, Bucket]]]:
    """Rollup rows to (re)write, per (metric, width) the first bucket they rewrite, and the buckets left
    open after them."""
    rows: list[tuple[object, ...]] = []
    rewrite_from: dict[tuple[str, int], int] = {}
    still_open: dict[str, dict[int, Bucket]] = {}
    for names, steps, values, times in series:
        steps, values, times = sorted_by_step(steps, values, times)
        rolled = roll_up(steps, values, times, ROLLUP_WIDTHS, [open_buckets.get(name, {}) for name in names])
        for name, buckets in zip(names, rolled, strict=True):
            opened = still_open[name] = dict(open_buckets.get(name, {}))
            for width, bucket in buckets:
                if (name, width) not in rewrite_from:
                    rewrite_from[(name, width)] = bucket.bucket
                opened[width] = bucket  # the last one of its width stays
            rows.extend((run_id, name, width, rank, *bucket) for width, bucket in buckets)
    return rows, rewrite_from, still_open


def _series(groups: list[Group]) -> list[Series]:
    """The groups as numpy series for the rollups: one batch of the usual kind is one series, all its
    metrics rolled up together; otherwise each metric's steps, from every group, make one. Non-finite
    values (a loss gone NaN) stay in the stored points but not in the rollups: a bucket's min, max and
    sum are of numbers."""
    groups = [g for g in groups if g.names and len(g.steps)]
    if len(groups) == 1:
        g = groups[0]
        series = [(g.names, np.frombuffer(g.steps, dtype=np.int64),
                   np.vstack([np.frombuffer(c) for c in g.columns]), np.frombuffer(g.times))]
    else:
        per_name: dict[str, list[tuple[Any, Any, Any]]] = {}
        for g in groups:
            for name, column in zip(g.names, g.columns, strict=True):
                per_name.setdefault(name, []).append((g.steps, column, g.times))
        series = [((name,), np.concatenate([np.frombuffer(s, dtype=np.int64) for s, _, _ in parts]),
                   np.concatenate([np.frombuffer(v) for _, v, _ in parts])[np.newaxis, :],
                   np.concatenate([np.frombuffer(t) for _, _, t in parts]))
                  for name, parts in per_name.items()]
    return [part for one in series for part in _finite(one)]


def _finite(series: Series) -> list[Series]:
    """The series as it is when every value is a number (the usual case: one vectorised check); else each
    metric on its own, with its finite points only."""
    names, steps, values, times = series
    finite = np.isfinite(values)
    if finite.all():
        return [series]
    out = []
    for i, name in enumerate(names):
        keep = finite[i]
        if keep.any():
            out.append(((name,), steps[keep], values[i][keep][np.newaxis, :], times[keep]))
    return out


_DRIVER_SQL: dict[tuple[str, int], tuple[str, bool]] = {}


def execute_many(conn: Connection, statement: ClauseElement, names: tuple[str, ...],
                 rows: Sequence[tuple[object, ...]]) -> None:
    """executemany of plain tuples (values in the order of `names`: the insert's columns, or the
    statement's bind parameters as they appear in it), in the dialect's own SQL and parameter style,
    compiled once per dialect. It skips SQLAlchemy's per-row parameter processing and statement cache
    lookup: bench/executemany.py measures it against `conn.execute(statement, dicts)`."""
    if not rows:
        return
    key = (conn.dialect.name, id(statement))
    if key not in _DRIVER_SQL:
        compiled = statement.compile(dialect=conn.dialect, column_keys=list(names))
        if compiled.positional and list(compiled.positiontup or ()) != list(names):
            raise AssertionError(f"unexpected parameter order {compiled.positiontup}")
        _DRIVER_SQL[key] = (str(compiled), compiled.positional)
    sql, positional = _DRIVER_SQL[key]
    params = rows if positional else [dict(zip(names, r, strict=True)) for r in rows]
    conn.exec_driver_sql(sql, params)  # type: ignore[arg-type]


# ---- one rank's writer -----------------------------------------------------------------------
class RankWriter:
    """Writes one rank's batches, in order, each as it is handed over (`send`); batches the database
    refuses are held (the newest MAX_BUFFERED_LOGS steps) and written with the next. It is the sender
    of a hand-started rank's logger (trainer/metrics.py) and the writer behind each of the supervisor's
    relay connections. Not thread-safe: one caller thread."""

    def __init__(self, engine: Engine, run_id: int, rank: int, *, device: str = "cpu", attempt: int = 0,
                 resume_after_step: int | None = None, host: str | None = None, pid: int | None = None) -> None:
        self.engine = engine
        self.rank = rank
        self.dropped = 0
        self.written_points = 0
        self._held: list[Batch] = []
        self._failing_since: float | None = None
        with Session(engine) as s, s.begin():
            self._cursor = register_rank(s, run_id, rank, device=device, attempt=attempt,
                                         host=host or socket.gethostname(), pid=pid or os.getpid(),
                                         resume_after_step=resume_after_step)

    @property
    def run_id(self) -> int:
        return self._cursor.run_id

    @property
    def written_step(self) -> int:
        """The rank's last step that is in the store."""
        return self._cursor.step

    def send(self, batch: Batch) -> None:
        """Write this batch and any held ones; a refusal is logged and the batches held."""
        try:
            self.write(batch)
        except DBAPIError as exc:
            log.warning("rank %d: writing metrics failed (%s); %d step(s) held for the next write", self.rank,
                        exc, steps_in(g for b in self._held for g in b.groups))

    def write(self, batch: Batch) -> None:
        """Write this batch and any held ones, or raise (DBAPIError) holding them."""
        self._held.append(batch)
        merged = merge_batches(self._held)
        if self._failing_since is not None and time.time() - self._failing_since > OUTAGE_EVENT_S:
            merged = merge_batches([merged, Batch([], [self._outage_event()])])
        try:
            with Session(self.engine) as s, s.begin():
                cursor = self._cursor
                if merged.replace_from is not None:  # a restarted attempt logs these steps again
                    cursor = discard_after_step(s, cursor, merged.replace_from - 1)
                self._cursor = write_batch(s.connection(), cursor, merged, time.time())
        except DBAPIError:
            self._failing_since = self._failing_since or time.time()
            self._trim_held()
            raise
        self._held = []
        self._failing_since = None
        self.written_points += sum(len(g.steps) * len(g.names) for g in merged.groups)

    def flush(self) -> None:
        """Every batch handed over is written (send is synchronous); held ones are tried again."""
        if self._held:
            self.write(Batch([], []))

    def close(self, batch: Batch) -> None:
        """Write the last batch and everything held, retrying a busy database for a while."""
        deadline = time.monotonic() + CLOSE_DEADLINE_S
        while True:
            try:
                self.write(batch)
                return
            except DBAPIError as exc:
                batch = Batch([], [])  # it is held now
                if time.monotonic() > deadline:
                    log.error("rank %d: giving up writing metrics at close: %s", self.rank, exc)
                    return
                time.sleep(0.2)

    def _outage_event(self) -> Event:
        held = steps_in(g for b in self._held for g in b.groups)
        lost = f"; {self.dropped} older step(s) could not be kept" if self.dropped else ""
        return Event(EventKind.DB_OUTAGE, f"rank {self.rank}: the database was unreachable for "
                     f"{time.time() - (self._failing_since or time.time()):.0f} s; {held} step(s) were held and are "
                     f"written now{lost}", "", time.time())

    def _trim_held(self) -> None:
        """A long outage keeps the newest MAX_BUFFERED_LOGS steps, whole batches dropped oldest first."""
        excess = steps_in(g for b in self._held for g in b.groups) - MAX_BUFFERED_LOGS
        while excess > 0 and len(self._held) > 1:
            oldest = self._held.pop(0)
            lost = steps_in(oldest.groups)
            self.dropped += lost
            excess -= lost
            if oldest.events or oldest.status:  # its news still counts
                self._held[0] = merge_batches([Batch([], oldest.events, oldest.status, oldest.total_steps),
                                               self._held[0]])
