"""the run queue and sweeps: runs.queue_order, admitted_at, sweep, group_name; the queue_lock row

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01 12:00:00

Runs stored before the queue were started at once: they count as admitted when created.
"""
from __future__ import annotations

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
    op.create_index('ix_runs_sweep', 'runs', ['sweep'])
    op.create_index('ix_runs_group_name', 'runs', ['group_name'])
    op.execute("UPDATE runs SET queue_order = created_at, admitted_at = created_at")
    lock = op.create_table(
        'queue_lock',
        sa.Column('id', sa.Integer(), nullable=False),
        sa.Column('decisions', sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_queue_lock')),
    )
    op.bulk_insert(lock, [{'id': 1, 'decisions': 0}])


def downgrade() -> None:
    op.drop_table('queue_lock')
    op.drop_index('ix_runs_group_name', 'runs')
    op.drop_index('ix_runs_sweep', 'runs')
    for column in ('group_name', 'sweep', 'admitted_at', 'queue_order'):
        op.drop_column('runs', column)  # SQLite ≥ 3.35 drops a column in place
