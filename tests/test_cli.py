"""The `ddpdash` CLI as a user runs it: a real subprocess for each command, on a real run."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow


def ddpdash(*args: str, home: Path, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DDPDASH_HOME": str(home)}
    env.pop("DDPDASH_DB_URL", None)
    env.pop("DDPDASH_TEST_FAULT", None)
    return subprocess.run([sys.executable, "-m", "ddpdash.cli", *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    home = tmp_path_factory.mktemp("cli") / "home"
    result = ddpdash("launch", "--num-procs", "2", "--width", "16", "--max-steps", "25", "--name", "cli-run",
                     "--batch-size", "16", "--wait", home=home)
    assert result.returncode == 0, result.stderr
    run_id = result.stdout.strip()
    assert run_id.isdigit()
    assert "25/25 steps" in result.stderr and "succeeded" in result.stderr  # the progress bar
    return home, run_id


def test_runs_lists_the_run(finished: tuple[Path, str]) -> None:
    home, run_id = finished
    out = ddpdash("runs", home=home).stdout
    assert f"{run_id}  succeeded" in out and "cli-run" in out


def test_show_has_ranks_and_events(finished: tuple[Path, str]) -> None:
    home, run_id = finished
    out = ddpdash("show", run_id, home=home).stdout
    assert "[succeeded]" in out and "rank 0: done" in out and "rank 1: done" in out and "finished" in out


def test_logs_of_a_rank(finished: tuple[Path, str]) -> None:
    home, run_id = finished
    out = ddpdash("logs", run_id, "--rank", "1", home=home).stdout
    assert "rank1 INFO" in out and "rank 1 done" in out


def test_export_csv_and_json(finished: tuple[Path, str]) -> None:
    home, run_id = finished
    csv = pd.read_csv(io.StringIO(ddpdash("export", run_id, "--format", "csv", home=home).stdout))
    assert list(csv.columns) == ["rank", "step", "metric", "value", "time"]
    loss = csv[csv["metric"] == "loss"]
    assert sorted(loss["rank"].unique()) == [0, 1] and loss.groupby("rank")["step"].max().tolist() == [25, 25]
    records = json.loads(ddpdash("export", run_id, "--format", "json", home=home).stdout)
    assert len(records) == len(csv) and set(records[0]) == {"rank", "step", "metric", "value", "time"}


def test_stop_a_running_run(tmp_path: Path) -> None:
    home = tmp_path / "home"
    run_id = ddpdash("launch", "--num-procs", "2", "--width", "16", "--max-steps", "1000000", home=home).stdout.strip()
    import time

    deadline = time.monotonic() + 60
    while "running" not in ddpdash("show", run_id, home=home).stdout and time.monotonic() < deadline:
        time.sleep(0.5)
    result = ddpdash("stop", run_id, home=home)
    assert result.returncode == 0 and result.stdout.strip() == f"run {run_id} stopped"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["launch", "--batch-size", "0"], "batch_size must be ≥ 1, got 0"),
        (["launch", "--backend", "nccl"], "backend nccl needs CUDA GPUs"),
        (["launch", "--amp", "fp16"], "amp fp16 on CPU"),
        (["launch", "--amp", "fp8"], "invalid choice: 'fp8'"),
        (["launch", "--devices", "a,b"], "expected comma-separated GPU indices"),
        (["launch", "--config", "/nonexistent.json"], "config file /nonexistent.json cannot be read"),
        (["show", "999"], "no run with id 999"),
        (["logs", "999"], "no run with id 999"),
        (["export", "12", "--format", "xml"], "invalid choice: 'xml'"),
    ],
)
def test_bad_input_is_one_clear_line_and_a_non_zero_exit(tmp_path: Path, args: list[str], message: str) -> None:
    result = ddpdash(*args, home=tmp_path / "home")
    assert result.returncode == 2
    assert message in result.stderr
    assert not (tmp_path / "home" / "runs").exists()  # nothing launched


def test_config_file_with_overrides(tmp_path: Path) -> None:
    cfg = tmp_path / "run.json"
    cfg.write_text(json.dumps({"batch_size": 0, "model": "linear"}))
    result = ddpdash("launch", "--config", str(cfg), home=tmp_path / "home")
    assert result.returncode == 2 and "batch_size must be ≥ 1" in result.stderr
    cfg.write_text(json.dumps({"batchsize": 4}))
    result = ddpdash("launch", "--config", str(cfg), home=tmp_path / "home")
    assert "unknown setting 'batchsize'" in result.stderr


def test_stop_of_a_run_on_another_host_is_one_line_and_changes_nothing(tmp_path: Path) -> None:
    import time

    from sqlalchemy.orm import Session

    from ddpdash.db.migrate import open_store
    from ddpdash.db.runs import create_run, get_run, update_run
    from ddpdash.db.vocab import RunStatus

    home = tmp_path / "home"
    engine = open_store(f"sqlite:///{home / 'ddpdash.db'}")
    with Session(engine) as s, s.begin():
        run_id = create_run(s, key="remote", name="remote", config_json="{}", world_size=8, host="gpu-node-7",
                            status=RunStatus.RUNNING)
        update_run(s, run_id, heartbeat_at=time.time())
    result = ddpdash("stop", str(run_id), home=home)
    assert result.returncode == 1
    assert result.stderr.strip() == (f"ddpdash: error: run {run_id} runs on host gpu-node-7; stop it from there "
                                     f"(ddpdash stop {run_id})")
    with Session(engine) as s:
        assert get_run(s, run_id).status == RunStatus.RUNNING
