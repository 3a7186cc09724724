"""raw points stored as chunks (one row per metric of each written batch) instead of a row per point

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30 22:45:00

The points already stored are carried over: each (run, rank, metric) becomes chunks of up to
CHUNK_POINTS points, in step order. Downgrade turns them back into one row per point.
"""
from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np
import sqlalchemy as sa
from alembic import op

revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None

CHUNK_POINTS = 4096
STEP_DTYPE = np.dtype("<i8")  # as db/chunks.py; a migration keeps its own copy of what it depends on
FLOAT_DTYPE = np.dtype("<f8")


def _points_table() -> sa.Table:
    return sa.table('metric_points', sa.column('id', sa.Integer), sa.column('run_id', sa.Integer),
                    sa.column('rank', sa.Integer), sa.column('step', sa.Integer), sa.column('name', sa.String),
                    sa.column('value', sa.Float), sa.column('time', sa.Float))


def _chunks_table() -> sa.Table:
    return sa.table('metric_chunks', sa.column('id', sa.Integer), sa.column('run_id', sa.Integer),
                    sa.column('rank', sa.Integer), sa.column('name', sa.String), sa.column('step_min', sa.Integer),
                    sa.column('step_max', sa.Integer), sa.column('count', sa.Integer),
                    sa.column('step_data', sa.LargeBinary), sa.column('value_data', sa.LargeBinary),
                    sa.column('time_data', sa.LargeBinary))


def upgrade() -> None:
    op.create_table('metric_chunks',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('rank', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(length=64), nullable=False),
    sa.Column('step_min', sa.Integer(), nullable=False),
    sa.Column('step_max', sa.Integer(), nullable=False),
    sa.Column('count', sa.Integer(), nullable=False),
    sa.Column('step_data', sa.LargeBinary(), nullable=False),
    sa.Column('value_data', sa.LargeBinary(), nullable=False),
    sa.Column('time_data', sa.LargeBinary(), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_metric_chunks_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_metric_chunks'))
    )
    with op.batch_alter_table('metric_chunks', schema=None) as batch_op:
        batch_op.create_index('ix_metric_chunks_run_name_step_max', ['run_id', 'name', 'step_max'], unique=False)

    conn = op.get_bind()
    chunks = _chunks_table()
    for rows in _batches(_chunks_from_points(conn), 256):
        conn.execute(chunks.insert(), rows)

    with op.batch_alter_table('metric_points', schema=None) as batch_op:
        batch_op.drop_index('ix_metric_points_run_name_step')
    op.drop_table('metric_points')


def downgrade() -> None:
    op.create_table('metric_points',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('rank', sa.Integer(), nullable=False),
    sa.Column('step', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(length=64), nullable=False),
    sa.Column('value', sa.Float(), nullable=False),
    sa.Column('time', sa.Float(), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_metric_points_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_metric_points'))
    )
    with op.batch_alter_table('metric_points', schema=None) as batch_op:
        batch_op.create_index('ix_metric_points_run_name_step', ['run_id', 'name', 'step'], unique=False)

    conn = op.get_bind()
    chunks, points = _chunks_table(), _points_table()
    result = conn.execute(sa.select(chunks.c.run_id, chunks.c.rank, chunks.c.name, chunks.c.step_data,
                                    chunks.c.value_data, chunks.c.time_data).order_by(chunks.c.id)).all()
    for run_id, rank, name, step_data, value_data, time_data in result:
        steps = np.frombuffer(step_data, dtype=STEP_DTYPE).tolist()
        values = np.frombuffer(value_data, dtype=FLOAT_DTYPE).tolist()
        times = np.frombuffer(time_data, dtype=FLOAT_DTYPE).tolist()
        conn.execute(points.insert(), [
            {"run_id": run_id, "rank": rank, "name": name, "step": s, "value": v, "time": t}
            for s, v, t in zip(steps, values, times, strict=True)
        ])

    with op.batch_alter_table('metric_chunks', schema=None) as batch_op:
        batch_op.drop_index('ix_metric_chunks_run_name_step_max')
    op.drop_table('metric_chunks')


def _chunks_from_points(conn: sa.Connection) -> Iterator[dict[str, object]]:
    """The stored points, in chunks of at most CHUNK_POINTS of one (run, rank, metric), read as a stream."""
    p = _points_table().c
    rows = conn.execute(
        sa.select(p.run_id, p.rank, p.name, p.step, p.value, p.time).order_by(p.run_id, p.rank, p.name, p.step, p.id),
        execution_options={"yield_per": 10_000})  # per statement: a Connection's own options would stay set
    for (run_id, rank, name), same in itertools.groupby(rows, key=lambda r: (r[0], r[1], r[2])):
        for part in _batches(same, CHUNK_POINTS):
            steps = np.array([r[3] for r in part], dtype=STEP_DTYPE)
            yield {"run_id": run_id, "rank": rank, "name": name, "step_min": int(steps.min()),
                   "step_max": int(steps.max()), "count": len(part), "step_data": steps.tobytes(),
                   "value_data": np.array([r[4] for r in part], dtype=FLOAT_DTYPE).tobytes(),
                   "time_data": np.array([r[5] for r in part], dtype=FLOAT_DTYPE).tobytes()}


def _batches(items: Iterator, size: int) -> Iterator[list]:  # type: ignore[type-arg]
    iterator = iter(items)
    while batch := list(itertools.islice(iterator, size)):
        yield batch
