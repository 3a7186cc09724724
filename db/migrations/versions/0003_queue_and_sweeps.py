"""the run queue and sweeps: runs.queue_order, admitted_at, sweep, group_name; the queue_lock row; what a run
trains and its backend as columns (runs.trains, runs.backend: the Runs page filters 10,000 runs in SQL)

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01 12:00:00

Runs stored before the queue were started at once: they count as admitted when created. Their `trains`
and `backend` are read from their configs here, as RunConfig.what and .resolved_backend read them (configs
before this revision name a demo model, a script or a module: nothing else).
"""
from __future__ import annotations

import json
from pathlib import PurePath

import sqlalchemy as sa
from alembic import op

revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Plain ALTER TABLE, not a batch: SQLite's batch copies `runs` and drops the old table, and with foreign
    # keys on, dropping it deletes every run's points (ON DELETE CASCADE).
    op.add_column('runs', sa.Column('queue_order', sa.Float(), nullable=False, server_default='0'))
    op.add_column('runs', sa.Column('admitted_at', sa.Float(), nullable=True))
    op.add_column('runs', sa.Column('sweep', sa.String(length=100), nullable=False, server_default=''))
    op.add_column('runs', sa.Column('group_name', sa.String(length=200), nullable=False, server_default=''))
    op.add_column('runs', sa.Column('trains', sa.String(length=200), nullable=False, server_default=''))
    op.add_column('runs', sa.Column('backend', sa.String(length=20), nullable=False, server_default=''))
    op.create_index('ix_runs_trains', 'runs', ['trains'])
    op.create_index('ix_runs_sweep', 'runs', ['sweep'])
    op.create_index('ix_runs_group_name', 'runs', ['group_name'])
    op.execute("UPDATE runs SET queue_order = created_at, admitted_at = created_at")
    _fill_trains_and_backend()
    lock = op.create_table(
        'queue_lock',
        sa.Column('id', sa.Integer(), nullable=False),
        sa.Column('decisions', sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_queue_lock')),
    )
    op.bulk_insert(lock, [{'id': 1, 'decisions': 0}])


def _fill_trains_and_backend() -> None:
    runs = sa.table('runs', sa.column('id', sa.Integer), sa.column('config_json', sa.Text),
                    sa.column('trains', sa.String), sa.column('backend', sa.String))
    conn = op.get_bind()
    for run_id, text in conn.execute(sa.select(runs.c.id, runs.c.config_json)).all():
        try:
            cfg = json.loads(text)
        except ValueError:
            continue
        if not isinstance(cfg, dict):
            continue
        if cfg.get("module"):
            trains = f"-m {cfg['module']}"
        elif cfg.get("script"):
            trains = PurePath(str(cfg["script"])).name
        else:
            trains = str(cfg.get("model", "mlp"))
        backend = str(cfg.get("backend", "auto"))
        if backend == "auto":
            backend = "nccl" if cfg.get("devices") else "gloo"
        conn.execute(sa.update(runs).where(runs.c.id == run_id).values(trains=trains[:200], backend=backend[:20]))


def downgrade() -> None:
    op.drop_table('queue_lock')
    op.drop_index('ix_runs_trains', 'runs')
    op.drop_index('ix_runs_group_name', 'runs')
    op.drop_index('ix_runs_sweep', 'runs')
    for column in ('backend', 'trains', 'group_name', 'sweep', 'admitted_at', 'queue_order'):
        op.drop_column('runs', column)  # SQLite ≥ 3.35 drops a column in place
