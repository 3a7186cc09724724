"""Process control: every process ddpdash starts is started here, from argument lists (never a shell
string), each in a session of its own, logging to files in the run folder; and every stop, reap and
reconciliation happens here. Runs in the dashboard's and the CLI's processes (and the supervisor's,
to start torchrun).

    launch(engine, cfg, machine) -> run id   validates, queues the run; the queue starts its supervisor
                                             (a Slurm run: its job script is submitted with sbatch)
    stop(engine, run_id)                     SIGTERM through the supervisor (or Slurm); survivors are killed
    reconcile(engine)                        runs whose supervisor is gone become `lost`; Slurm runs follow
                                             their job's state
    delete_run(engine, run_id)               a finished run's rows and the folder ddpdash made
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from ddpdash.db.paths import default_db_url
from ddpdash.db.vocab import EventKind, RunStatus

from .alerts import WEBHOOK_ENV, notify_once
from .check import CheckFailure, CheckResult
from .commands import (
    SHUTDOWN_TIMEOUT_S,
    SUPERVISOR_MODULE,
    check_argv,
    rank_workdir,
    supervisor_argv,
    torchrun_argv,
    torchrun_env,
)
from .config import (
    ConfigError,
    ConfigInvalid,
    Machine,
    RunConfig,
    check,
    check_script,
    module_not_found,
    script_file,
    webhook_problem,
)
from .rundir import RunDir, new_run_dir
from .slurm import HOST as SLURM_HOST
from .slurm import Job, job_script
from .supervisor.priority import PriorityError, supervisor_nice

if TYPE_CHECKING:
    from sqlalchemy import Engine

    from ddpdash.db.runs import RunInfo

# The database functions below import SQLAlchemy when called, not here: the supervisor imports this
# module to start torchrun, and every import before that is launch latency.

log = logging.getLogger(__name__)

STOP_MARGIN_S = 2.0
STALE_HEARTBEAT_S = 60.0
QUEUED_GRACE_S = 30.0
CHECK_TIMEOUT_S = 60.0  # a recipe's import, build and first batch; its data may take a while to read
CHECK_TIMEOUT_ENV = "DDPDASH_CHECK_TIMEOUT_S"


class LaunchError(RuntimeError):
    """The run could not be started."""


class StopError(RuntimeError):
    """The run could not be stopped as asked."""


class DeleteError(RuntimeError):
    """The run cannot be deleted now."""


# ---- launching -------------------------------------------------------------------------------
def launch(engine: Engine, cfg: RunConfig, machine: Machine, *, db_url: str | None = None, sweep: str = "") -> int:
    """Validate, record the run in the queue with its folder and config, and return its id at once; the
    queue (trainer/queue.py) starts its detached supervisor now if the machine has room, else later."""
    return enqueue(engine, prepare(cfg, machine), db_url=db_url, sweep=sweep)


def prepare(cfg: RunConfig, machine: Machine) -> RunConfig:
    """The config as it will be stored, once every check passed; raises ConfigInvalid before anything is
    written (LaunchError for what is wrong with this machine rather than the settings)."""
    check(cfg, machine)
    cfg = checked_recipe_config(checked_script_config(cfg))
    try:
        supervisor_nice()
    except PriorityError as exc:
        raise LaunchError(str(exc)) from exc
    env_webhook = os.environ.get(WEBHOOK_ENV, "").strip()
    if not cfg.webhook and env_webhook and (why := webhook_problem(env_webhook)):
        raise LaunchError(f"{WEBHOOK_ENV} {why}")
    if cfg.on_slurm:
        check_slurm_target(cfg)
    return cfg


def enqueue(engine: Engine, cfg: RunConfig, *, db_url: str | None = None, sweep: str = "") -> int:
    """Queue a prepared config: its row (waiting), folder, config file and the launcher's environment."""
    from sqlalchemy.orm import Session

    from ddpdash.db.runs import add_event, create_run, finish_run, update_run

    from .queue import dispatch

    if cfg.on_slurm and cfg.nodes > 1 and engine.dialect.name == "sqlite":
        raise ConfigInvalid([ConfigError("nodes", f"is {cfg.nodes}, and the store is a SQLite file, which nodes "
                                                  "cannot share: set DDPDASH_DB_URL to a PostgreSQL database every "
                                                  "node reaches (or run on one node)")])
    db_url = db_url or engine.url.render_as_string(hide_password=False) or default_db_url()
    key = f"ddpdash-{uuid.uuid4()}"
    with Session(engine) as s, s.begin():
        # A Slurm run is Slurm's to queue: never waiting in this machine's queue (another host, admitted).
        run_id = create_run(s, key=key, name=cfg.name, config_json=cfg.to_json(), world_size=cfg.world_size,
                            host=SLURM_HOST if cfg.on_slurm else socket.gethostname(), sweep=sweep,
                            group_name=cfg.group, admitted=cfg.on_slurm, trains=cfg.what,
                            backend=cfg.resolved_backend)
    try:
        run_dir = new_run_dir(run_id)
        run_dir.config.write_text(cfg.to_json())
        env = torchrun_env(cfg, db_url, run_key=key)
        if cfg.on_slurm:
            run_dir.job_script.write_text(job_script(cfg, run_id, run_dir))
            with Session(engine) as s, s.begin():
                update_run(s, run_id, run_dir=str(run_dir.path))
            submit_slurm_job(engine, run_id, run_dir, env)
            return run_id
        fd = os.open(run_dir.launch_env, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # it may hold a password
        with os.fdopen(fd, "w") as f:
            json.dump(env, f)
    except OSError as exc:  # a full disk, an unwritable DDPDASH_HOME: the run must not wait for ever
        with Session(engine) as s, s.begin():
            finish_run(s, run_id, RunStatus.FAILED, error=f"could not write the run folder: {exc}")
        raise LaunchError(f"could not write the run folder: {exc}") from exc
    with Session(engine) as s, s.begin():
        update_run(s, run_id, run_dir=str(run_dir.path))  # last: from now on the queue may admit it (queue.is_waiting)
        add_event(s, run_id, EventKind.QUEUED, "queued")
    dispatch(engine)
    return run_id


def start_supervisor(engine: Engine, run_id: int) -> None:
    """Start an admitted run's detached supervisor with its launcher's environment (called by the queue)."""
    from sqlalchemy.orm import Session

    from ddpdash.db.runs import add_event, finish_run, get_run, update_run

    with Session(engine) as s:
        run = get_run(s, run_id)
    run_dir = RunDir(Path(run.run_dir))
    try:
        env = json.loads(run_dir.launch_env.read_text())
        proc = _spawn(supervisor_argv(run_id, run_dir), run_dir.supervisor_log, env, cwd=run_dir.path)
    except (OSError, ValueError) as exc:
        with Session(engine) as s, s.begin():
            if finish_run(s, run_id, RunStatus.FAILED, error=f"could not start the supervisor: {exc}"):
                add_event(s, run_id, EventKind.FAILED, f"could not start the supervisor: {exc}")
        return
    with Session(engine) as s, s.begin():
        update_run(s, run_id, supervisor_pid=proc.pid)
    run_dir.launch_env.unlink(missing_ok=True)  # the supervisor has it now
    # Reap it when it ends so it never lingers as a zombie of a long-lived dashboard.
    threading.Thread(target=proc.wait, daemon=True).start()


def checked_script_config(cfg: RunConfig) -> RunConfig:
    """The config as stored, once its script checks out: a script run carries its file's absolute path
    and content hash (two runs of different code are told apart on Compare), and is named after the
    script unless named. A module is looked up once, here."""
    if not cfg.uses_script:
        return cfg
    errors = check_script(cfg, find_module=False)
    path = None if errors else script_file(cfg)
    if path is None and not errors:
        errors = [module_not_found(cfg)]
    if errors:
        raise ConfigInvalid(errors)
    assert path is not None
    try:
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError as exc:
        raise ConfigInvalid([ConfigError("script" if cfg.script else "module",
                                         f"{path} cannot be read: {exc.strerror}")]) from exc
    name = path.stem if cfg.name == RunConfig().name else cfg.name
    return cfg.replace(script=str(path) if cfg.script else "", code_sha256=digest, name=name)


def resolved_recipe_config(cfg: RunConfig) -> RunConfig:
    """The config with the recipe's file, the project folder and the data as absolute paths: what the ranks
    (which run elsewhere) and the check read."""
    from .recipes import project_folder, recipe_path

    changes: dict[str, str] = {}
    if cfg.data:
        changes["data"] = str(Path(cfg.data).expanduser().resolve())
    if cfg.uses_own_recipe:
        if cfg.recipe.rpartition(":")[0].endswith(".py"):
            changes["recipe"] = f"{recipe_path(cfg)}:{cfg.recipe.rpartition(':')[2]}"
        changes["workdir"] = str(project_folder(cfg))
    return cfg.replace(**changes) if changes else cfg


def check_timeout_s() -> float:
    try:
        return float(os.environ.get(CHECK_TIMEOUT_ENV, CHECK_TIMEOUT_S))
    except ValueError:
        return CHECK_TIMEOUT_S


def check_recipe(cfg: RunConfig, timeout_s: float | None = None) -> CheckResult:
    """Run the check (trainer/check.py) in a child process of its own session, killed whole at the time limit."""
    import tempfile

    cfg = resolved_recipe_config(cfg)
    timeout_s = check_timeout_s() if timeout_s is None else timeout_s
    with tempfile.TemporaryDirectory(prefix="ddpdash-check-") as tmp:
        config, report = Path(tmp) / "config.json", Path(tmp) / "report.json"
        config.write_text(cfg.to_json())
        env = {**os.environ, "PYTHONSAFEPATH": "1", "PYTHONUNBUFFERED": "1"}
        cwd = Path(cfg.workdir) if cfg.uses_own_recipe else Path(tmp)
        if not cwd.is_dir():
            return CheckResult(failures=[CheckFailure("workdir", f"{cwd} is not a folder")])
        with open(Path(tmp) / "output.log", "w+b") as output:
            proc = subprocess.Popen(check_argv(config, report), stdin=subprocess.DEVNULL, stdout=output,
                                    stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True)
            try:
                code = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)  # the check and anything the recipe started
                proc.wait()
                return CheckResult(failures=[CheckFailure(
                    "recipe", f"the check timed out after {timeout_s:g} s: importing or building the recipe, or "
                              f"its first batch, took longer ({CHECK_TIMEOUT_ENV} sets the limit)",
                    _tail(output))])
            if report.exists():
                return CheckResult.from_json(report.read_text())
            return CheckResult(failures=[CheckFailure(
                "recipe", f"the check's process exited with code {code} before it could report (did the recipe call "
                          "sys.exit() or crash the interpreter?)", _tail(output))])


