"""Slurm jobs: runs.job_id, the Slurm job a run was submitted as ("" for a local run), and runs.job_state,
what Slurm last said of it ("PENDING (Resources)", "RUNNING on node[1-2]"), kept by reconciliation

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01 18:30:00
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Plain ALTER TABLE, not a batch (see 0003): a batch would drop `runs`, and its points with it.
    op.add_column('runs', sa.Column('job_id', sa.String(64), nullable=False, server_default=''))
    op.add_column('runs', sa.Column('job_state', sa.String(200), nullable=False, server_default=''))


def downgrade() -> None:
    op.drop_column('runs', 'job_state')
    op.drop_column('runs', 'job_id')
