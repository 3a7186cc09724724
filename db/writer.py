"""The per-rank metric writer: `log()` is an append; a background thread writes in batches.

Each rank owns its (run, rank) rows, so the writer is their only writer: it keeps the rollup
buckets it is still filling in memory and rewrites just those on each flush.
"""

from __future__ import annotations

import collections
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
from sqlalchemy import ClauseElement, Connection, Engine, bindparam, delete, func, insert, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from db.buffer import MAX_BUFFERED_LOGS, EventRow, LogBuffer, drain
from db.chunks import CHUNK_COLUMNS, chunk_rows, discard_after, read_points
from db.columns import Group, group_logs, last_step, steps_in
from db.models import ROLLUP_WIDTHS, MetricChunk, MetricRollup, RankState, Run, RunEvent
from db.rollup import Bucket, roll_up, sorted_by_step

log = logging.getLogger(__name__)

ROLLUP_COLUMNS = ("run_id", "name", "width", "rank", "bucket", "step_min", "step_max", "vmin", "vmax", "vsum",
                  "count", "time_max", "vlast")
# The statements of every flush, compiled once (execute_many).
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
FLUSH_INTERVAL_S = 1.0
CLOSE_DEADLINE_S = 30.0


# Metrics that share their steps: (names, steps, values as metrics × steps, times).
Series = tuple[tuple[str, ...], np.ndarray, np.ndarray, np.ndarray]


class Rollups(NamedTuple):
    rows: list[tuple[object, ...]]
    rewrite_from: dict[tuple[str, int], int]  # (metric, width) -> the first bucket the rows rewrite
    still_open: dict[str, dict[int, Bucket]]  # metric -> width -> its last bucket, still filling


