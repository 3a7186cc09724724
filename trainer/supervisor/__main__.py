"""The run supervisor's entry point:

    python -m ddpdash.trainer.supervisor --run-id N --run-dir DIR           (started by the queue, detached)
    python -m ddpdash.trainer.supervisor --run-id N --run-dir DIR --slurm   (one per node of a Slurm job, by srun)

It starts torchrun, records torchrun's and the workers' PIDs, beats a heartbeat, handles SIGTERM as
"stop this run", and on exit writes the final status: succeeded, failed (which rank, why), or stopped.
A Slurm node's supervisor does the same for its node's ranks (trainer/slurm.py): the run's outcome is
the first failure of any node, or success once every node's ranks are done.
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from ddpdash.db.paths import default_db_url
from ddpdash.db.vocab import EventKind, RunStatus

from ..config import RunConfig
from ..control import descendants, spawn_torchrun, terminate_run
from ..relay import Listener
from ..rundir import RunDir
from .node import SlurmNode, store_refusal
from .priority import DEFAULT_SUPERVISOR_NICE, PriorityError, supervisor_nice

if TYPE_CHECKING:
    from sqlalchemy import Engine

log = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s supervisor %(levelname)s %(message)s")
    p = argparse.ArgumentParser(prog="python -m ddpdash.trainer.supervisor")
    p.add_argument("--run-id", type=int, required=True)
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--slurm", action="store_true", help="one node's supervisor of a Slurm job (reads SLURM_*)")
    args = p.parse_args(argv)
    stop_requested = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop_requested.set())
    db_url = default_db_url()
    run_dir = RunDir(args.run_dir)
    # torchrun first, the database after: every import before this line is launch latency.
    cfg = RunConfig.from_file(run_dir.config)
    node = SlurmNode.from_env(cfg) if args.slurm else None
    rendezvous = None
    if node is not None:
        run_dir = run_dir.on_node(node.index, node.first_rank)
        refusal = store_refusal(db_url)
        if refusal:  # written to the shared folder, not the store: reconciliation reads it from there
            log.error("%s", refusal)
            run_dir.refusal.write_text(refusal + "\n")
            return 1
        rendezvous = node.rendezvous
    nice = _nice()  # before torchrun starts: nothing after it may fail and leave training unsupervised
    listener = Listener()  # the ranks' metrics come here (trainer/relay.py); they queue until accepted
    proc = spawn_torchrun(cfg, run_dir, args.run_id, db_url, listener.env(), rendezvous)
    from sqlalchemy.orm import Session

    from ddpdash.db.engine import make_engine
    from ddpdash.db.runs import add_event, finish_run

    from .diagnose import Diagnose
    from .priority import yield_cpu_to_training
    from .relay_server import RelayServer
    from .watch import promote_checkpoint, supervise

    yield_cpu_to_training(nice)  # torchrun keeps its priority; the relay's threads, started below, do not
    engine = make_engine(db_url)
    relay = RelayServer(engine, args.run_id, listener,
                        on_rank_closed=lambda: promote_checkpoint(run_dir, relay.written_steps(), cfg.world_size))
    # A hang is judged once per run: by its one supervisor, or by the first node's of a Slurm job.
    diagnose = Diagnose(engine, args.run_id, cfg).start() if node is None or node.index == 0 else None
    try:
        status = supervise(engine, args.run_id, run_dir, cfg, proc, stop_requested, relay, node)
    except Exception as exc:
        log.exception("supervisor failed")
        terminate_run(proc.pid, descendants(proc.pid))  # never leave training running unsupervised
        relay.drain(timeout_s=5.0)
        with Session(engine) as s, s.begin():
            if finish_run(s, args.run_id, RunStatus.FAILED, error=f"supervisor error on {socket.gethostname()}: {exc}"):
                add_event(s, args.run_id, EventKind.FAILED, f"supervisor error: {exc}")
        _hand_on(engine, node)
        if diagnose is not None:
            diagnose.finish()
        return 1
    log.info("run %d %s", args.run_id, status)
    _hand_on(engine, node)
    if diagnose is not None:
        diagnose.finish()  # the outcome's alert: after the machine is handed on, so no queued run waits for it
    return 0


def _hand_on(engine: Engine, node: SlurmNode | None) -> None:
    """The run's devices are free: the queue admits what waits for them (whether or not a dashboard is open).
    A Slurm node's are Slurm's to hand on."""
    from ..queue import dispatch

    if node is not None:
        return

    try:
        started = dispatch(engine)
    except Exception:  # the outcome is recorded; the next launch, cancel or reconcile dispatches again
        log.exception("could not hand the machine on to the queue")
        return
    if started:
        log.info("started queued run(s) %s", started)


def _nice() -> int:
    """launch() has checked the setting; a supervisor started some other way falls back to the default."""
    try:
        return supervisor_nice()
    except PriorityError as exc:
        log.warning("%s; using %d", exc, DEFAULT_SUPERVISOR_NICE)
        return DEFAULT_SUPERVISOR_NICE


if __name__ == "__main__":
    raise SystemExit(main())
