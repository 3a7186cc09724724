"""How a rank finds its run and its metrics' way to the store: through the supervisor that launched it
(the relay), or — started by hand, or its supervisor gone — straight into the store, registering one run
per rendezvous. Runs in the ranks (the trainer's and a user script's, through the `ddpdash` API).
Standard library at import: SQLAlchemy only when a rank writes the store itself."""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import time
import uuid
from typing import Any, NamedTuple

from ddpdash.db.vocab import RankStatus, RunStatus

from .commands import RUN_KEY_ENV
from .metrics import RankLogger, direct_logger
from .relay import Hello, RelaySender, relay_from_env, supervisor_gone
from .rundir import RunDir

log = logging.getLogger(__name__)


class RankPlace(NamedTuple):
    """Where this process stands in its run."""

    rank: int
    device: str
    attempt: int
    world_size: int


def open_logger(run_id: int | None, db_url: str | None, name: str, config_json: str, place: RankPlace,
                run_dir: RunDir, resume_after_step: int | None, key: str = "",
                replaces_steps: bool = False) -> tuple[RankLogger, int, Any]:
    """The rank's metrics logger, its run id, and the engine when the rank writes the store itself.

    Ranks the supervisor launched (`run_id` given, the relay in the environment) relay their metrics
    to it and never import SQLAlchemy; ranks started by hand, or whose supervisor cannot be reached,
    write the store directly (registering the run when `run_id` is None). `replaces_steps`: see
    trainer.metrics.RankLogger."""
    hello = Hello(place.rank, place.device, place.attempt, resume_after_step, os.getpid(), socket.gethostname())
    relay = relay_from_env()
    if relay is not None and run_id is not None:
        launched_run = run_id

        def write_directly() -> Any:  # should the supervisor die: the rank keeps its metrics (db.store.RankWriter)
            from ddpdash.db.engine import make_engine
            from ddpdash.db.store import RankWriter

            return RankWriter(make_engine(db_url), launched_run, place.rank, device=hello.device, attempt=place.attempt)

        try:
            sender = RelaySender(*relay, hello, fallback=write_directly)
            return RankLogger(sender, place.rank, replaces_steps=replaces_steps), run_id, None
        except OSError as exc:
            log.warning("metrics relay at %s unreachable (%s): writing to the database directly", relay[0], exc)
    if run_id is not None:
        from ddpdash.db.engine import make_engine  # the launcher migrated the database already

        engine = make_engine(db_url)
    else:
        from ddpdash.db.migrate import open_store  # Alembic: only a hand-started run may have to create the schema

        engine = open_store(db_url)
        run_id = register_run(engine, name, config_json, run_dir, place.world_size, key or run_key(run_dir))
    logger = direct_logger(engine, run_id, place.rank, device=hello.device, attempt=place.attempt,
                           resume_after_step=resume_after_step, replaces_steps=replaces_steps)
    return logger, run_id, engine


def run_key(run_dir: RunDir) -> str:
    """The run's key: the launcher's (in the environment), or, for a hand-started torchrun, one per
    rendezvous and config folder — every node of a job shares both (README), so all ranks agree, and a
    restarted attempt keeps it."""
    launched = os.environ.get(RUN_KEY_ENV)
    if launched:
        return launched
    rendezvous = os.environ.get("TORCHELASTIC_RUN_ID") or f"local-{uuid.uuid4()}"
    folder = hashlib.sha1(str(run_dir.path.resolve()).encode()).hexdigest()[:16]
    return f"{rendezvous[:47]}:{folder}"


def _what_and_backend(config_json: str) -> dict[str, str]:
    from .config import ConfigInvalid, RunConfig

    try:
        cfg = RunConfig.from_json(config_json)
    except ConfigInvalid:
        return {}
    return {"trains": cfg.what, "backend": cfg.resolved_backend}


def register_run(engine: Any, name: str, config_json: str, run_dir: RunDir, world_size: int, key: str) -> int:
    """A hand-started torchrun registers one run per rendezvous: every rank finds or creates the same row."""
    from sqlalchemy.exc import IntegrityError
    from sqlalchemy.orm import Session

    from ddpdash.db.runs import create_run, find_run_by_key, update_run

    for _ in range(50):
        with Session(engine) as s, s.begin():
            found = find_run_by_key(s, key)
            if found is not None:
                return found
        try:
            with Session(engine) as s, s.begin():
                run_id = create_run(s, key=key, name=name, config_json=config_json, world_size=world_size,
                                    run_dir=str(run_dir.path), host=socket.gethostname(), status=RunStatus.RUNNING,
                                    **_what_and_backend(config_json))
                update_run(s, run_id, started_at=time.time())
                return run_id
        except IntegrityError:
            continue  # another rank registered it first
    raise RuntimeError(f"could not register run {key}")


# A rank's final status, as the run's: how rank 0 of a run without a supervisor records the outcome.
RUN_STATUS_OF_RANK = {RankStatus.DONE: RunStatus.SUCCEEDED, RankStatus.STOPPED: RunStatus.STOPPED}


def record_outcome_if_unsupervised(logger: RankLogger, engine: Any, run_id: int, status: str,
                                    supervised: bool) -> None:
    """Rank 0 records the run's outcome when no supervisor will: a hand-started run, or a launched one
    whose supervisor died (its metrics then went to the store directly, through `engine`)."""
    if not supervised:
        _finish_unsupervised(engine, run_id, status)
        return
    taken_over = getattr(logger.sender, "taken_over", None)  # a db.store.RankWriter, once the relay broke
    if taken_over is not None and supervisor_gone():
        _finish_unsupervised(taken_over.engine, run_id, status)


def _finish_unsupervised(engine: Any, run_id: int, status: str) -> None:
    from sqlalchemy.orm import Session

    from ddpdash.db.runs import finish_run

    with Session(engine) as s, s.begin():
        finish_run(s, run_id, RUN_STATUS_OF_RANK.get(status, RunStatus.FAILED))