class MetricWriter(LogBuffer):
    """Buffered writer for one rank of one run. Never raises into, or blocks, the training step."""

    def __init__(
        self,
        engine: Engine,
        run_id: int,
        rank: int,
        *,
        device: str = "cpu",
        attempt: int = 0,
        resume_after_step: int | None = None,
        flush_interval_s: float = FLUSH_INTERVAL_S,
        alive_at: Callable[[], float] = time.time,
        process: tuple[str, int] | None = None,
    ) -> None:
        """When the supervisor writes for a rank (trainer/relay_server.py), `process` is the rank's
        (host, pid) and `alive_at` the time it last heard from it; by default this process, and
        the time of each flush."""
        super().__init__(rank, status="running")
        self.engine = engine
        self.alive_at = alive_at
        self.run_id = run_id
        self.flush_interval_s = flush_interval_s
        self.written_points = 0
        self._open: dict[str, dict[int, Bucket]] = {}  # metric -> width -> the bucket still filling
        self._groups: collections.deque[Group] = collections.deque()  # relayed steps, and any to retry
        self._step = 0  # the last step written: the rank's progress
        self._run_values: dict[str, object] = {}
        self._total_steps: int | None = None
        self._flush_lock = threading.Lock()
        self._register(device, attempt, resume_after_step, process or (socket.gethostname(), os.getpid()))
        self._thread = threading.Thread(target=self._run, name=f"ddpdash-writer-r{rank}", daemon=True)
        self._thread.start()

    def set_total_steps(self, total: int) -> None:
        """Rank 0 tells the run how many steps it will take (for progress and ETA); written once per change."""
        if total != self._total_steps:
            self._total_steps = total
            self._run_values["total_steps"] = total

    def log_groups(self, groups: Sequence[Group]) -> None:
        """Steps a rank relayed, already in columns (trainer/relay_server.py): written as they came,
        never turned into a dict per step."""
        self._groups.extend(groups)

    def flush(self) -> None:
        with self._flush_lock:
            self._flush_once()

    def close(self, status: str | None = None) -> None:
        """Stop the thread and write everything left, retrying a busy database for a while."""
        if not self._halt(status):
            return
        deadline = time.monotonic() + CLOSE_DEADLINE_S
        while True:
            try:
                self.flush()
                return
            except DBAPIError as exc:
                if time.monotonic() > deadline:
                    log.error("rank %d: giving up writing metrics at close: %s", self.rank, exc)
                    return
                time.sleep(0.2)

    # ---- background ------------------------------------------------------------------------
    def _run(self) -> None:
        backoff = self.flush_interval_s
        while True:
            self._wake.wait(backoff)
            self._wake.clear()
            if self._stop.is_set():
                return  # close() writes what is left
            try:
                self.flush()
                backoff = self.flush_interval_s
            except Exception as exc:  # the database may be busy or gone for a while; training goes on
                log.warning("rank %d: metric flush failed (%s); retrying", self.rank, exc)
                backoff = min(backoff * 2, 10.0)

    def _flush_once(self) -> None:
        logs, events = self._take()
        groups = [*drain(self._groups), *group_logs(logs)]
        try:
            self._write(groups, events)
        except Exception:
            self._retry_later(groups, events)
            raise

    def _retry_later(self, groups: list[Group], events: list[EventRow]) -> None:
        """A batch the database refused goes back in front, to be retried; a long outage keeps the newest
        MAX_BUFFERED_LOGS steps, as log() does."""
        self._groups.extendleft(reversed(groups))
        self._put_back_events(events)
        excess = steps_in(self._groups) - MAX_BUFFERED_LOGS
        while excess > 0 and len(self._groups) > 1:
            lost = len(self._groups.popleft()[1])
            self.dropped += lost
            excess -= lost

    def _write(self, groups: list[Group], events: list[EventRow]) -> None:
        run_id, rank = self.run_id, self.rank
        chunks = chunk_rows(run_id, rank, groups)
        rollups = self._roll_up(_series(groups))
        step = last_step(groups)
        alive_at = self.alive_at()
        with self.engine.begin() as conn:
            execute_many(conn, _INSERT_CHUNKS, CHUNK_COLUMNS, chunks)
            upsert = _UPSERT_ROLLUPS.get(conn.dialect.name)
            if upsert is None and rollups.rows:
                execute_many(conn, _DELETE_ROLLUPS_FROM, _DELETE_ROLLUPS_PARAMS, [
                    (run_id, rank, name, width, bucket) for (name, width), bucket in rollups.rewrite_from.items()
                ])
            execute_many(conn, upsert if upsert is not None else _INSERT_ROLLUPS, ROLLUP_COLUMNS, rollups.rows)
            if events:
                conn.execute(insert(RunEvent), [
                    {"run_id": run_id, "time": at, "kind": kind, "rank": rank, "message": message, "detail": detail}
                    for kind, message, detail, at in events
                ])
            if self._run_values:
                conn.execute(update(Run).where(Run.id == run_id).values(**self._run_values))
                self._run_values = {}
            execute_many(conn, _UPDATE_RANK, _UPDATE_RANK_PARAMS,
                         [(self._status, self._step if step is None else step, alive_at, run_id, rank)])
        self._open.update(rollups.still_open)
        self.written_points += sum(len(steps) * len(names) for names, steps, _, _ in groups)
        if step is not None:
            self._step = step

    def _roll_up(self, series: list[Series]) -> Rollups:
        """Rollup rows to (re)write, per (metric, width) the first bucket they rewrite, and the buckets
        left open (kept once the rows are written: a refused batch is rolled up again when retried)."""
        rows: list[tuple[object, ...]] = []
        rewrite_from: dict[tuple[str, int], int] = {}
        still_open: dict[str, dict[int, Bucket]] = {}
        run_id, rank = self.run_id, self.rank
        for names, steps, values, times in series:
            steps, values, times = sorted_by_step(steps, values, times)
            rolled = roll_up(steps, values, times, ROLLUP_WIDTHS, [self._open.get(name, {}) for name in names])
            for name, buckets in zip(names, rolled, strict=True):
                opened = still_open[name] = {}
                for width, bucket in buckets:
                    if width not in opened:
                        rewrite_from[(name, width)] = bucket[0]
                    opened[width] = bucket  # the last one of its width stays
                rows.extend((run_id, name, width, rank, *bucket) for width, bucket in buckets)
        return Rollups(rows, rewrite_from, still_open)

    # ---- start-up --------------------------------------------------------------------------
    def _register(self, device: str, attempt: int, resume_after_step: int | None, process: tuple[str, int]) -> None:
        now = time.time()
        with Session(self.engine) as s, s.begin():
            exists = s.scalar(
                select(func.count()).select_from(RankState)
                .where(RankState.run_id == self.run_id, RankState.rank == self.rank)
            )
            state = {"host": process[0], "pid": process[1], "device": device, "status": "running",
                     "attempt": attempt, "heartbeat_at": now}
            if exists:
                s.execute(
                    update(RankState)
                    .where(RankState.run_id == self.run_id, RankState.rank == self.rank)
                    .values(**state)
                )
            else:
                s.execute(insert(RankState), [{"run_id": self.run_id, "rank": self.rank, "step": 0, **state}])
            if resume_after_step is not None:
                self._discard_after(s, resume_after_step)

    def _discard_after(self, s: Session, step: int) -> None:
        """A restarted attempt repeats the steps after its checkpoint: drop what the failed one wrote."""
        discard_after(s, self.run_id, self.rank, step)
        s.execute(delete(MetricRollup).where(MetricRollup.run_id == self.run_id, MetricRollup.rank == self.rank))
        # Rebuild this rank's rollups from the points that remain, with the same code as ingest.
        points = read_points(s, self.run_id, rank=self.rank)
        rollups = self._roll_up([((name,), metric.step, metric.value[np.newaxis, :], metric.time)
                                 for name, metric in points.per_metric()])
        execute_many(s.connection(), _INSERT_ROLLUPS, ROLLUP_COLUMNS, rollups.rows)
        self._open = rollups.still_open  # the caller's transaction ends before the writer writes again


def _series(groups: list[Group]) -> list[Series]:
    """The groups as numpy series for the rollups: one batch of the usual kind is one series, all its
    metrics rolled up together; otherwise each metric's steps, from every group, make one."""
    groups = [g for g in groups if g[0] and len(g[1])]
    if len(groups) == 1:
        names, steps, times, columns = groups[0]
        return [(names, np.frombuffer(steps, dtype=np.int64), np.vstack([np.frombuffer(c) for c in columns]),
                 np.frombuffer(times))]
    per_name: dict[str, list[tuple[Any, Any, Any]]] = {}
    for names, steps, times, columns in groups:
        for name, column in zip(names, columns, strict=True):
            per_name.setdefault(name, []).append((steps, column, times))
    return [((name,), np.concatenate([np.frombuffer(s, dtype=np.int64) for s, _, _ in parts]),
             np.concatenate([np.frombuffer(v) for _, v, _ in parts])[np.newaxis, :],
             np.concatenate([np.frombuffer(t) for _, _, t in parts]))
            for name, parts in per_name.items()]


_DRIVER_SQL: dict[tuple[str, int], tuple[str, bool]] = {}


def execute_many(conn: Connection, statement: ClauseElement, names: tuple[str, ...],
                 rows: list[tuple[object, ...]]) -> None:
    """executemany of plain tuples (values in the order of `names`: the insert's columns, or the
    statement's bind parameters as they appear in it), in the dialect's own SQL and parameter style,
    compiled once per dialect. It skips SQLAlchemy's per-row parameter processing: ~300k → ~500k
    rows/s on SQLite, and a few hundred µs on each of a batch's small statements."""
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
