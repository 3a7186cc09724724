"""Slurm as a launch target, purely: the job script a run is submitted as, the per-node torchrun's
rendezvous, Slurm's job states in ddpdash's words, and the checks on what a user may hand to sbatch.
Nothing here starts a process: trainer/control.py submits, cancels and reads jobs.

    job_script(cfg, run_id, run_dir)   the batch script (one per-node supervisor per node, under srun)
    job_outcome(job)                   the final status and reason a finished job gives its run
    parse_squeue(text)                 job states from `squeue -o QUEUE_FORMAT`

A job runs `srun --ntasks-per-node=1 python -m ddpdash.trainer.supervisor … --slurm` : one supervisor per
node, each starting torchrun for its node with a static rendezvous on the first node (measured here:
c10d's rendezvous ended 4 of 11 two-node jobs with a worker's SIGABRT at exit, static 0 of 7; see
shared/NOTES.md), and relaying its ranks' metrics to the store. Standard library only.
"""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from ddpdash.db.vocab import RunStatus

from .commands import SUPERVISOR_MODULE
from .config import RunConfig
from .rundir import RunDir

HOST = "slurm"  # runs.host of a Slurm run: the local queue and local PIDs are not its
QUEUE_FORMAT = "%i|%T|%r|%N"  # job id, state, reason, node list
FIRST_PORT, PORTS = 20000, 10000  # rendezvous ports: below Linux's ephemeral range (32768-60999)

# Slurm's job states, as ddpdash's run statuses (`squeue --states`, `scontrol show job`).
WAITING_STATES = frozenset({"PENDING", "REQUEUED", "REQUEUE_HOLD", "CONFIGURING", "RESV_DEL_HOLD"})
RUNNING_STATES = frozenset({"RUNNING", "COMPLETING", "SUSPENDED", "STOPPED", "SIGNALING", "STAGE_OUT", "RESIZING"})
FINAL_STATES: dict[str, tuple[str, str]] = {
    "COMPLETED": (RunStatus.SUCCEEDED, "the Slurm job completed"),
    "CANCELLED": (RunStatus.STOPPED, "the Slurm job was cancelled"),
    "FAILED": (RunStatus.FAILED, "the Slurm job failed"),
    "NODE_FAIL": (RunStatus.FAILED, "a node of the Slurm job failed"),
    "OUT_OF_MEMORY": (RunStatus.FAILED, "the Slurm job ran out of memory"),
    "BOOT_FAIL": (RunStatus.FAILED, "a node of the Slurm job failed to boot"),
    "DEADLINE": (RunStatus.FAILED, "the Slurm job reached its deadline"),
    "TIMEOUT": (RunStatus.FAILED, "time limit reached"),
    "PREEMPTED": (RunStatus.FAILED, "the Slurm job was preempted"),
    "REVOKED": (RunStatus.FAILED, "the Slurm job was revoked"),
    "SPECIAL_EXIT": (RunStatus.FAILED, "the Slurm job ended in a special exit state"),
}

# sbatch options ddpdash sets from the run's settings: an extra option may not set them again.
OWN_OPTIONS = frozenset({"nodes", "ntasks", "ntasks-per-node", "output", "error", "job-name", "parsable", "wrap",
                         "partition", "time", "account", "qos", "open-mode", "chdir", "export", "cpus-per-task",
                         "gpus-per-node", "array", "test-only"})
_OPTION = re.compile(r"--([a-z][a-z0-9-]*)(=([A-Za-z0-9_.:,@%+/=-]+))?")
_WORD = re.compile(r"[A-Za-z0-9_.,+-]*")
_TIME = re.compile(r"(\d+)(:\d{1,2}){0,2}|\d+-\d+(:\d{1,2}){0,2}|UNLIMITED|INFINITE")


@dataclass(frozen=True)
class Job:
    """A job as Slurm reports it."""

    job_id: str
    state: str  # PENDING, RUNNING, COMPLETED, ...
    reason: str = ""  # why it waits (Resources, Priority, ...) or how it ended; "None" is left out
    nodes: str = ""  # Slurm's node list, e.g. node[1-2]

    @property
    def describe(self) -> str:
        """The job for the pages, e.g. "PENDING (Resources)" or "RUNNING on node[1-2]"."""
        text = self.state
        if self.reason:
            text += f" ({self.reason})"
        if self.nodes and self.state not in WAITING_STATES:
            text += f" on {self.nodes}"
        return text

    @property
    def is_final(self) -> bool:
        return self.state in FINAL_STATES


def parse_squeue(text: str) -> dict[str, Job]:
    """`squeue -h -o QUEUE_FORMAT` output, by job id."""
    jobs = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) != 4 or not parts[0]:
            continue
        job_id, state, reason, nodes = parts
        state = state.split()[0].rstrip("+") if state else ""  # "CANCELLED by 0" in some versions
        jobs[job_id] = Job(job_id, state, "" if reason in ("None", "(null)") else reason,
                           "" if nodes in ("(null)", "") else nodes)
    return jobs


def parse_scontrol_job(text: str) -> Job | None:
    """One job from `scontrol show job -o ID`; None when Slurm no longer knows it."""
    fields = dict(item.split("=", 1) for item in text.split() if "=" in item)
    if "JobId" not in fields or "JobState" not in fields:
        return None
    reason = fields.get("Reason", "")
    nodes = fields.get("NodeList", "")
    return Job(fields["JobId"], fields["JobState"], "" if reason in ("None", "(null)") else reason,
               "" if nodes == "(null)" else nodes)


