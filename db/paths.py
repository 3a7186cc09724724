"""Where ddpdash keeps things: no SQLAlchemy import, so processes that only need paths start fast.

`DDPDASH_HOME` (default `~/.ddpdash`) holds `ddpdash.db` and one folder per run;
`DDPDASH_DB_URL` overrides the database with any SQLAlchemy URL (PostgreSQL for multi-node).
"""

from __future__ import annotations

import os
from pathlib import Path


def ddpdash_home() -> Path:
    # Absolute: ranks of a recipe run in the user's project folder, not where the launcher was started.
    return Path(os.environ.get("DDPDASH_HOME") or Path.home() / ".ddpdash").expanduser().absolute()


def runs_root() -> Path:
    return ddpdash_home() / "runs"


def default_db_url() -> str:
    return os.environ.get("DDPDASH_DB_URL") or f"sqlite:///{ddpdash_home() / 'ddpdash.db'}"
