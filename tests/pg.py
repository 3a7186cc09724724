"""A throw-away PostgreSQL server for the tests that prove ddpdash is not SQLite-only."""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest


def _bindir() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    return Path(found[-1]).parent if found else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class PgServer:
    url: str
    stop: Callable[[], None]  # the server goes down (fast shutdown): clients see an outage
    start: Callable[[], None]


@contextmanager
def postgres_server() -> Iterator[str]:
    """Start a private cluster on a free loopback port; yields its SQLAlchemy URL."""
    with controlled_postgres_server() as server:
        yield server.url


@contextmanager
def controlled_postgres_server() -> Iterator[PgServer]:
    """The same, with the means to stop and restart it (an outage)."""
    bindir = _bindir()
    if bindir is None:
        if os.environ.get("CI"):
            pytest.fail("PostgreSQL server binaries are missing: .ci/run installs Debian's postgresql")
        pytest.skip("no PostgreSQL server here (apt-get install postgresql); CI installs one and runs this")
    folder = tempfile.mkdtemp(prefix="ddpdash-pg-")
    as_postgres: list[str] = []
    if os.geteuid() == 0:  # initdb refuses to run as root
        user = pwd.getpwnam("postgres")
        os.chown(folder, user.pw_uid, user.pw_gid)
        as_postgres = ["runuser", "-u", "postgres", "--"]
    data, port = Path(folder) / "data", _free_port()

    def run(*argv: str) -> None:
        subprocess.run([*as_postgres, *argv], check=True, capture_output=True, timeout=120)

    def start() -> None:
        run(str(bindir / "pg_ctl"), "-D", str(data), "-w", "-l", f"{folder}/log",
            "-o", f"-p {port} -k {folder} -c listen_addresses=127.0.0.1 -c fsync=off", "start")

    def stop() -> None:
        run(str(bindir / "pg_ctl"), "-D", str(data), "-w", "-m", "fast", "stop")

    run(str(bindir / "initdb"), "-D", str(data), "-A", "trust", "-U", "ddpdash", "--no-sync")
    start()
    try:
        run(str(bindir / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "ddpdash", "ddpdash")
        yield PgServer(f"postgresql+psycopg://ddpdash@127.0.0.1:{port}/ddpdash", stop, start)
    finally:
        subprocess.run([*as_postgres, str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"],
                       capture_output=True, timeout=60)
        shutil.rmtree(folder, ignore_errors=True)