def _tail(output: Any, limit: int = 4000) -> str:
    output.seek(0)
    return output.read().decode("utf-8", "replace")[-limit:]


def checked_recipe_config(cfg: RunConfig) -> RunConfig:
    """The config as stored, once its recipe checks out (nothing to check for the demos): absolute paths,
    and for a recipe of the user's the file build() is in with its content hash, so two runs of different
    code tell apart; named after that file unless named."""
    if cfg.uses_demo or cfg.uses_script:
        return cfg
    result = check_recipe(cfg)
    if result.failures:
        raise ConfigInvalid([ConfigError(f.field, f.message, f.detail) for f in result.failures])
    cfg = resolved_recipe_config(cfg)
    assert result.report is not None
    if not result.report.code_file:
        return cfg
    path = Path(result.report.code_file)
    try:
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError as exc:
        raise ConfigInvalid([ConfigError("recipe", f"{path} cannot be read: {exc.strerror}")]) from exc
    name = path.stem if cfg.name == RunConfig().name else cfg.name
    return cfg.replace(code_file=str(path), code_sha256=digest, name=name)


def _spawn(argv: list[str], log_path: Path, env: dict[str, str], cwd: Path) -> subprocess.Popen[bytes]:
    with open(log_path, "ab") as out:
        return subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd,
            start_new_session=True,  # outlives the dashboard or terminal that started it
        )


