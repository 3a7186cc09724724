"""Typed SQLAlchemy 2.0 models. ORM objects never leave `db/`."""

from __future__ import annotations

from sqlalchemy import Float, ForeignKey, Index, Integer, LargeBinary, MetaData, String, Text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# Bucket widths (in steps) of the rollups written at ingest; a chart reads the finest level that fits
# its point budget (half the budget at worst), so a 1M-point run costs a few thousand rows. They add
# about 1/16 of a row per point at ingest. None of 16 steps: a chart whose buckets would be that narrow
# regroups the raw points (db/queries.py), and that level took 40 % of the supervisor's rollup rows.
ROLLUP_WIDTHS: tuple[int, ...] = tuple(2**k for k in range(5, 17))  # 32, 64, …, 65536 steps


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class Run(Base):
    __tablename__ = "runs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    key: Mapped[str] = mapped_column(String(64), unique=True)
    name: Mapped[str] = mapped_column(String(200))
    status: Mapped[str] = mapped_column(String(20), index=True)
    config_json: Mapped[str] = mapped_column(Text)
    world_size: Mapped[int] = mapped_column(Integer)
    run_dir: Mapped[str] = mapped_column(Text, default="")
    host: Mapped[str] = mapped_column(String(255), default="")
    created_at: Mapped[float] = mapped_column(Float, index=True)
    started_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    ended_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    heartbeat_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    total_steps: Mapped[int | None] = mapped_column(Integer, nullable=True)
    supervisor_pid: Mapped[int | None] = mapped_column(Integer, nullable=True)
    torchrun_pid: Mapped[int | None] = mapped_column(Integer, nullable=True)
    worker_pids: Mapped[str] = mapped_column(Text, default="")
    exit_code: Mapped[int | None] = mapped_column(Integer, nullable=True)
    failed_ranks: Mapped[str] = mapped_column(String(200), default="")
    error: Mapped[str] = mapped_column(Text, default="")
    tags: Mapped[str] = mapped_column(Text, default="")
    notes: Mapped[str] = mapped_column(Text, default="")
    # The queue (trainer/queue.py): a queued run waits, in queue_order, until it is admitted.
    queue_order: Mapped[float] = mapped_column(Float, default=0.0)
    admitted_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    sweep: Mapped[str] = mapped_column(String(100), default="", index=True)
    group_name: Mapped[str] = mapped_column(String(200), default="", index=True)
    # RunConfig.what and .resolved_backend, kept as columns: the Runs page filters by them in SQL.
    trains: Mapped[str] = mapped_column(String(200), default="", index=True)
    backend: Mapped[str] = mapped_column(String(20), default="")
    # Raw points before this step were compacted away (db/retention.py); their rollups remain.
    raw_kept_from: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # A Slurm run (trainer/slurm.py): its job, and what Slurm last said of it (written by reconciliation).
    job_id: Mapped[str] = mapped_column(String(64), default="", server_default="")
    job_state: Mapped[str] = mapped_column(String(200), default="", server_default="")


class QueueLock(Base):
    """One row, updated first in every queue decision: the update holds the row's lock (PostgreSQL) or the
    database's write lock (SQLite) till commit, so two processes never admit runs onto the same devices."""

    __tablename__ = "queue_lock"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    decisions: Mapped[int] = mapped_column(Integer, default=0)


class MetricChunk(Base):
    """The points of one metric of one rank from one write: steps, values and times as packed
    little-endian arrays (int64, float64, float64; db/chunks.py). A batch of 200 steps and 3 metrics
    is 3 rows, not 600: the writer's insert costs a few rows per batch, and a point takes 24 bytes."""

    __tablename__ = "metric_chunks"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    rank: Mapped[int] = mapped_column(Integer)
    name: Mapped[str] = mapped_column(String(64))
    step_min: Mapped[int] = mapped_column(Integer)
    step_max: Mapped[int] = mapped_column(Integer)
    count: Mapped[int] = mapped_column(Integer)
    step_data: Mapped[bytes] = mapped_column(LargeBinary)
    value_data: Mapped[bytes] = mapped_column(LargeBinary)
    time_data: Mapped[bytes] = mapped_column(LargeBinary)

    # "Points after step N" (live refresh) is one range scan for all ranks: the chunks that end after N.
    __table_args__ = (Index("ix_metric_chunks_run_name_step_max", "run_id", "name", "step_max"),)


class MetricRollup(Base):
    """Per-bucket min/max/sum/count of one metric of one rank, at several bucket widths."""

    __tablename__ = "metric_rollups"

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    width: Mapped[int] = mapped_column(Integer, primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    bucket: Mapped[int] = mapped_column(Integer, primary_key=True)
    step_min: Mapped[int] = mapped_column(Integer)
    step_max: Mapped[int] = mapped_column(Integer)
    vmin: Mapped[float] = mapped_column(Float)
    vmax: Mapped[float] = mapped_column(Float)
    vsum: Mapped[float] = mapped_column(Float)
    count: Mapped[int] = mapped_column(Integer)
    time_max: Mapped[float] = mapped_column(Float)
    vlast: Mapped[float] = mapped_column(Float)  # the bucket's last value: a run's final loss without raw rows

    # Clustered on the primary key in SQLite: a chart's read is then one sequential range scan.
    __table_args__ = ({"sqlite_with_rowid": False},)


class RankState(Base):
    __tablename__ = "rank_states"

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    host: Mapped[str] = mapped_column(String(255), default="")
    pid: Mapped[int] = mapped_column(Integer, default=0)
    device: Mapped[str] = mapped_column(String(64), default="")
    status: Mapped[str] = mapped_column(String(20), default="starting")
    step: Mapped[int] = mapped_column(Integer, default=0)
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    heartbeat_at: Mapped[float] = mapped_column(Float, default=0.0)


class RunEvent(Base):
    __tablename__ = "run_events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    time: Mapped[float] = mapped_column(Float)
    kind: Mapped[str] = mapped_column(String(32))
    rank: Mapped[int | None] = mapped_column(Integer, nullable=True)
    message: Mapped[str] = mapped_column(Text, default="")
    detail: Mapped[str] = mapped_column(Text, default="")
