"""Start, stop and reconcile runs. Every process ddpdash starts is started here, from argument
lists (never a shell string), each in a session of its own, logging to files in the run folder.

    launch(cfg) -> run id      # validates, writes the run row + folder, starts a detached supervisor
    stop(run_id)               # SIGTERM to torchrun via the supervisor; survivors are killed
    reconcile(engine)          # any reader: runs whose supervisor is gone become `lost`
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

from db.paths import default_db_url, runs_root
from trainer.config import Machine, RunConfig, check

if TYPE_CHECKING:
    from sqlalchemy import Engine

    from db.runs import RunInfo

# The database functions below import SQLAlchemy when called, not here: the supervisor imports this
# module to start torchrun, and every import before that is launch latency.

log = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 4  # torchrun's grace for workers after SIGTERM before it SIGKILLs them
STOP_MARGIN_S = 2.0
STALE_HEARTBEAT_S = 60.0
QUEUED_GRACE_S = 30.0
PROJECT_ROOT = Path(__file__).resolve().parent.parent


class LaunchError(RuntimeError):
    """The run could not be started."""


NICE_ENV = "DDPDASH_SUPERVISOR_NICE"
DEFAULT_SUPERVISOR_NICE = 10  # about a tenth of a rank's CPU share under full contention: plenty to write metrics


def supervisor_nice(env: Mapping[str, str] | None = None) -> int:
    """How far a run's supervisor steps back for its training processes (trainer.supervision.
    yield_cpu_to_training): DDPDASH_SUPERVISOR_NICE, 0–19, default 10. launch() checks it before it
    writes or starts anything; the supervisor reads it from the environment it inherits."""
    raw = (os.environ if env is None else env).get(NICE_ENV, "").strip()
    if not raw:
        return DEFAULT_SUPERVISOR_NICE
    if not raw.isdigit() or int(raw) > 19:
        raise LaunchError(f"{NICE_ENV} must be a whole number from 0 to 19, got {raw!r}")
    return int(raw)


class StopError(RuntimeError):
    """The run could not be stopped as asked."""


# ---- pure builders ---------------------------------------------------------------------------
def torchrun_argv(cfg: RunConfig, run_dir: Path, run_id: int, python: str = sys.executable) -> list[str]:
    """The exact torchrun command for a run. The database URL travels in the environment (it may hold a
    password, and argv is visible to every user of the machine)."""
    return [
        python, "-m", "torch.distributed.run",
        "--nnodes", "1",
        "--nproc-per-node", str(cfg.world_size),
        # c10d on port 0: the OS picks a free port, so two runs at once never clash.
        "--rdzv-backend", "c10d",
        "--rdzv-endpoint", "127.0.0.1:0",
        "--rdzv-id", f"ddpdash-run-{run_id}",
        "--max-restarts", str(cfg.max_restarts),
        "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S),
        "--log-dir", str(run_dir / "logs"),
        "--redirects", "3",
        "-m", "trainer",
        "--config", str(run_dir / "config.json"),
        "--run-id", str(run_id),
    ]


def torchrun_env(cfg: RunConfig, db_url: str, base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    # One thread per rank's share of the cores: more oversubscribes the CPU and slows every rank.
    env["OMP_NUM_THREADS"] = str(max(1, cores // max(cfg.world_size, 1)))
    env["DDPDASH_DB_URL"] = db_url
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROJECT_ROOT), env.get("PYTHONPATH", "")]))
    if cfg.devices:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in cfg.devices)
    return env


def supervisor_argv(run_id: int, run_dir: Path, python: str = sys.executable) -> list[str]:
    return [python, "-m", "trainer.supervisor", "--run-id", str(run_id), "--run-dir", str(run_dir)]


def cli_command(cfg: RunConfig) -> list[str]:
    """The `ddpdash launch` command that starts the same run (flags only where they differ from defaults)."""
    default = RunConfig().to_dict()
    argv = ["ddpdash", "launch"]
    for name, value in cfg.to_dict().items():
        if name == "num_procs" and cfg.devices:
            continue
        if value == default[name]:
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + name.replace("_", "-"))
        elif isinstance(value, list):
            argv += [flag, ",".join(str(v) for v in value)]
        else:
            argv += [flag, str(value)]
    return argv


# ---- launching -------------------------------------------------------------------------------
def new_run_dir(run_id: int, root: Path | None = None) -> Path:
    path = (root or runs_root()) / f"run-{run_id:05d}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def launch(engine: Engine, cfg: RunConfig, machine: Machine, *, db_url: str | None = None) -> int:
    """Validate, record the run (queued), start its detached supervisor and return the run id at once."""
    from sqlalchemy.orm import Session

    from db.runs import create_run, finish_run, update_run

    check(cfg, machine)  # raises ConfigInvalid before anything is written
    supervisor_nice()  # and LaunchError for a bad DDPDASH_SUPERVISOR_NICE
    db_url = db_url or engine.url.render_as_string(hide_password=False) or default_db_url()
    with Session(engine) as s, s.begin():
        run_id = create_run(s, key=f"ddpdash-{uuid.uuid4()}", name=cfg.name, config_json=cfg.to_json(),
                            world_size=cfg.world_size, host=socket.gethostname())
    run_dir = new_run_dir(run_id)
    (run_dir / "config.json").write_text(cfg.to_json())
    try:
        proc = _spawn(supervisor_argv(run_id, run_dir), run_dir / "supervisor.log", torchrun_env(cfg, db_url),
                      cwd=run_dir)
    except OSError as exc:
        with Session(engine) as s, s.begin():
            finish_run(s, run_id, "failed", error=f"could not start the supervisor: {exc}")
        raise LaunchError(f"could not start the supervisor: {exc}") from exc
    with Session(engine) as s, s.begin():
        update_run(s, run_id, run_dir=str(run_dir), supervisor_pid=proc.pid)
    # Reap it when it ends so it never lingers as a zombie of a long-lived dashboard.
    threading.Thread(target=proc.wait, daemon=True).start()
    return run_id


def _spawn(argv: list[str], log_path: Path, env: dict[str, str], cwd: Path) -> subprocess.Popen[bytes]:
    with open(log_path, "ab") as out:
        return subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd,
            start_new_session=True,  # outlives the dashboard or terminal that started it
        )


def spawn_torchrun(cfg: RunConfig, run_dir: Path, run_id: int, db_url: str,
                   relay_env: dict[str, str]) -> subprocess.Popen[bytes]:
    """Called by the supervisor. torchrun stays in the supervisor's session; its workers get their own.
    `relay_env` tells the ranks where the supervisor takes their metrics (trainer/relay.py)."""
    with open(run_dir / "torchrun.log", "ab") as out:
        return subprocess.Popen(
            torchrun_argv(cfg, run_dir, run_id), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            env={**torchrun_env(cfg, db_url), **relay_env}, cwd=run_dir,
        )


# ---- processes -------------------------------------------------------------------------------
def alive(pid: int | None, must_contain: str | None = None) -> bool:
    """True for a live (non-zombie) process, optionally whose command line mentions `must_contain`
    (a guard against a recycled PID)."""
    if not pid:
        return False
    try:
        p = psutil.Process(pid)
        if p.status() == psutil.STATUS_ZOMBIE:
            return False
        return must_contain is None or must_contain in " ".join(p.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def descendants(pid: int) -> list[int]:
    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def terminate_run(torchrun_pid: int | None, worker_pids: tuple[int, ...] | list[int],
                  wait_s: float = SHUTDOWN_TIMEOUT_S + STOP_MARGIN_S) -> list[int]:
    """SIGTERM torchrun (it forwards to its workers), wait its shutdown timeout plus a margin, then
    SIGKILL every recorded worker still alive: workers live in sessions of their own, so killing
    torchrun alone would orphan them (NOTES). Returns the PIDs that had to be killed."""
    known = set(worker_pids)
    if torchrun_pid and alive(torchrun_pid):
        known.update(descendants(torchrun_pid))
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(torchrun_pid, signal.SIGTERM)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if not alive(torchrun_pid) and not any(alive(p) for p in known):
            return []
        time.sleep(0.1)
    killed = []
    for pid in [torchrun_pid, *known]:
        if pid and alive(pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
    return killed


# ---- stop ------------------------------------------------------------------------------------
def stop(engine: Engine, run_id: int, timeout_s: float = SHUTDOWN_TIMEOUT_S + STOP_MARGIN_S + 2.0) -> str:
    """Stop a run; returns its final status. Nothing of the run survives."""
    from sqlalchemy.orm import Session

    from db.runs import FINAL_STATUSES, add_event, finish_run, get_run, update_run

    with Session(engine) as s, s.begin():
        run = get_run(s, run_id)
        if run.status in FINAL_STATUSES:
            return run.status
        update_run(s, run_id, status="stopping")
        add_event(s, run_id, "stop", "stop requested")
    if run.host == socket.gethostname() and alive(run.supervisor_pid, "trainer.supervisor"):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(run.supervisor_pid, signal.SIGTERM)  # type: ignore[arg-type]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with Session(engine) as s:
                run = get_run(s, run_id)
            if run.status in FINAL_STATUSES:
                return run.status
            time.sleep(0.1)
    if run.host not in ("", socket.gethostname()):
        raise StopError(f"run {run_id} runs on host {run.host}; stop it from there (ddpdash stop {run_id})")
    # The supervisor is gone or stuck: do its job.
    with Session(engine) as s:
        run = get_run(s, run_id)
    killed = terminate_run(run.torchrun_pid, run.worker_pids, wait_s=1.0)
    if alive(run.supervisor_pid, "trainer.supervisor"):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(run.supervisor_pid, signal.SIGKILL)  # type: ignore[arg-type]
    with Session(engine) as s, s.begin():
        if finish_run(s, run_id, "stopped"):
            add_event(s, run_id, "stopped", f"stopped without the supervisor; killed {len(killed)} process(es)")
        return get_run(s, run_id).status


# ---- reconciliation --------------------------------------------------------------------------
def reconcile(engine: Engine, now: float | None = None) -> list[int]:
    """Mark runs `lost` whose supervisor is gone (killing what is left of them) or, on another host,
    whose heartbeats went stale. Any process that reads runs calls this. Returns the ids marked lost."""
    from sqlalchemy.orm import Session

    from db.runs import ACTIVE_STATUSES, add_event, finish_run, list_runs

    now = now or time.time()
    host = socket.gethostname()
    lost = []
    with Session(engine) as s:
        active = list_runs(s, statuses=ACTIVE_STATUSES)
    for run in active:
        reason = _why_lost(engine, run, host, now)
        if reason is None:
            continue
        killed = terminate_run(run.torchrun_pid, run.worker_pids, wait_s=1.0) if run.host == host else []
        if killed:
            reason += f"; killed {len(killed)} leftover process(es) {killed}"
        with Session(engine) as s, s.begin():
            if finish_run(s, run.id, "lost", error=reason):
                add_event(s, run.id, "lost", reason)
                lost.append(run.id)
    return lost


def _why_lost(engine: Engine, run: RunInfo, host: str, now: float) -> str | None:
    beat = _last_heartbeat(engine, run)
    if run.host == host:
        if alive(run.supervisor_pid, "trainer.supervisor"):
            return None
        if run.status == "queued" and now - run.created_at < QUEUED_GRACE_S and run.supervisor_pid is None:
            return None  # launch() has not recorded the supervisor yet
        return f"the supervisor (pid {run.supervisor_pid}) is gone while the run was {run.status}"
    if beat is not None and now - beat > STALE_HEARTBEAT_S:
        return f"no heartbeat from host {run.host} for {now - beat:.0f} s"
    return None


def _last_heartbeat(engine: Engine, run: RunInfo) -> float | None:
    from sqlalchemy.orm import Session

    from db.runs import rank_statuses

    with Session(engine) as s:
        states = rank_statuses(s, run.id)
    beats = [b for b in [run.heartbeat_at, *(r.heartbeat_at for r in states)] if b]
    return max(beats) if beats else None


# ---- failure reports -------------------------------------------------------------------------
@dataclass(frozen=True)
class RankFailure:
    rank: int
    message: str
    traceback: str
    stderr_tail: str
    timestamp: float = 0.0

    @property
    def is_consequence(self) -> bool:
        """A peer's failure seen through the collective, not a cause of its own."""
        return any(marker in self.message for marker in CONSEQUENCE_MARKERS)


