"""The run folder's layout, in one place: every path inside a run's folder is named here.

    $DDPDASH_HOME/runs/run-NNNNN/
        config.json          the RunConfig, written once by the launcher (or by a user for a hand-started run)
        checkpoint.pt        the checkpoint a restarted attempt resumes from
        checkpoint.pending-NNNNNNNNNN.pt   a newer one, not yet every rank's metrics up to its step are
                             stored; the supervisor promotes it to checkpoint.pt once they are
        launch.env.json      the launcher's environment, kept (mode 0600) while the run waits in the queue, so
                             its supervisor starts as if launched then, whoever admits it; removed at start
        stacks/rank<N>.txt   a rank's own dump of its threads (faulthandler), when py-spy cannot attach
        requests/<id>.json   what the dashboard or CLI asks of the running ranks (trainer/requests.py): a Flight
                             Recorder dump, a profile of N steps; each rank reads them on its metrics thread
        flight_recorder/<id>/rank_<N>   a rank's Flight Recorder buffer (torch's pickle), one folder per dump:
                             on request (a hang), `failure` when a rank raised, `timeout` from NCCL's watchdog
        profiles/<id>/rank<N>.trace.json.gz, rank<N>.ops.json   a rank's torch.profiler trace and top operators
        supervisor.log       the supervisor's own log
        torchrun.log         torchrun's output
        logs/<rdzv>_<rand>/attempt_<n>/<local_rank>/{stdout,stderr}.log, error.json   (torchrun's layout)
    and for a Slurm run (trainer/slurm.py), whose folder every node shares:
        job.sh               the batch script ddpdash submitted
        slurm-<job id>.out   Slurm's own output of the job
        supervisor.node<K>.log, torchrun.node<K>.log   node K's supervisor and torchrun
        logs/node<K>-rank<F>/…   node K's torchrun logs (its local rank L is global rank F + L)
        refused.node<K>.txt  why node K's supervisor refused to start (e.g. SQLite on a network file system)

Standard library only: the ranks, the supervisor and the dashboard all read it.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from ddpdash.db.paths import runs_root

from .mpi import LOG_FOLDER as MPI_LOG_FOLDER
from .mpi import rank_log as mpi_rank_log

FOLDER_PREFIX = "run-"


@dataclass(frozen=True)
class RunDir:
    """The folder of one run and the names of what it holds."""

    path: Path
    node: int | None = None  # a Slurm job's node: what its own supervisor and torchrun write is its own
    first_rank: int = 0  # the global rank of that node's local rank 0

    def on_node(self, node: int, first_rank: int) -> RunDir:
        return RunDir(self.path, node, first_rank)

    @classmethod
    def of_config(cls, config_path: Path) -> RunDir:
        """The folder a config file sits in (a hand-started run's folder is wherever its config is)."""
        return cls(config_path.resolve().parent)

    @property
    def config(self) -> Path:
        return self.path / "config.json"

    @property
    def checkpoint(self) -> Path:
        return self.path / "checkpoint.pt"

    def pending_checkpoint(self, step: int) -> Path:
        return self.path / f"checkpoint.pending-{step:010d}.pt"

    def pending_checkpoints(self) -> list[tuple[int, Path]]:
        """(step, file) of the checkpoints not yet promoted, oldest first."""
        found = []
        for path in self.path.glob("checkpoint.pending-*.pt"):
            digits = path.name.removeprefix("checkpoint.pending-").removesuffix(".pt")
            if digits.isdecimal():
                found.append((int(digits), path))
        return sorted(found)

    def stack_file(self, rank: int) -> Path:
        """Where a rank's faulthandler writes its threads when asked (SIGUSR2: trainer/stacks.py)."""
        return self.path / "stacks" / f"rank{rank}.txt"

    @property
    def requests(self) -> Path:
        return self.path / "requests"

    def flight_recorder(self, dump: str) -> Path:
        """The folder of one Flight Recorder dump: a file `rank_<N>` per rank (torch's analyser reads it so)."""
        return self.path / "flight_recorder" / dump

    def profile(self, request: str) -> Path:
        """The folder of one profile: every rank's trace and top operators."""
        return self.path / "profiles" / request

    @property
    def launch_env(self) -> Path:
        return self.path / "launch.env.json"

    @property
    def supervisor_log(self) -> Path:
        return self.path / "supervisor.log" if self.node is None else self.node_supervisor_log(str(self.node))

    def node_supervisor_log(self, node: str) -> Path:
        """A Slurm node's supervisor log (`node` may be srun's `%n`, the node's index in the job)."""
        return self.path / f"supervisor.node{node}.log"

    @property
    def torchrun_log(self) -> Path:
        return self.path / ("torchrun.log" if self.node is None else f"torchrun.node{self.node}.log")

    @property
    def logs(self) -> Path:
        """torchrun's --log-dir (a Slurm node's own, under the run's)."""
        top = self.path / "logs"
        return top if self.node is None else top / f"node{self.node}-rank{self.first_rank}"

    @property
    def job_script(self) -> Path:
        return self.path / "job.sh"

    @property
    def slurm_output(self) -> str:
        """Slurm's output file of the job, as sbatch's --output pattern (%j: the job id)."""
        return str(self.path / "slurm-%j.out")

    def slurm_output_of(self, job_id: str) -> Path:
        return self.path / f"slurm-{job_id}.out"

    @property
    def refusal(self) -> Path:
        """Where a node's supervisor says why it would not start (read by reconciliation)."""
        return self.path / f"refused.node{self.node or 0}.txt"

    def refusals(self) -> list[Path]:
        return sorted(self.path.glob("refused.node*.txt"))

    def node_logs(self) -> list[Path]:
        """The supervisor and torchrun logs of every Slurm node, node by node."""
        return sorted([*self.path.glob("supervisor.node*.log"), *self.path.glob("torchrun.node*.log")])

    def _node_of(self, rank: int) -> tuple[Path, int] | None:
        """The Slurm node's log folder a global rank's logs are in, and its local rank there."""
        best: tuple[int, Path] | None = None
        for folder in (self.path / "logs").glob("node*-rank*"):
            first = folder.name.rpartition("-rank")[2]
            if first.isdecimal() and int(first) <= rank and (best is None or int(first) > best[0]):
                best = (int(first), folder)
        return (best[1], rank - best[0]) if best else None

    def attempts(self) -> list[Path]:
        """torchrun's attempt folders, oldest first."""
        return sorted(self.logs.glob("*/attempt_*"), key=lambda p: int(p.name.split("_")[1]))

    def rank_log(self, rank: int, stream: str = "stderr") -> Path | None:
        """The newest attempt's log of a rank (a node's local rank on a node's RunDir), stdout or stderr:
        torchrun's layout, or Open MPI's
        (`logs/mpi/1/rank.N/stderr`) for an mpi run."""
        logs, local = self.logs, rank
        if self.node is None and (on_node := self._node_of(rank)):
            logs, local = on_node  # a Slurm run: `rank` is global, its node's folder counts from local rank 0
        found = sorted(logs.glob(f"*/attempt_*/{local}/{stream}.log"),
                       key=lambda p: (p.stat().st_mtime, p.parent.parent.name))
        return found[-1] if found else mpi_rank_log(self.logs / MPI_LOG_FOLDER, rank, stream)

    @property
    def made_by_ddpdash(self) -> bool:
        """A folder the launcher made (deleting the run removes it); a hand-started run's folder is the user's."""
        return self.path.resolve().parent == runs_root().resolve() and self.path.name.startswith(FOLDER_PREFIX)


def new_run_dir(run_id: int, root: Path | None = None) -> RunDir:
    """A folder no other run has used: `run-NNNNN`, or `run-NNNNN-xxxxxx` when that exists already (a
    database reset hands out ids again; the old run's checkpoint must never become the new one's)."""
    root = root or runs_root()
    root.mkdir(parents=True, exist_ok=True)
    name = f"{FOLDER_PREFIX}{run_id:05d}"
    while True:
        try:
            (root / name).mkdir()
            return RunDir(root / name)
        except FileExistsError:
            name = f"{FOLDER_PREFIX}{run_id:05d}-{secrets.token_hex(3)}"


def tail(path: Path, lines: int = 40, max_bytes: int = 64_000) -> str:
    """The last `lines` lines of a text file (read from its end: logs can be large); "" if unreadable."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])
