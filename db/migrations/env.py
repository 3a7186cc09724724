"""Alembic environment: runs on the connection handed over by `db.migrate`."""

from __future__ import annotations

from alembic import context

from ddpdash.db.models import Base

config = context.config
connection = config.attributes.get("connection")
if connection is None:  # pragma: no cover - only when someone runs the alembic CLI by hand
    from ddpdash.db.engine import make_engine

    with make_engine(config.get_main_option("sqlalchemy.url") or None).connect() as conn:
        context.configure(connection=conn, target_metadata=Base.metadata, render_as_batch=True)
        with context.begin_transaction():
            context.run_migrations()
else:
    context.configure(connection=connection, target_metadata=Base.metadata, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()
