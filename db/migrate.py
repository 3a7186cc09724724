"""Schema migrations (Alembic) applied programmatically, with an actionable message when they cannot."""

from __future__ import annotations

import contextlib
import fcntl
import time
from collections.abc import Iterator
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine

MIGRATIONS_DIR = Path(__file__).parent / "migrations"


class StoreError(RuntimeError):
    """The store cannot be used: a bad URL, an unreachable server, a file that is not a database."""


class SchemaError(StoreError):
    """The database's schema is not one this version of ddpdash can use."""


def _alembic_config() -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    return cfg


def head_revision() -> str:
    head = ScriptDirectory.from_config(_alembic_config()).get_current_head()
    assert head is not None
    return head


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


@contextlib.contextmanager
def _migration_lock(engine: Engine) -> Iterator[None]:
    """Several ranks may open a new SQLite file at once, and SQLite commits DDL statement by statement:
    a file lock beside the database lets one process migrate while the others wait."""
    database = engine.url.database
    if engine.url.get_backend_name() != "sqlite" or not database or database == ":memory:":
        yield
        return
    with open(f"{database}.migrate.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _wait_for_head(engine: Engine, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if current_revision(engine) == head_revision():
                return True
        except Exception:  # the other migrator holds the database right now
            pass
        time.sleep(0.2)
    return False


def upgrade(engine: Engine) -> None:
    """Bring the database to the newest schema; safe to call from several processes at start-up."""
    known = {s.revision for s in ScriptDirectory.from_config(_alembic_config()).walk_revisions()}
    current = current_revision(engine)
    if current == head_revision():
        return
    if current is not None and current not in known:
        raise SchemaError(
            f"database {engine.url.render_as_string(hide_password=True)} has schema revision {current}, "
            "made by a newer ddpdash: upgrade ddpdash (pip install -U ddpdash) or point DDPDASH_DB_URL "
            "at another database"
        )
    cfg = _alembic_config()
    try:
        with _migration_lock(engine):
            if current_revision(engine) == head_revision():
                return  # another process migrated it while we waited for the lock
            with engine.begin() as conn:
                cfg.attributes["connection"] = conn
                command.upgrade(cfg, "head")
    except Exception as exc:
        if _wait_for_head(engine):
            return  # another process migrated it first
        raise SchemaError(
            f"could not migrate database {engine.url.render_as_string(hide_password=True)} from "
            f"revision {current or 'empty'} to {head_revision()}: {exc}. Back it up, then move it "
            "aside (or set DDPDASH_DB_URL to a new database) and start again"
        ) from exc


def open_store(url: str | None = None) -> Engine:
    """The engine for `url` (default: DDPDASH_DB_URL or $DDPDASH_HOME/ddpdash.db), migrated to the newest
    schema. StoreError, in one line, when that cannot be."""
    from sqlalchemy.exc import ArgumentError, DBAPIError

    from .engine import make_engine
    from .paths import default_db_url

    shown = url or default_db_url()
    try:
        engine = make_engine(url)
    except ArgumentError as exc:
        raise StoreError(f"{_masked(shown)} is not a database URL this ddpdash can open ({exc}); set DDPDASH_DB_URL "
                         "to e.g. sqlite:///path/ddpdash.db or postgresql+psycopg://user@host/db") from exc
    except OSError as exc:
        raise StoreError(f"cannot make the folder for {_masked(shown)}: {exc.strerror} ({exc.filename})") from exc
    try:
        upgrade(engine)
    except DBAPIError as exc:
        engine.dispose()
        reason = str(exc.orig).strip().splitlines()[0] if exc.orig else str(exc)
        raise StoreError(f"cannot use the database {_masked(shown)}: {reason}") from exc
    return engine


def _masked(url: str) -> str:
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # not even a URL: show it as given
        return repr(url)