# What a rank reports when another rank died under it (gloo, NCCL, the store).
CONSEQUENCE_MARKERS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                       "NCCL communicator was aborted", "Socket Timeout", "recvBytes", "Connection refused")


def root_causes(failures: list[RankFailure]) -> list[RankFailure]:
    """The ranks that failed first-hand; if all look like consequences, the earliest."""
    causes = [f for f in failures if not f.is_consequence]
    if causes:
        return causes
    return sorted(failures, key=lambda f: f.timestamp)[:1]


def read_failures(run_dir: Path, tail_lines: int = 40) -> list[RankFailure]:
    """Failing ranks of the last attempt, from the error files `@record` leaves (torchrun layout:
    logs/<rdzv-id>_<rand>/attempt_<n>/<local_rank>/{error.json,stderr.log})."""
    attempts = sorted((run_dir / "logs").glob("*/attempt_*"), key=lambda p: int(p.name.split("_")[1]))
    if not attempts:
        return []
    failures = []
    for rank_dir in sorted(attempts[-1].iterdir(), key=lambda p: int(p.name) if p.name.isdigit() else -1):
        error_file = rank_dir / "error.json"
        if not error_file.exists():
            continue
        message, trace, stamp = _parse_error_file(error_file)
        failures.append(RankFailure(int(rank_dir.name), message, trace, tail(rank_dir / "stderr.log", tail_lines),
                                    stamp))
    return failures