def spawn_torchrun(cfg: RunConfig, run_dir: RunDir, run_id: int, db_url: str,
                   relay_env: dict[str, str], rendezvous: list[str] | None = None) -> subprocess.Popen[bytes]:
    """Called by the supervisor. torchrun stays in the supervisor's session; its workers get their own.
    `relay_env` tells the ranks where the supervisor takes their metrics (trainer/relay.py); `rendezvous`
    is a Slurm node's part of the job's (commands.torchrun_argv)."""
    from .flight_recorder import TIMEOUT_DUMP

    run_dir.flight_recorder(TIMEOUT_DUMP).mkdir(parents=True, exist_ok=True)  # NCCL's watchdog writes, not makes, it
    with open(run_dir.torchrun_log, "ab") as out:
        return subprocess.Popen(
            torchrun_argv(cfg, run_dir, run_id, rendezvous=rendezvous), stdin=subprocess.DEVNULL, stdout=out,
            stderr=subprocess.STDOUT,
            env={**torchrun_env(cfg, db_url, run_id=run_id, run_dir=run_dir), **relay_env},
            cwd=rank_workdir(cfg, run_dir),
        )


# ---- Slurm ---------------------------------------------------------------------------------------
SLURM_TIMEOUT_S = 30.0
SLURM_STOP_WAIT_S = 20.0  # after the job is cancelled, for Slurm to end its processes on every node


