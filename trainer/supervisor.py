"""The run supervisor: starts torchrun for one run, watches it and records the truth.

    python -m trainer.supervisor --run-id N --run-dir DIR   (started by trainer.launcher.launch, detached)

It records torchrun's and the workers' PIDs, beats a heartbeat, handles SIGTERM as "stop this run",
and on exit writes the final status: succeeded, failed (which rank, why), or stopped.
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import threading
from pathlib import Path

from db.paths import default_db_url
from trainer.config import RunConfig
from trainer.launcher import (
    DEFAULT_SUPERVISOR_NICE,
    LaunchError,
    descendants,
    spawn_torchrun,
    supervisor_nice,
    terminate_run,
)
from trainer.relay import Listener

log = logging.getLogger("trainer.supervisor")


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s supervisor %(levelname)s %(message)s")
    p = argparse.ArgumentParser(prog="python -m trainer.supervisor")
    p.add_argument("--run-id", type=int, required=True)
    p.add_argument("--run-dir", type=Path, required=True)
    args = p.parse_args(argv)
    stop_requested = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop_requested.set())
    db_url = default_db_url()
    # torchrun first, the database after: every import before this line is launch latency.
    cfg = RunConfig.from_json((args.run_dir / "config.json").read_text())
    nice = _nice()  # before torchrun starts: nothing after it may fail and leave training unsupervised
    listener = Listener()  # the ranks' metrics come here (trainer/relay.py); they queue until accepted
    proc = spawn_torchrun(cfg, args.run_dir, args.run_id, db_url, listener.env())
    from sqlalchemy.orm import Session

    from db.engine import make_engine
    from db.runs import add_event, finish_run
    from trainer.relay_server import RelayServer
    from trainer.supervision import supervise, yield_cpu_to_training

    yield_cpu_to_training(nice)  # torchrun keeps its priority; the relay's threads, started below, do not
    engine = make_engine(db_url)
    relay = RelayServer(engine, args.run_id, listener)
    try:
        status = supervise(engine, args.run_id, args.run_dir, cfg, proc, stop_requested, relay)
    except Exception as exc:
        log.exception("supervisor failed")
        terminate_run(proc.pid, descendants(proc.pid))  # never leave training running unsupervised
        relay.drain(timeout_s=5.0)
        with Session(engine) as s, s.begin():
            if finish_run(s, args.run_id, "failed", error=f"supervisor error on {socket.gethostname()}: {exc}"):
                add_event(s, args.run_id, "failed", f"supervisor error: {exc}")
        return 1
    log.info("run %d %s", args.run_id, status)
    return 0


def _nice() -> int:
    """launch() has checked the setting; a supervisor started some other way falls back to the default."""
    try:
        return supervisor_nice()
    except LaunchError as exc:
        log.warning("%s; using %d", exc, DEFAULT_SUPERVISOR_NICE)
        return DEFAULT_SUPERVISOR_NICE


if __name__ == "__main__":
    raise SystemExit(main())
