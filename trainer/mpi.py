"""MPI, the DDP guide's third process-group backend ("suited to CPU training"). Offered where the
installed torch was built with it and Open MPI's `mpirun` is on the PATH; explained where not.

Its ranks are started by `mpirun -n N` instead of torchrun and learn their rank and world size from MPI
itself (`init_process_group("mpi")`); the supervisor supervises mpirun as it does torchrun. Pure
functions and the standard library: the form, the CLI and the launch all call them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path

NO_MPI_IN_TORCH = ("this PyTorch build has no MPI backend: the wheels on the package index are built without it. "
                   "Build torch from source with MPI, or use a distribution that ships such a build; "
                   "gloo serves CPU processes meanwhile")
NO_MPIRUN = "no mpirun or mpiexec on the PATH: install Open MPI (Debian: openmpi-bin)"
NOT_OPEN_MPI = "ddpdash drives Open MPI's mpirun, and {launcher} is another MPI's"
LOG_FOLDER = "mpi"  # under the run folder's logs/: Open MPI's --output-filename layout, 1/rank.N/stdout


def find_launcher() -> str | None:
    return shutil.which("mpirun") or shutil.which("mpiexec")


def why_unavailable(torch_has_mpi: bool, launcher: str | None, version_text: str = "") -> str | None:
    """Why the mpi backend cannot be used here, in plain words; None where it can."""
    if not torch_has_mpi:
        return NO_MPI_IN_TORCH
    if launcher is None:
        return NO_MPIRUN
    if version_text and "Open MPI" not in version_text and "OpenRTE" not in version_text:
        return NOT_OPEN_MPI.format(launcher=launcher)
    return None


def detect() -> str | None:
    """Why MPI is unavailable on this machine (imports torch: callers cache it), None where it works."""
    import torch.distributed as dist

    launcher = find_launcher()
    version = ""
    if launcher and dist.is_available() and dist.is_mpi_available():
        try:
            version = subprocess.run([launcher, "--version"], capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            version = ""
    return why_unavailable(bool(dist.is_available() and dist.is_mpi_available()), launcher, version)


def mpirun_argv(world_size: int, log_dir: Path, rank_argv: list[str], launcher: str = "mpirun",
                as_root: bool | None = None) -> list[str]:
    """The mpirun command for `world_size` ranks, each running `rank_argv`; every rank's output in
    `log_dir` (Open MPI's layout: 1/rank.N/stdout, stderr)."""
    root = os.geteuid() == 0 if as_root is None else as_root
    return [launcher, "-n", str(world_size), *(["--allow-run-as-root"] if root else []),
            "--output-filename", str(log_dir), *rank_argv]


def rank_from_env(env: Mapping[str, str]) -> tuple[int, int, int] | None:
    """(rank, local rank, world size) as an MPI launcher sets them — Open MPI's OMPI_COMM_WORLD_*, or the
    PMI_* names of MPICH-derived launchers — or None outside mpirun."""
    for rank, local, size in (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_SIZE"),
                              ("PMI_RANK", "MPI_LOCALRANKID", "PMI_SIZE")):
        if rank in env and size in env:
            return int(env[rank]), int(env.get(local, env[rank])), int(env[size])
    return None


def rank_log(log_dir: Path, rank: int, stream: str) -> Path | None:
    path = log_dir / "1" / f"rank.{rank}" / stream
    return path if path.exists() else None
