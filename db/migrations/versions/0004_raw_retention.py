"""raw-point retention: runs.raw_kept_from, the step from which a run's raw points are all still stored (0:
every one); `ddpdash compact` raises it as it removes older points, whose rollups stay

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01 15:00:00
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Plain ALTER TABLE, not a batch (see 0003): a batch would drop `runs`, and its points with it.
    op.add_column('runs', sa.Column('raw_kept_from', sa.Integer(), nullable=False, server_default='0'))


def downgrade() -> None:
    op.drop_column('runs', 'raw_kept_from')
