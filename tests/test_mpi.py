"""The mpi backend: offered where torch has it and Open MPI's mpirun is on the PATH, explained where not.
This machine's torch (the PyPI CPU wheel) has no MPI, so the launch path is checked by its pure parts:
the argv, the rank environment mapping, the log layout, and the refusal everywhere else."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddpdash.dashboard import forms
from ddpdash.trainer import mpi
from ddpdash.trainer.commands import rank_argv, torchrun_argv
from ddpdash.trainer.config import Machine, RunConfig, validate
from ddpdash.trainer.rundir import RunDir
from tests.conftest import CPU_MACHINE, ROOT

MPI_MACHINE = Machine(cpu_count=2, mpi_unavailable=None)


def test_mpi_is_always_listed_and_refused_with_the_reason_where_torch_lacks_it() -> None:
    assert "mpi" in next(s for s in forms.field_specs() if s.name == "backend").choices
    assert forms.backend_label("mpi", CPU_MACHINE) == f"mpi (unavailable: {mpi.NO_MPI_IN_TORCH})"
    [error] = [e for e in validate(RunConfig(backend="mpi"), CPU_MACHINE) if e.field == "backend"]
    assert error.message == f"mpi is unavailable here: {mpi.NO_MPI_IN_TORCH}"


def test_the_reasons_in_plain_words() -> None:
    assert mpi.why_unavailable(False, "/usr/bin/mpirun") == mpi.NO_MPI_IN_TORCH
    assert mpi.why_unavailable(True, None) == mpi.NO_MPIRUN
    assert "another MPI's" in (mpi.why_unavailable(True, "/usr/bin/mpiexec", "HYDRA build details:") or "")
    assert mpi.why_unavailable(True, "/usr/bin/mpirun", "mpirun (Open MPI) 4.1.4") is None


def test_this_machine_says_why_it_has_no_mpi() -> None:
    import torch.distributed as dist

    if dist.is_mpi_available():  # a torch built with MPI: then only the launcher decides
        pytest.skip("this torch has MPI; the refusal below is for the PyPI wheels, which lack it")
    assert mpi.detect() == mpi.NO_MPI_IN_TORCH


def test_the_cli_refuses_backend_mpi_in_one_line(tmp_path: Path) -> None:
    env = {**os.environ, "DDPDASH_HOME": str(tmp_path)}
    env.pop("DDPDASH_DB_URL", None)
    out = subprocess.run([sys.executable, "-m", "ddpdash.cli", "launch", "--backend", "mpi"], env=env,
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 2 and out.stderr.strip() == f"ddpdash: error: backend mpi is unavailable here: " \
                                                         f"{mpi.NO_MPI_IN_TORCH}"
    assert not (tmp_path / "runs").exists()


def test_mpi_runs_are_started_by_mpirun_not_torchrun(tmp_path: Path) -> None:
    cfg = RunConfig(backend="mpi", num_procs=4)
    run_dir = RunDir(tmp_path)
    argv = torchrun_argv(cfg, run_dir, 7, python="/py", mpi_launcher="/usr/bin/mpirun")
    assert argv[:3] == ["/usr/bin/mpirun", "-n", "4"]
    assert argv[argv.index("--output-filename") + 1] == str(tmp_path / "logs" / "mpi")
    assert argv[argv.index("--output-filename") + 2:] == rank_argv(run_dir, 7, python="/py")
    assert "torch.distributed.run" not in argv
    assert ("--allow-run-as-root" in argv) == (os.geteuid() == 0)  # Open MPI refuses root without it


def test_each_rank_learns_its_place_from_the_mpi_launcher() -> None:
    assert mpi.rank_from_env({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                              "OMPI_COMM_WORLD_SIZE": "8"}) == (3, 1, 8)
    assert mpi.rank_from_env({"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0"}) == (2, 0, 4)
    assert mpi.rank_from_env({"RANK": "0", "WORLD_SIZE": "2"}) is None  # torchrun's, not MPI's


def test_an_mpi_ranks_log_is_found_in_open_mpis_layout(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path)
    log = run_dir.logs / mpi.LOG_FOLDER / "1" / "rank.1" / "stderr"
    log.parent.mkdir(parents=True)
    log.write_text("boom\n")
    assert run_dir.rank_log(1, "stderr") == log


def test_where_mpi_is_available_it_validates_for_cpu_processes_only() -> None:
    assert [e for e in validate(RunConfig(backend="mpi"), MPI_MACHINE) if e.field == "backend"] == []
    [restarts] = [e for e in validate(RunConfig(backend="mpi", max_restarts=1), MPI_MACHINE)
                  if e.field == "max_restarts"]
    assert "mpirun does not restart" in restarts.message