class SlurmError(RuntimeError):
    """Slurm's commands are missing or did not answer."""


def slurm_missing() -> str | None:
    """Why this machine cannot submit to Slurm, or None."""
    missing = [tool for tool in ("sbatch", "squeue", "scancel") if shutil.which(tool) is None]
    return f"Slurm's {', '.join(missing)} not on the PATH" if missing else None


def _slurm(argv: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=SLURM_TIMEOUT_S, env=env,
                              stdin=subprocess.DEVNULL)
    except FileNotFoundError as exc:
        raise SlurmError(f"{argv[0]} is not on the PATH") from exc
    except subprocess.TimeoutExpired as exc:
        raise SlurmError(f"{argv[0]} did not answer in {SLURM_TIMEOUT_S:g} s") from exc


def slurm_partitions() -> list[str]:
    """The cluster's partitions (the default first), from sinfo; [] where Slurm does not answer."""
    try:
        out = _slurm(["sinfo", "-h", "-o", "%P"])
    except SlurmError:
        return []
    names = [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []
    default = [n.rstrip("*") for n in names if n.endswith("*")]
    return list(dict.fromkeys([*default, *(n.rstrip("*") for n in names)]))


def check_slurm_target(cfg: RunConfig) -> None:
    """Before anything is written: Slurm is here, and the partition asked for exists."""
    why = slurm_missing()
    if why:
        raise ConfigInvalid([ConfigError("launcher", f"is slurm, but {why}: install Slurm's client commands "
                                                     "(or use the local launcher)")])
    if cfg.partition:
        known = slurm_partitions()
        if known and cfg.partition not in known:
            raise ConfigInvalid([ConfigError("partition", f"{cfg.partition!r} is not a partition of this cluster; "
                                                          f"it has {', '.join(known)}")])


def submit_slurm_job(engine: Engine, run_id: int, run_dir: RunDir, env: dict[str, str]) -> str:
    """sbatch the run's job script with the launcher's environment; the job id is recorded on the run. A
    refusal fails the run with sbatch's own words and raises LaunchError."""
    from sqlalchemy.orm import Session

    from ddpdash.db.runs import add_event, finish_run, update_run

    from .slurm import sbatch_argv

    try:
        out = _slurm(sbatch_argv(run_dir.job_script), env=env)
        why = "" if out.returncode == 0 else (out.stderr or out.stdout).strip() or f"exit code {out.returncode}"
    except SlurmError as exc:
        out, why = None, str(exc)
    job_id = out.stdout.strip().split(";")[0] if out is not None and not why else ""
    if why or not job_id.isdecimal():
        why = why or f"sbatch printed no job id: {out.stdout.strip()!r}"  # type: ignore[union-attr]
        with Session(engine) as s, s.begin():
            if finish_run(s, run_id, RunStatus.FAILED, error=f"sbatch refused the job: {why}"):
                add_event(s, run_id, EventKind.FAILED, f"sbatch refused the job: {why}")
        raise LaunchError(f"sbatch refused the job: {why}")
    with Session(engine) as s, s.begin():
        update_run(s, run_id, job_id=job_id, job_state="PENDING")
        add_event(s, run_id, EventKind.QUEUED, f"submitted to Slurm as job {job_id}")
    return job_id


def slurm_jobs(job_ids: list[str]) -> dict[str, Job]:
    """What Slurm says of these jobs, by id; a job it no longer knows is absent. SlurmError when it does not
    answer (then nothing may be concluded about any job)."""
    from .slurm import QUEUE_FORMAT, parse_scontrol_job, parse_squeue

    if not job_ids:
        return {}
    out = _slurm(["squeue", "-h", "-t", "all", "-j", ",".join(job_ids), "-o", QUEUE_FORMAT])
    if out.returncode != 0 and "Invalid job id" not in out.stderr:
        raise SlurmError(f"squeue failed: {out.stderr.strip()}")
    jobs = parse_squeue(out.stdout) if out.returncode == 0 else {}
    for job_id in job_ids:
        if job_id not in jobs:  # squeue forgets a job sooner than scontrol in some setups: ask it too
            shown = _slurm(["scontrol", "show", "job", "-o", job_id])
            job = parse_scontrol_job(shown.stdout) if shown.returncode == 0 else None
            if job is not None:
                jobs[job_id] = job
    return jobs


# What scancel says of a job that ended meanwhile (the stop raced its end): nothing is left to cancel.
JOB_ALREADY_GONE = ("already completing or completed", "Invalid job id specified")


def cancel_slurm_job(job_id: str, signal_name: str | None = None) -> None:
    """scancel a job (all of it), or with `signal_name` signal its steps' processes on every node."""
    argv = ["scancel", *([f"--signal={signal_name}"] if signal_name else []), job_id]
    out = _slurm(argv)
    said = (out.stderr or out.stdout).strip()
    if out.returncode != 0 and not any(gone in said for gone in JOB_ALREADY_GONE):
        raise StopError(f"scancel {job_id} failed: {said}")


def stop_slurm_run(engine: Engine, run: RunInfo, timeout_s: float) -> str:
    """A pending job is cancelled at once; a running one gets SIGTERM on every rank through Slurm (each
    node's supervisor stops its torchrun and records the stop), and after the grace is cancelled whole, so
    nothing survives on any node."""
    from sqlalchemy.orm import Session

    from ddpdash.db.runs import add_event, finish_run, get_run, update_run

    from .slurm import WAITING_STATES

    if not run.job_id:
        raise StopError(f"run {run.id} has no Slurm job yet (it is being submitted); try again in a moment")
    job = slurm_jobs([run.job_id]).get(run.job_id)
    if job is None or job.is_final or (job.state in WAITING_STATES and run.status == RunStatus.QUEUED):
        if job is not None and not job.is_final:
            cancel_slurm_job(run.job_id)
        with Session(engine) as s, s.begin():
            if finish_run(s, run.id, RunStatus.CANCELLED, job_state=f"CANCELLED (was {job.state if job else '?'})"):
                add_event(s, run.id, EventKind.CANCELLED, f"Slurm job {run.job_id} cancelled before it started")
            return get_run(s, run.id).status
    with Session(engine) as s, s.begin():
        update_run(s, run.id, status=RunStatus.STOPPING)
        add_event(s, run.id, EventKind.STOP, "stop requested")
    cancel_slurm_job(run.job_id, "TERM")
    if not wait_until_final(engine, run.id, timeout_s):
        log.warning("run %d did not stop in %.0f s: cancelling Slurm job %s", run.id, timeout_s, run.job_id)
    cancel_slurm_job(run.job_id)  # whatever is left on any node
    deadline = time.monotonic() + SLURM_STOP_WAIT_S
    while time.monotonic() < deadline:
        job = slurm_jobs([run.job_id]).get(run.job_id)
        if job is None or job.is_final:
            break
        time.sleep(0.3)
    with Session(engine) as s, s.begin():
        if finish_run(s, run.id, RunStatus.STOPPED, job_state=job.describe if job else "gone"):
            add_event(s, run.id, EventKind.STOPPED, f"stopped; Slurm cancelled job {run.job_id}")
        return get_run(s, run.id).status


def wait_until_final(engine: Engine, run_id: int, timeout_s: float) -> bool:
    """Whether the run has a final status within `timeout_s` (whoever records it)."""
    from sqlalchemy.orm import Session

    from ddpdash.db.runs import get_run

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with Session(engine) as s:
            if get_run(s, run_id).status in RunStatus.FINAL:
                return True
        time.sleep(0.2)
    return False


def reconcile_slurm(engine: Engine, runs: list[RunInfo], now: float) -> list[int]:
    """Slurm runs against their jobs: a waiting or running job's state is kept on the run (the pages show it);
    a job that ended, or that Slurm no longer knows, while its run is still active gives the run its outcome
    (no supervisor was left to record one: a time limit, a cancel by hand, a node that failed, a refusal).
    Returns the ids given an outcome."""
    from sqlalchemy.orm import Session

    from ddpdash.db.runs import add_event, finish_run, update_run

    from .slurm import job_outcome

    submitted = [r for r in runs if r.job_id]
    try:
        jobs = slurm_jobs([r.job_id for r in submitted])
    except SlurmError as exc:
        log.warning("cannot read the Slurm runs' jobs: %s", exc)
        return []
    ended = []
    for run in runs:
        if not run.job_id and now - run.created_at > QUEUED_GRACE_S:  # its launcher died before sbatch answered
            with Session(engine) as s, s.begin():
                if finish_run(s, run.id, RunStatus.LOST, error="it was never submitted to Slurm"):
                    add_event(s, run.id, EventKind.LOST, "it was never submitted to Slurm")
                    ended.append(run.id)
    for run in submitted:
        job = jobs.get(run.job_id)
        outcome = (RunStatus.LOST, f"its Slurm job {run.job_id} is gone (Slurm no longer knows it)") \
            if job is None else job_outcome(job)
        if outcome is None:
            assert job is not None
            if job.describe != run.job_state:
                with Session(engine) as s, s.begin():
                    update_run(s, run.id, job_state=job.describe)
            continue
        status, why = outcome
        refusals = RunDir(Path(run.run_dir)).refusals() if run.run_dir else []
        if refusals:
            status, why = RunStatus.FAILED, "; ".join(p.read_text().strip() for p in refusals)
        with Session(engine) as s, s.begin():
            if finish_run(s, run.id, status, error=why if status != RunStatus.SUCCEEDED else "",
                          job_state=job.describe if job else "gone"):
                kind = {RunStatus.SUCCEEDED: EventKind.FINISHED, RunStatus.STOPPED: EventKind.STOPPED,
                        RunStatus.LOST: EventKind.LOST}.get(status, EventKind.FAILED)
                add_event(s, run.id, kind, why)
                ended.append(run.id)
        if status in (RunStatus.FAILED, RunStatus.LOST):
            notify_once(engine, run.id, run.name, run.config, EventKind.FAILED if status == RunStatus.FAILED
                        else EventKind.LOST, why)
    return ended


# ---- processes -------------------------------------------------------------------------------
PY_SPY_TIMEOUT_S = 15.0


def py_spy_dump(pid: int) -> tuple[bool, str]:
    """py-spy's dump of a process (JSON, native frames too): (True, its output) or (False, why not)."""
    import shutil
    import sys

    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    try:
        out = subprocess.run([exe, "dump", "--pid", str(pid), "--json", "--native"], capture_output=True, text=True,
                             timeout=PY_SPY_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        return False, "py-spy is not installed (pip install py-spy)"
    except subprocess.TimeoutExpired:
        return False, f"py-spy took longer than {PY_SPY_TIMEOUT_S:g} s"
    if out.returncode != 0:
        return False, (out.stderr or out.stdout).strip() or f"py-spy exited with code {out.returncode}"
    return True, out.stdout


ANALYSER_TIMEOUT_S = 30.0


def analyse_flight_recorder(folder: Path, expect: set[int] | None = None, wait_s: float = 0.0) -> dict[str, str]:
    """torch's Flight Recorder analyser over one dump folder, in a child process (it unpickles the ranks'
    dumps), once the ranks in `expect` have dumped or `wait_s` has passed (torch loads meanwhile):
    {"finding": a line, "report": what it printed}."""
    import sys

    from .flight_recorder import ANALYSER_MODULE

    argv = [sys.executable, "-m", ANALYSER_MODULE, str(folder), "--expect", ",".join(map(str, sorted(expect or ()))),
            "--wait", str(wait_s)]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=ANALYSER_TIMEOUT_S + wait_s,
                             stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return {"finding": f"the Flight Recorder analyser took longer than {ANALYSER_TIMEOUT_S:g} s", "report": ""}
    try:
        return dict(json.loads(out.stdout))
    except ValueError:
        why = (out.stderr.strip().splitlines() or [f"exit code {out.returncode}"])[-1]
        return {"finding": f"the Flight Recorder analyser failed: {why}", "report": out.stderr[-4000:]}


def signal_rank(pid: int, name: str) -> bool:
    """Send a named signal to a live process; False when it is gone."""
    try:
        os.kill(pid, getattr(signal, name))
    except (ProcessLookupError, PermissionError):
        return False
    return True


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


def supervisor_alive(run: RunInfo) -> bool:
    return alive(run.supervisor_pid, SUPERVISOR_MODULE)


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
    """Stop a run; returns its final status. Nothing of the run survives. A run hosted on another
    machine raises StopError before anything is changed: only that machine can signal its processes."""
    from sqlalchemy.orm import Session

    from ddpdash.db.runs import add_event, finish_run, get_run, update_run

    from .queue import cancel

    with Session(engine) as s:
        run = get_run(s, run_id)
    if run.status in RunStatus.FINAL:
        return run.status
    if run.host == SLURM_HOST:
        return stop_slurm_run(engine, run, timeout_s)
    if run.host in ("", socket.gethostname()) and cancel(engine, run_id):
        return RunStatus.CANCELLED  # it was waiting in the queue: nothing ran
    if run.host not in ("", socket.gethostname()):
        raise StopError(f"run {run_id} runs on host {run.host}; stop it from there (ddpdash stop {run_id})")
    with Session(engine) as s, s.begin():
        update_run(s, run_id, status=RunStatus.STOPPING)
        add_event(s, run_id, EventKind.STOP, "stop requested")
    if supervisor_alive(run):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(run.supervisor_pid, signal.SIGTERM)  # type: ignore[arg-type]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with Session(engine) as s:
                run = get_run(s, run_id)
            if run.status in RunStatus.FINAL:
                return run.status
            time.sleep(0.1)
    # The supervisor is gone or stuck: do its job.
    with Session(engine) as s:
        run = get_run(s, run_id)
    killed = terminate_run(run.torchrun_pid, run.worker_pids, wait_s=1.0)
    if supervisor_alive(run):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(run.supervisor_pid, signal.SIGKILL)  # type: ignore[arg-type]
    with Session(engine) as s, s.begin():
        if finish_run(s, run_id, RunStatus.STOPPED):
            add_event(s, run_id, EventKind.STOPPED, f"stopped without the supervisor; killed {len(killed)} process(es)")
        return get_run(s, run_id).status


def stop_sweep(engine: Engine, sweep: str) -> dict[int, str]:
    """Stop every run of a sweep: the waiting ones are cancelled first (so none starts meanwhile), then the
    running ones stopped. Returns each run's final status."""
    from sqlalchemy.orm import Session

    from ddpdash.db.runs import sweep_run_ids

    from .queue import cancel

    with Session(engine) as s:
        ids = sweep_run_ids(s, sweep)
    if not ids:
        raise StopError(f"no sweep named {sweep!r}")
    out = {run_id: RunStatus.CANCELLED for run_id in ids if cancel(engine, run_id)}
    for run_id in ids:
        if run_id not in out:
            out[run_id] = stop(engine, run_id)
    return out


# ---- reconciliation --------------------------------------------------------------------------
def reconcile(engine: Engine, now: float | None = None) -> list[int]:
    """Mark runs `lost` whose supervisor is gone (killing what is left of them) or, on another host,
    whose heartbeats went stale. Any process that reads runs calls this. Returns the ids marked lost."""
    from sqlalchemy.orm import Session

    from ddpdash.db.runs import add_event, finish_run, list_runs

    now = now or time.time()
    host = socket.gethostname()
    lost = []
    with Session(engine) as s:
        active = list_runs(s, statuses=RunStatus.ACTIVE)
    on_slurm = [r for r in active if r.host == SLURM_HOST]
    if on_slurm:
        lost += reconcile_slurm(engine, on_slurm, now)
    for run in active:
        if run.host == SLURM_HOST:
            continue
        reason = _why_lost(engine, run, host, now)
        if reason is None:
            continue
        killed = terminate_run(run.torchrun_pid, run.worker_pids, wait_s=1.0) if run.host == host else []
        if killed:
            reason += f"; killed {len(killed)} leftover process(es) {killed}"
        with Session(engine) as s, s.begin():
            if finish_run(s, run.id, RunStatus.LOST, error=reason):
                add_event(s, run.id, EventKind.LOST, reason)
                lost.append(run.id)
        if run.id in lost:  # its supervisor, which posts the run's alerts, is gone: this process posts this one
            notify_once(engine, run.id, run.name, run.config, EventKind.LOST, reason)
    if any(r.status == RunStatus.QUEUED and r.admitted_at is None and r.host == host for r in active):
        from .queue import dispatch

        dispatch(engine)  # a run whose supervisor died never handed its devices on: waiting runs may fit now
    return lost


def _why_lost(engine: Engine, run: RunInfo, host: str, now: float) -> str | None:
    """Why an active run is lost, or None while it is not. A run on this host with a live supervisor is
    the supervisor's to judge; every other run — on another host, started by hand, or whose supervisor
    died — by its ranks' heartbeats, and on this host by its recorded processes too."""
    beat = _last_heartbeat(engine, run)
    processes = (run.torchrun_pid, *run.worker_pids)
    # Training means a rank alive: torchrun's agent alone only lingers on its way out (or to a restart).
    training = any(alive(pid) for pid in run.worker_pids) if run.worker_pids else alive(run.torchrun_pid)
    if run.host == host and run.supervisor_pid is not None:
        if supervisor_alive(run):
            return None
        if training and beat is not None and now - beat <= STALE_HEARTBEAT_S:
            _note_supervisor_gone(engine, run)  # the ranks write the store themselves now
            return None
        return f"the supervisor (pid {run.supervisor_pid}) is gone while the run was {run.status}"
    if run.status == RunStatus.QUEUED and run.supervisor_pid is None:
        if run.admitted_at is None and not run.run_dir and now - run.created_at >= QUEUED_GRACE_S:
            return "it was never fully queued: its launcher stopped while writing its folder"
        if run.admitted_at is None or now - run.admitted_at < QUEUED_GRACE_S:
            return None  # waiting in the queue (or being queued), or admitted and its supervisor not yet recorded
        return "its supervisor never started"
    if run.host == host and any(processes):
        # Its processes are known here: they are the truth (a script that never logs has no heartbeat).
        return None if training else "its supervisor and its training processes are gone"
    last = beat if beat is not None else run.created_at
    if now - last > STALE_HEARTBEAT_S:
        where = f"host {run.host}" if run.host and run.host != host else "its ranks"
        return f"no heartbeat from {where} for {now - last:.0f} s"
    return None


def _note_supervisor_gone(engine: Engine, run: RunInfo) -> None:
    """The supervisor died but the ranks still beat: they fall back to writing the store directly, and
    rank 0 records the outcome. From now on the run is judged like a hand-started one."""
    from sqlalchemy.orm import Session

    from ddpdash.db.runs import add_event, update_run

    with Session(engine) as s, s.begin():
        update_run(s, run.id, supervisor_pid=None)
        add_event(s, run.id, EventKind.SUPERVISOR_LOST,
                  f"the supervisor (pid {run.supervisor_pid}) is gone; the ranks go on and write their metrics "
                  "themselves, and rank 0 records the outcome")


def _last_heartbeat(engine: Engine, run: RunInfo) -> float | None:
    from sqlalchemy.orm import Session

    from ddpdash.db.runs import rank_rows

    with Session(engine) as s:
        states = rank_rows(s, run.id)
    beats = [b for b in [run.heartbeat_at, *(r.heartbeat_at for r in states)] if b]
    return max(beats) if beats else None


# ---- deletion --------------------------------------------------------------------------------
def delete_run(engine: Engine, run_id: int) -> None:
    """Remove a finished run: its rows, and its folder (logs, checkpoints) when ddpdash made it.
    A hand-started run's folder belongs to the user: only its checkpoint goes."""
    from sqlalchemy.orm import Session

    from ddpdash.db.runs import delete_run_rows, get_run

    with Session(engine) as s:
        run = get_run(s, run_id)
    if run.is_active:
        raise DeleteError(f"run {run_id} is {run.status}: stop it before deleting it")
    with Session(engine) as s, s.begin():
        delete_run_rows(s, run_id)
    if not run.run_dir:
        return
    folder = RunDir(Path(run.run_dir))
    if folder.made_by_ddpdash:
        shutil.rmtree(folder.path, ignore_errors=True)
    else:
        folder.checkpoint.unlink(missing_ok=True)
