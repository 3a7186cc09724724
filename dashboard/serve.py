"""`ddpdash ui`: run the Streamlit server for dashboard/app.py (replaces this process)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from .auth import ADDRESS_ENV, PASSWORD_ENV, ExposureError, check_exposure

APP = Path(__file__).resolve().parent / "app.py"


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


def serve(port: int, address: str) -> int:
    try:
        check_exposure(address, os.environ.get(PASSWORD_ENV))
    except ExposureError as exc:
        print(f"ddpdash: error: {exc}", file=sys.stderr)
        return 2
    os.environ[ADDRESS_ENV] = address
    print(f"ddpdash: dashboard on http://{address}:{port}", file=sys.stderr, flush=True)
    argv = streamlit_argv(port, address)
    os.execv(argv[0], argv)  # the server replaces the CLI process: one process, signals reach it directly
    return 0  # pragma: no cover