def job_outcome(job: Job) -> tuple[str, str] | None:
    """The final status a finished job gives its run, and why; None while it waits or runs."""
    if not job.is_final:
        return None
    status, why = FINAL_STATES[job.state]
    return status, f"{why} (Slurm job {job.job_id}: {job.state}{f', {job.reason}' if job.reason else ''})"


def master_port(job_id: str) -> int:
    """The rendezvous port of a job, the same on every node: from its id (two jobs on one node differ)."""
    return FIRST_PORT + int(job_id) % PORTS


# ---- what a user may hand to sbatch -----------------------------------------------------------------------
def option_problem(option: str) -> str | None:
    """Why `option` cannot be an extra sbatch option, or None: one `--key` or `--key=value`, no spaces or
    shell characters, and not one of the options ddpdash sets from the run's own settings."""
    match = _OPTION.fullmatch(option)
    if not match:
        return (f"must be one --key=value each (letters, digits and .:,@%+/=_- in the value, no spaces), "
                f"got {option!r}")
    if match.group(1) in OWN_OPTIONS:
        return f"--{match.group(1)} is set by ddpdash from the run's own settings (nodes, partition, time_limit, …)"
    return None


def word_problem(value: str) -> str | None:
    if _WORD.fullmatch(value) and len(value) <= 200:
        return None
    return f"must be a Slurm name (letters, digits and _.,+-), got {value!r}"


def time_limit_problem(value: str) -> str | None:
    """Slurm's time formats: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS (empty: the partition's)."""
    if not value or _TIME.fullmatch(value):
        return None
    return f"must be a Slurm time like 30, 00:30:00 or 1-12:00:00, got {value!r}"


# ---- the job script ---------------------------------------------------------------------------------------
def sbatch_lines(cfg: RunConfig, run_id: int | str, run_dir: RunDir) -> list[str]:
    """The job's sbatch options, from the run's settings (checked by config.slurm_errors)."""
    options = [f"--job-name=ddpdash-{run_id}", f"--nodes={cfg.nodes}", "--ntasks-per-node=1",
               f"--output={run_dir.slurm_output}", "--open-mode=append"]
    if cfg.uses_cuda:
        options.append(f"--gpus-per-node={cfg.ranks_per_node}")
    else:
        options.append(f"--cpus-per-task={cfg.ranks_per_node}")  # a core per rank, where Slurm binds tasks
    for flag, value in (("partition", cfg.partition), ("time", cfg.time_limit), ("account", cfg.account),
                        ("qos", cfg.qos)):
        if value:
            options.append(f"--{flag}={value}")
    return [*options, *cfg.sbatch_options]


def job_script(cfg: RunConfig, run_id: int | str, run_dir: RunDir, python: str = sys.executable) -> str:
    """The batch script, as written into the run folder and shown on the pages. The database URL and the
    launcher's environment reach the job through sbatch's environment (it may hold a password), not here."""
    supervisor = [python, "-m", SUPERVISOR_MODULE, "--run-id", str(run_id), "--run-dir", str(run_dir.path),
                  "--slurm"]
    srun = ["srun", "--ntasks-per-node=1", "--kill-on-bad-exit=0", f"--output={run_dir.node_supervisor_log('%n')}",
            *supervisor]
    return "\n".join([
        "#!/bin/bash",
        f"# ddpdash run #{run_id} ({cfg.name}): {cfg.nodes} node(s) x {cfg.ranks_per_node} rank(s). Written by",
        "# ddpdash, which submitted it with `sbatch --parsable` and its own environment (DDPDASH_DB_URL, …).",
        *(f"#SBATCH {shlex.quote(option)}" for option in sbatch_lines(cfg, run_id, run_dir)),
        "",
        "# One ddpdash supervisor per node: each starts torchrun for its node and relays its ranks' metrics.",
        "exec " + shlex.join(srun),
        "",
    ])


def sbatch_argv(script: Path) -> list[str]:
    return ["sbatch", "--parsable", str(script)]


def node_torchrun_args(nnodes: int, node_rank: int, master_addr: str, port: int) -> list[str]:
    """A node's part of a static rendezvous: every node knows its rank and the first node's address."""
    return ["--nnodes", str(nnodes), "--node-rank", str(node_rank), "--master-addr", master_addr,
            "--master-port", str(port)]


# ---- the store on a node ----------------------------------------------------------------------------------
NETWORK_FILESYSTEMS = frozenset({"nfs", "nfs4", "lustre", "gpfs", "cifs", "smb3", "smbfs", "ceph", "beegfs",
                                 "glusterfs", "fuse.glusterfs", "fuse.sshfs", "9p", "afs", "panfs", "wekafs"})


def filesystem_of(path: Path, mounts: str) -> str:
    """The type of the file system `path` is on, from /proc/mounts' text (its longest mount point)."""
    best, kind = "", ""
    target = str(path)
    for line in mounts.splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        point = parts[1].replace("\\040", " ")
        if (target == point or target.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
            best, kind = point, parts[2]
    return kind


def sqlite_on_network_problem(db_path: Path, mounts: str) -> str | None:
    """Why a node must not write this SQLite file: it is on a network file system, where SQLite's locks do
    not hold and concurrent writers corrupt it."""
    kind = filesystem_of(db_path, mounts)
    if kind.lower() in NETWORK_FILESYSTEMS:
        return (f"the SQLite store {db_path} is on a network file system ({kind}): SQLite's locking does not hold "
                "there and the file would be corrupted. Use PostgreSQL (DDPDASH_DB_URL) for Slurm runs, or put "
                "the SQLite file on a local disk")
    return None
