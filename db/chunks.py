"""Raw points as chunks: one `metric_chunks` row per metric of each group a writer writes (db/columns.py),
its steps, values and times as packed arrays. Rows are built from the groups' arrays as they are (no
row per point) and read back with numpy (no Python object per point).

Steps that run one by one (step_min, step_min + 1, …, step_max: a rank that logs every step) are not
stored at all: an empty `step_data` means `step_min` to `step_max`. A point then takes 16 bytes, its
value and its time; other steps (log_every > 1, a restart's overlap) are stored as they are."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np
from sqlalchemy import delete, func, select, update
from sqlalchemy.orm import Session

from .columns import Group
from .models import MetricChunk

# Stored little-endian whatever the host, so that every machine of a multi-node run reads every row.
STEP_DTYPE = np.dtype("<i8")
FLOAT_DTYPE = np.dtype("<f8")
CHUNK_COLUMNS = ("run_id", "rank", "name", "step_min", "step_max", "count", "step_data", "value_data", "time_data")


class Points(NamedTuple):
    """Points as parallel arrays, ordered by rank, then step (ties in the order they were written)."""

    rank: np.ndarray
    name: np.ndarray  # of str
    step: np.ndarray
    value: np.ndarray
    time: np.ndarray

    def where(self, keep: np.ndarray) -> Points:
        return Points(*(column[keep] for column in self))

    def per_metric(self) -> list[tuple[str, Points]]:
        """Each metric's points, the metrics in the order they first appear."""
        return [(name, self.where(self.name == name)) for name in dict.fromkeys(self.name.tolist())]


def chunk_rows(run_id: int, rank: int, groups: Iterable[Group]) -> list[tuple[object, ...]]:
    """The rows (in CHUNK_COLUMNS order) of these groups: one per metric of each group."""
    rows: list[tuple[object, ...]] = []
    for names, steps, times, columns in groups:
        if not names or not steps:
            continue
        lo, hi = min(steps), max(steps)
        step_data, time_data = _step_data(steps, lo, hi), _packed(times, FLOAT_DTYPE)
        rows.extend((run_id, rank, name, lo, hi, len(steps), step_data, _packed(column, FLOAT_DTYPE), time_data)
                    for name, column in zip(names, columns, strict=True))
    return rows


def encode(steps: np.ndarray, values: np.ndarray, times: np.ndarray) -> dict[str, Any]:
    """The packed columns of one chunk, from numpy arrays."""
    lo, hi = int(steps.min()), int(steps.max())
    return {"step_min": lo, "step_max": hi, "count": len(steps), "step_data": _step_data(steps, lo, hi),
            "value_data": _packed(values, FLOAT_DTYPE), "time_data": _packed(times, FLOAT_DTYPE)}


def _step_data(steps: Any, lo: int, hi: int) -> bytes:
    """The packed steps, or nothing when they are lo, lo + 1, …, hi in order (the usual case)."""
    if hi - lo + 1 == len(steps):
        as_array = np.frombuffer(steps, dtype=np.int64) if not isinstance(steps, np.ndarray) else steps
        if len(as_array) < 2 or bool(np.all(np.diff(as_array) == 1)):
            return b""
    return _packed(steps, STEP_DTYPE)


def chunk_steps(step_min: int, count: int, step_data: Any) -> np.ndarray:
    """A chunk's steps: unpacked, or step_min onwards when they were left out (consecutive)."""
    if len(step_data):
        return np.frombuffer(step_data, dtype=STEP_DTYPE)
    return np.arange(step_min, step_min + count, dtype=np.int64)


def decode(rows: Sequence[Sequence[Any]]) -> Points:
    """Points from (rank, name, step_min, count, step_data, value_data, time_data) rows (bytes, or the
    memoryview some PostgreSQL drivers return), in row order, then sorted by rank and step."""
    if not rows:
        empty = np.empty(0, dtype=np.int64)
        return Points(empty, np.empty(0, dtype=object), empty, np.empty(0), np.empty(0))
    steps = [chunk_steps(row[2], row[3], row[4]) for row in rows]
    lengths = [len(s) for s in steps]
    points = Points(
        rank=np.repeat(np.array([row[0] for row in rows], dtype=np.int64), lengths),
        name=np.repeat(np.array([row[1] for row in rows], dtype=object), lengths),
        step=np.concatenate(steps).astype(np.int64),
        value=np.concatenate([np.frombuffer(row[5], dtype=FLOAT_DTYPE) for row in rows]).astype(np.float64),
        time=np.concatenate([np.frombuffer(row[6], dtype=FLOAT_DTYPE) for row in rows]).astype(np.float64),
    )
    return points.where(np.lexsort((points.step, points.rank)))  # lexsort is stable


def read_points(s: Session, run_id: int, *, name: str | None = None, rank: int | None = None,
                after_step: int = -1) -> Points:
    """The stored points of a run (of one metric, of one rank), those after `after_step`."""
    c = MetricChunk.__table__.c
    q = (select(c.rank, c.name, c.step_min, c.count, c.step_data, c.value_data, c.time_data)
         .where(c.run_id == run_id, c.step_max > after_step).order_by(c.id))
    if name is not None:
        q = q.where(c.name == name)
    if rank is not None:
        q = q.where(c.rank == rank)
    result = s.connection().execute(q)
    points = decode(result.cursor.fetchall())  # plain DBAPI tuples: no Row object per chunk
    result.close()
    return points.where(points.step > after_step)  # a chunk that ends after it may start before it


def discard_before(s: Session, run_id: int, step: int) -> tuple[int, int]:
    """Delete a run's chunks that end before `step` (every rank and metric): (chunks, points) deleted. A
    chunk that straddles it is kept whole: every point from `step` on stays."""
    c = MetricChunk.__table__.c
    where = (c.run_id == run_id, c.step_max < step)
    chunks, points = s.execute(select(func.count(), func.coalesce(func.sum(c.count), 0)).where(*where)).one()
    if chunks:
        s.execute(delete(MetricChunk).where(*where))
    return int(chunks), int(points)


def discard_after(s: Session, run_id: int, rank: int, step: int) -> None:
    """Delete a rank's points after `step`: whole chunks, and the tail of the one that straddles it."""
    c = MetricChunk.__table__.c
    straddling = s.execute(select(c.id, c.step_min, c.count, c.step_data, c.value_data, c.time_data).where(
        c.run_id == run_id, c.rank == rank, c.step_min <= step, c.step_max > step)).all()
    s.execute(delete(MetricChunk).where(c.run_id == run_id, c.rank == rank, c.step_min > step))
    for chunk_id, step_min, count, step_data, value_data, time_data in straddling:
        steps = chunk_steps(step_min, count, step_data)
        keep = steps <= step
        s.execute(update(MetricChunk).where(c.id == chunk_id).values(**encode(
            steps[keep], np.frombuffer(value_data, dtype=FLOAT_DTYPE)[keep],
            np.frombuffer(time_data, dtype=FLOAT_DTYPE)[keep])))


def _packed(column: Any, dtype: np.dtype[Any]) -> bytes:
    """A column's stored bytes: a numpy array or an `array` (read in place), in the stored byte order
    (no conversion on a little-endian host)."""
    return np.asarray(column).astype(dtype, copy=False).tobytes()
