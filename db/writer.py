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
from collections.abc import Mapping
from dataclasses import dataclass, field

from sqlalchemy import Engine, delete, func, insert, literal, select, update
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from db.models import ROLLUP_WIDTHS, MetricPoint, MetricRollup, RankState, Run, RunEvent

log = logging.getLogger(__name__)

FLUSH_INTERVAL_S = 1.0
MAX_BUFFERED_LOGS = 200_000  # log() calls held in memory at most; the oldest are dropped past it
CLOSE_DEADLINE_S = 30.0


@dataclass
class _Bucket:
    step_min: int
    step_max: int
    vmin: float
    vmax: float
    vsum: float
    count: int
    time_max: float

    def add(self, step: int, value: float, t: float) -> None:
        self.step_max = step
        self.vmin = min(self.vmin, value)
        self.vmax = max(self.vmax, value)
        self.vsum += value
        self.count += 1
        self.time_max = t


@dataclass
class _Pending:
    logs: collections.deque[tuple[int, float, Mapping[str, float]]] = field(
        default_factory=lambda: collections.deque(maxlen=MAX_BUFFERED_LOGS)
    )
    events: collections.deque[dict[str, object]] = field(default_factory=collections.deque)


class MetricWriter:
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
    ) -> None:
        self.engine = engine
        self.run_id = run_id
        self.rank = rank
        self.flush_interval_s = flush_interval_s
        self.dropped = 0
        self.logged_points = 0
        self.written_points = 0
        self._pending = _Pending()
        self._open: dict[tuple[str, int], tuple[int, _Bucket]] = {}  # (name, width) -> (bucket, agg)
        self._status = "running"
        self._run_values: dict[str, object] = {}
        self._step = 0
        self._stop = threading.Event()
        self._flush_lock = threading.Lock()
        self._register(device, attempt, resume_after_step)
        self._thread = threading.Thread(target=self._run, name=f"ddpdash-writer-r{rank}", daemon=True)
        self._thread.start()

    # ---- hot path --------------------------------------------------------------------------
    def log(self, step: int, values: Mapping[str, float]) -> None:
        """Queue one step's values (plain floats); returns at once."""
        if len(self._pending.logs) == MAX_BUFFERED_LOGS:
            self.dropped += 1
        self._pending.logs.append((step, time.time(), values))
        self.logged_points += len(values)
        self._step = step

    def event(self, kind: str, message: str, detail: str = "") -> None:
        self._pending.events.append(
            {"run_id": self.run_id, "time": time.time(), "kind": kind, "rank": self.rank,
             "message": message, "detail": detail}
        )

    def set_status(self, status: str) -> None:
        self._status = status

    def set_total_steps(self, total: int) -> None:
        """Rank 0 tells the run how many steps it will take (for progress and ETA)."""
        self._run_values["total_steps"] = total

    def flush(self) -> None:
        with self._flush_lock:
            self._flush_once()

    def close(self, status: str | None = None) -> None:
        """Stop the thread and write everything left, retrying a busy database for a while."""
        if status:
            self._status = status
        self._stop.set()
        self._thread.join()
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
        while not self._stop.wait(backoff):
            try:
                self.flush()
                backoff = self.flush_interval_s
            except Exception as exc:  # the database may be busy or gone for a while; training goes on
                log.warning("rank %d: metric flush failed (%s); retrying", self.rank, exc)
                backoff = min(backoff * 2, 10.0)

    def _take(self) -> tuple[list[tuple[int, float, Mapping[str, float]]], list[dict[str, object]]]:
        logs, events = [], []
        pending = self._pending
        while pending.logs:
            logs.append(pending.logs.popleft())
        while pending.events:
            events.append(pending.events.popleft())
        return logs, events

    def _flush_once(self) -> None:
        logs, events = self._take()
        try:
            self._write(logs, events)
        except Exception:
            # Put the batch back in front so nothing is lost; the next flush retries it.
            self._pending.logs.extendleft(reversed(logs))
            self._pending.events.extendleft(reversed(events))
            raise

    def _write(self, logs: list[tuple[int, float, Mapping[str, float]]], events: list[dict[str, object]]) -> None:
        run_id, rank = self.run_id, self.rank
        rows = [
            {"run_id": run_id, "rank": rank, "step": step, "name": name, "value": value, "time": t}
            for step, t, values in logs
            for name, value in values.items()
        ]
        rollups, lowest = self._roll_up(logs)
        now = time.time()
        with Session(self.engine) as s, s.begin():
            if rows:
                s.execute(insert(MetricPoint), rows)
            for width, low in lowest.items():
                s.execute(
                    delete(MetricRollup).where(
                        MetricRollup.run_id == run_id, MetricRollup.rank == rank,
                        MetricRollup.width == width, MetricRollup.bucket >= low,
                    )
                )
            if rollups:
                s.execute(insert(MetricRollup), rollups)
            if events:
                s.execute(insert(RunEvent), events)
            if self._run_values:
                s.execute(update(Run).where(Run.id == run_id).values(**self._run_values))
                self._run_values = {}
            s.execute(
                update(RankState)
                .where(RankState.run_id == run_id, RankState.rank == rank)
                .values(status=self._status, step=self._step, heartbeat_at=now)
            )
        self.written_points += len(rows)

    def _roll_up(
        self, logs: list[tuple[int, float, Mapping[str, float]]]
    ) -> tuple[list[dict[str, object]], dict[int, int]]:
        touched: dict[tuple[str, int, int], _Bucket] = {}
        lowest: dict[int, int] = {}
        open_ = self._open
        for step, t, values in logs:
            for name, value in values.items():
                for width in ROLLUP_WIDTHS:
                    bucket = step // width
                    current = open_.get((name, width))
                    if current is not None and current[0] == bucket:
                        agg = current[1]
                        agg.add(step, value, t)
                    else:
                        agg = _Bucket(step, step, value, value, value, 1, t)
                        open_[(name, width)] = (bucket, agg)
                    touched[(name, width, bucket)] = agg
                    if bucket < lowest.get(width, bucket + 1):
                        lowest[width] = bucket
        rows = [
            {"run_id": self.run_id, "name": name, "width": width, "rank": self.rank, "bucket": bucket,
             "step_min": a.step_min, "step_max": a.step_max, "vmin": a.vmin, "vmax": a.vmax,
             "vsum": a.vsum, "count": a.count, "time_max": a.time_max}
            for (name, width, bucket), a in touched.items()
        ]
        # Buckets rewritten from `lowest` up must all be in `rows`: add the open ones not touched now.
        for (name, width), (bucket, a) in open_.items():
            if width in lowest and bucket >= lowest[width] and (name, width, bucket) not in touched:
                rows.append(
                    {"run_id": self.run_id, "name": name, "width": width, "rank": self.rank, "bucket": bucket,
                     "step_min": a.step_min, "step_max": a.step_max, "vmin": a.vmin, "vmax": a.vmax,
                     "vsum": a.vsum, "count": a.count, "time_max": a.time_max}
                )
        return rows, lowest

    # ---- start-up --------------------------------------------------------------------------
    def _register(self, device: str, attempt: int, resume_after_step: int | None) -> None:
        now = time.time()
        with Session(self.engine) as s, s.begin():
            exists = s.scalar(
                select(func.count()).select_from(RankState)
                .where(RankState.run_id == self.run_id, RankState.rank == self.rank)
            )
            state = {"host": socket.gethostname(), "pid": os.getpid(), "device": device, "status": "running",
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
        run_id, rank = self.run_id, self.rank
        s.execute(delete(MetricPoint).where(
            MetricPoint.run_id == run_id, MetricPoint.rank == rank, MetricPoint.step > step))
        s.execute(delete(MetricRollup).where(MetricRollup.run_id == run_id, MetricRollup.rank == rank))
        for width in ROLLUP_WIDTHS:
            bucket = MetricPoint.step // width
            grouped = (
                select(
                    MetricPoint.run_id, MetricPoint.name, literal(width).label("width"), MetricPoint.rank,
                    bucket.label("bucket"), func.min(MetricPoint.step), func.max(MetricPoint.step),
                    func.min(MetricPoint.value), func.max(MetricPoint.value), func.sum(MetricPoint.value),
                    func.count(), func.max(MetricPoint.time),
                )
                .where(MetricPoint.run_id == run_id, MetricPoint.rank == rank)
                .group_by(MetricPoint.run_id, MetricPoint.name, MetricPoint.rank, bucket)
            )
            s.execute(
                insert(MetricRollup).from_select(
                    ["run_id", "name", "width", "rank", "bucket", "step_min", "step_max", "vmin", "vmax",
                     "vsum", "count", "time_max"],
                    grouped,
                )
            )
        # Seed the buckets still being filled so the next flush rewrites them whole.
        for r in s.execute(
            select(MetricRollup).where(MetricRollup.run_id == run_id, MetricRollup.rank == rank)
        ).scalars():
            key = (r.name, r.width)
            if key not in self._open or self._open[key][0] < r.bucket:
                self._open[key] = (r.bucket, _Bucket(r.step_min, r.step_max, r.vmin, r.vmax, r.vsum, r.count,
                                                      r.time_max))


class NullWriter:
    """Stands in for MetricWriter where nothing must be written (tests, benchmarks)."""

    dropped = 0

    def log(self, step: int, values: Mapping[str, float]) -> None:
        pass

    def event(self, kind: str, message: str, detail: str = "") -> None:
        pass

    def set_status(self, status: str) -> None:
        pass

    def set_total_steps(self, total: int) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self, status: str | None = None) -> None:
        pass
