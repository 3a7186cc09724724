"""Building a launch, purely: from a RunConfig to the argv and environment of the processes that run
it. Nothing here starts a process (trainer/control.py does) or touches the database.

    torchrun_argv(cfg, run_dir, run_id)   the torchrun command the supervisor runs
    supervisor_argv(run_id, run_dir)      the detached supervisor the launcher starts
    cli_command(cfg)                      the `ddpdash launch` command for the same run
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from . import flight_recorder, mpi
from .config import RunConfig, settable_fields
from .rundir import RunDir

SHUTDOWN_TIMEOUT_S = 4  # torchrun's grace for workers after SIGTERM before it SIGKILLs them
RANK_MODULE = "ddpdash.trainer"  # what torchrun runs on every rank
SUPERVISOR_MODULE = "ddpdash.trainer.supervisor"
RUN_DIR_ENV = "DDPDASH_RUN_DIR"  # the run's folder, for a user's script's ranks (ddpdash.api reads requests there)
RUN_KEY_ENV = "DDPDASH_RUN_KEY"  # the run's unique key: checkpoints carry it, and only that run resumes them


def rank_argv(run_dir: RunDir, run_id: int, python: str = sys.executable, cfg: RunConfig | None = None) -> list[str]:
    """What every rank runs: ddpdash's trainer on the run's config, or the user's own script (or module)
    with its own arguments (its run id and settings then travel in the environment: script_env)."""
    if cfg is not None and cfg.module:
        return [python, "-m", cfg.module, *cfg.script_args]
    if cfg is not None and cfg.script:
        return [python, str(Path(cfg.script).expanduser()), *cfg.script_args]
    return [python, "-m", RANK_MODULE, "--config", str(run_dir.config), "--run-id", str(run_id)]


def torchrun_argv(cfg: RunConfig, run_dir: RunDir, run_id: int, python: str = sys.executable,
                  mpi_launcher: str | None = None, rendezvous: list[str] | None = None) -> list[str]:
    """The exact command that starts a run's ranks (a Slurm node's, with that node's `rendezvous`:
    trainer/slurm.node_torchrun_args): torchrun, or for the mpi backend Open MPI's mpirun (`mpi_launcher`,
    found on the PATH when not given). The database URL travels in the environment (it may hold a
    password, and argv is visible to every user of the machine)."""
    ranks = rank_argv(run_dir, run_id, python, cfg)
    if cfg.resolved_backend == "mpi":
        return mpi.mpirun_argv(cfg.world_size, run_dir.logs / mpi.LOG_FOLDER, ranks,
                               launcher=mpi_launcher or mpi.find_launcher() or "mpirun")
    # One machine: c10d on port 0, the OS picks a free port, so two runs at once never clash.
    one_machine = ["--nnodes", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0",
                   "--rdzv-id", f"ddpdash-run-{run_id}"]
    return [
        python, "-m", "torch.distributed.run",
        *(rendezvous or one_machine),
        "--nproc-per-node", str(cfg.ranks_per_node),
        "--max-restarts", str(cfg.max_restarts),
        "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S),
        "--log-dir", str(run_dir.logs),
        "--redirects", "3",
        *ranks[1:],  # torchrun runs the script (or `-m module`) with its own interpreter
    ]


def torchrun_env(cfg: RunConfig, db_url: str, base: dict[str, str] | None = None, run_key: str | None = None,
                 run_id: int | None = None, run_dir: RunDir | None = None) -> dict[str, str]:
    """The ranks' environment: the launcher's, with the run's settings, its folder (where the ranks read
    requests: trainer/requests.py) and the Flight Recorder turned on."""
    env = dict(os.environ if base is None else base)
    if run_key:
        env[RUN_KEY_ENV] = run_key
    if cfg.uses_script and run_id is not None:
        env.update(script_env(cfg, run_id))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    # One thread per rank's share of the cores: more oversubscribes the CPU and slows every rank.
    env["OMP_NUM_THREADS"] = str(max(1, cores // max(cfg.ranks_per_node, 1)))
    env["DDPDASH_DB_URL"] = db_url
    env["PYTHONUNBUFFERED"] = "1"
    if run_dir is not None:
        env[RUN_DIR_ENV] = str(run_dir.path)
        env.update({k: v for k, v in flight_recorder.rank_env(run_dir.path).items() if k not in env})
    if not cfg.uses_script:
        # The trainer runs in the user's project folder for their recipe: their `utils.py` must not stand in
        # for a module of ours or torch's, so that folder is put on sys.path by the trainer, after its imports.
        env["PYTHONSAFEPATH"] = "1"
    if cfg.devices:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in cfg.devices)
    return env


def script_env(cfg: RunConfig, run_id: int) -> dict[str, str]:
    """What a user's script learns of its run: the id (ddpdash.log() writes to it), and the form's settings
    — as JSON for ddpdash.init(), and one variable each for a script that does not import ddpdash."""
    chosen = {"backend": cfg.resolved_backend, "batch_size": cfg.batch_size, "amp": cfg.amp, "lr": cfg.lr,
              "effective_lr": cfg.effective_lr, "max_steps": cfg.max_steps, "num_epochs": cfg.num_epochs,
              "seed": cfg.seed, "params": cfg.parameters}
    env = {"DDPDASH_RUN_ID": str(run_id), "DDPDASH_SETTINGS": json.dumps(chosen)}
    env.update({f"DDPDASH_{name.upper()}": str(value) for name, value in chosen.items() if name != "params"})
    env.update({f"DDPDASH_PARAM_{key.upper()}": str(value) for key, value in cfg.parameters.items()})
    return env


def rank_workdir(cfg: RunConfig, run_dir: RunDir) -> Path:
    """Where the ranks run: the user's project folder for their script or recipe, else the run folder."""
    from .config import script_workdir

    if cfg.uses_script or cfg.uses_own_recipe:
        return script_workdir(cfg)
    return run_dir.path


def check_argv(config: Path, report: Path, python: str = sys.executable) -> list[str]:
    from .check import CHECK_MODULE

    return [python, "-m", CHECK_MODULE, "--config", str(config), "--report", str(report)]


def supervisor_argv(run_id: int, run_dir: RunDir, python: str = sys.executable) -> list[str]:
    """A local run's supervisor (a Slurm job's are in its job script: trainer/slurm.job_script)."""
    return [python, "-m", SUPERVISOR_MODULE, "--run-id", str(run_id), "--run-dir", str(run_dir.path)]


def cli_command(cfg: RunConfig) -> list[str]:
    """The `ddpdash launch` command that starts the same run (flags only where they differ from defaults;
    a script's own arguments after `--`)."""
    default = RunConfig().to_dict()
    argv = ["ddpdash", "launch"]
    settable = {f.name for f in settable_fields()}
    for name, value in cfg.to_dict().items():
        if name == "num_procs" and cfg.devices:
            continue
        if value == default[name] or name not in settable or name == "script_args":
            continue
        if name == "params":
            argv += [arg for entry in value for arg in ("--param", entry)]
            continue
        if name == "sbatch_options":
            argv += [f"--sbatch-option={entry}" for entry in value]
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + name.replace("_", "-"))
        elif isinstance(value, list):
            argv += [flag, ",".join(str(v) for v in value)]
        else:
            argv += [flag, str(value)]
    return [*argv, "--", *cfg.script_args] if cfg.script_args else argv
