"""Shared fixtures: a SQLite store under tmp_path, a private DDPDASH_HOME, run factories."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from ddpdash.db.migrate import open_store
from ddpdash.db.runs import RunInfo, create_run, get_run, list_runs
from ddpdash.db.vocab import RunStatus
from ddpdash.trainer.config import Machine, RunConfig

ROOT = Path(__file__).resolve().parent.parent
CPU_MACHINE = Machine(cpu_count=2)
GPU_MACHINE = Machine(cpu_count=16, gpus=(("NVIDIA H200", 139.8), ("NVIDIA H200", 139.8)), bf16_gpu=True, nccl=True)


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("DDPDASH_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("DDPDASH_DB_URL", raising=False)
    monkeypatch.delenv("DDPDASH_TEST_FAULT", raising=False)
    # Room for every run a test starts at once; the queue's own tests set the capacity they test.
    monkeypatch.setenv("DDPDASH_CPU_SLOTS", "64")
    return tmp_path / "home"


@pytest.fixture
def db_url(home: Path) -> str:
    return f"sqlite:///{home / 'ddpdash.db'}"


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    eng = open_store(db_url)
    yield eng
    stop_active_runs(eng)  # a failed test must not leave training processes behind
    eng.dispose()


def stop_active_runs(engine: Engine) -> None:
    from ddpdash.trainer.control import stop

    with Session(engine) as s:
        active = list_runs(s, statuses=RunStatus.ACTIVE)
    for run in active:
        stop(engine, run.id)


def make_run(engine: Engine, cfg: RunConfig | None = None, **kw: object) -> int:
    cfg = cfg or RunConfig()
    with Session(engine) as s, s.begin():
        return create_run(s, key=str(kw.pop("key", f"test-{time.time_ns()}")), name=str(kw.pop("name", cfg.name)),
                          config_json=cfg.to_json(), world_size=cfg.world_size, **kw)  # type: ignore[arg-type]


def tiny(**changes: object) -> RunConfig:
    """A config that trains for real but in a second or two on two CPU ranks."""
    base = {"name": "tiny", "num_procs": 2, "recipe": "mlp", "width": 16, "depth": 1, "batch_size": 16,
            "max_steps": 30, "log_every": 1, "checkpoint_every": 0, "sync_check_every": 10}
    return RunConfig.from_dict({**base, **changes})


def torchrun_by_hand(cfg: RunConfig, run_dir: Path, db_url: str, *, nproc: int = 2,
                     extra_env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """What a user does without the launcher: write config.json, start torchrun on it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(cfg.to_json())
    env = {**os.environ, "DDPDASH_DB_URL": db_url, "OMP_NUM_THREADS": "1", **(extra_env or {})}
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            "-m", "ddpdash.trainer", "--config", str(run_dir / "config.json")]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def run_in_dir(engine: Engine, run_dir: Path) -> RunInfo:
    with Session(engine) as s:
        found = [r for r in list_runs(s) if Path(r.run_dir) == run_dir.resolve()]
    assert found, f"no run registered for {run_dir}"
    return found[0]


def wait_final(engine: Engine, run_id: int, timeout: float = 120) -> RunInfo:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with Session(engine) as s:
            run = get_run(s, run_id)
        if run.status in RunStatus.FINAL:
            return run
        time.sleep(0.2)
    raise AssertionError(f"run {run_id} still {run.status} after {timeout} s")


def wait_for(predicate, timeout: float = 60, every: float = 0.2):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"condition not met within {timeout} s")
