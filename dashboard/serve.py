"""`ddpdash ui`: run the dashboard's server (dashboard/server.py: Streamlit behind the web gate),
replacing this process."""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path

from .auth import ADDRESS_ENV, PASSWORD_ENV, ExposureError, check_exposure
from .gate import TOKEN_ENV

APP = Path(__file__).resolve().parent / "server.py"


def streamlit_argv(port: int, address: str) -> list[str]:
    return [
        sys.executable, "-m", "streamlit", "run", str(APP),
        "--server.port", str(port),
        "--server.address", address,
        "--server.headless", "true",
        "--browser.gatherUsageStats", "false",  # otherwise the page tries to reach an outside host
        "--server.enableXsrfProtection", "true",
        "--server.fileWatcherType", "none",
        "--client.toolbarMode", "minimal",
    ]


def first_url(address: str, port: int) -> str:
    """The link to open. Without a password it carries this start's token (the gate asks for it once,
    then remembers it in a cookie); the token is drawn here unless DDPDASH_TOKEN fixes it."""
    host = "127.0.0.1" if address in ("", "0.0.0.0", "::") else (f"[{address}]" if ":" in address else address)
    if os.environ.get(PASSWORD_ENV):
        return f"http://{host}:{port}/"
    token = os.environ.setdefault(TOKEN_ENV, secrets.token_urlsafe(24))
    return f"http://{host}:{port}/?token={token}"


def serve(port: int, address: str) -> int:
    try:
        check_exposure(address, os.environ.get(PASSWORD_ENV))
    except ExposureError as exc:
        print(f"ddpdash: error: {exc}", file=sys.stderr)
        return 2
    os.environ[ADDRESS_ENV] = address
    print(f"ddpdash: dashboard on {first_url(address, port)}", file=sys.stderr, flush=True)
    argv = streamlit_argv(port, address)
    os.execv(argv[0], argv)  # the server replaces the CLI process: one process, signals reach it directly
    return 0  # pragma: no cover
