"""The engine factory: one engine per process, SQLite pragmas set on connect."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url

from .paths import ddpdash_home, default_db_url, runs_root

__all__ = ["ddpdash_home", "default_db_url", "make_engine", "runs_root"]

SQLITE_BUSY_TIMEOUT_MS = 10_000


def _sqlite_pragmas(dbapi_connection, _record) -> None:  # type: ignore[no-untyped-def]
    # WAL + busy_timeout: measured 0 lock errors with 4 writers and a reader (shared/NOTES.md).
    cursor = dbapi_connection.cursor()
    cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
    _ensure_wal(cursor)
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def _ensure_wal(cursor) -> None:  # type: ignore[no-untyped-def]
    """WAL is stored in the file: only the first connection switches it. Switching needs the file to
    itself, and SQLite answers "database is locked" at once (no busy wait) when ranks open a new
    database together, so the switch is retried while others hold it."""
    deadline = time.monotonic() + SQLITE_BUSY_TIMEOUT_MS / 1000
    while True:
        if cursor.execute("PRAGMA journal_mode").fetchone()[0].lower() == "wal":
            return
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def make_engine(url: str | None = None) -> Engine:
    """One engine per process; SQLite gets its folder created and its pragmas set on connect."""
    url = url or default_db_url()
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        return create_engine(url, pool_pre_ping=True)
    database = parsed.database or ""
    if database and database != ":memory:" and not database.startswith("file:"):
        Path(database).expanduser().parent.mkdir(parents=True, exist_ok=True)
    # A pooled connection keeps SQLite's page cache warm between a dashboard's queries (a fresh
    # connection per query read the same pages again); each process makes its own engine.
    engine = create_engine(url, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000})
    event.listen(engine, "connect", _sqlite_pragmas)
    return engine