def _parse_error_file(path: Path) -> tuple[str, str, float]:
    try:
        data = json.loads(path.read_text())
        inner = data.get("message", {})
        if isinstance(inner, dict):
            extra = inner.get("extraInfo", {})
            return str(inner.get("message", "")), str(extra.get("py_callstack", "")), float(extra.get("timestamp", 0))
        return str(inner), "", 0.0
    except (OSError, ValueError):
        return "unreadable error file", "", 0.0


def tail(path: Path, lines: int = 40, max_bytes: int = 64_000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def rank_log_path(run_dir: Path, rank: int, stream: str = "stderr") -> Path | None:
    """The newest attempt's log of a rank (stdout or stderr)."""
    found = sorted((run_dir / "logs").glob(f"*/attempt_*/{rank}/{stream}.log"),
                   key=lambda p: (p.stat().st_mtime, p.parent.parent.name))
    return found[-1] if found else None




# ---- deletion --------------------------------------------------------------------------------
class DeleteError(RuntimeError):
    """The run cannot be deleted now."""


def delete_run(engine: Engine, run_id: int) -> None:
    """Remove a finished run: its rows, and its folder (logs, checkpoints) when ddpdash made it.
    A hand-started run's folder belongs to the user: only its checkpoint goes."""
    import shutil

    from sqlalchemy.orm import Session

    from db.runs import delete_run_rows, get_run

    with Session(engine) as s:
        run = get_run(s, run_id)
    if run.is_active:
        raise DeleteError(f"run {run_id} is {run.status}: stop it before deleting it")
    with Session(engine) as s, s.begin():
        delete_run_rows(s, run_id)
    if not run.run_dir:
        return
    folder = Path(run.run_dir).resolve()
    if folder.parent == runs_root().resolve() and folder.name.startswith("run-"):
        shutil.rmtree(folder, ignore_errors=True)
    else:
        (folder / "checkpoint.pt").unlink(missing_ok=True)
