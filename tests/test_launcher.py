"""Process control and the supervisor: real detached torchrun runs on CPU (slow), plus the pure argv builders."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil
import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from ddpdash.db.queries import events, metric_series, rank_states
from ddpdash.db.runs import RunInfo, get_run
from ddpdash.trainer.commands import cli_command, torchrun_argv, torchrun_env
from ddpdash.trainer.config import ConfigInvalid, RunConfig
from ddpdash.trainer.control import LaunchError, launch, reconcile, stop
from ddpdash.trainer.rundir import RunDir
from ddpdash.trainer.supervisor.priority import PriorityError, supervisor_nice
from tests.conftest import CPU_MACHINE, tiny, wait_final, wait_for


# ---- pure builders --------------------------------------------------------------------------
def test_torchrun_argv_is_a_list_built_from_the_config(tmp_path: Path) -> None:
    argv = torchrun_argv(RunConfig(num_procs=3, max_restarts=2), RunDir(tmp_path), 17, python="/py")
    assert argv[:3] == ["/py", "-m", "torch.distributed.run"]
    assert argv[argv.index("--nproc-per-node") + 1] == "3"
    assert argv[argv.index("--max-restarts") + 1] == "2"
    assert argv[argv.index("--rdzv-endpoint") + 1] == "127.0.0.1:0"  # the OS picks a free port per run
    assert argv[argv.index("--rdzv-id") + 1] == "ddpdash-run-17"
    assert argv[argv.index("--log-dir") + 1] == str(tmp_path / "logs")
    assert argv[-6:] == ["-m", "ddpdash.trainer", "--config", str(tmp_path / "config.json"), "--run-id", "17"]
    assert all(isinstance(a, str) for a in argv)


def test_user_text_stays_one_argument_in_the_command_shown() -> None:
    import shlex

    from ddpdash.dashboard.forms import command_previews

    hostile = "x; rm -rf / $(whoami) 'q\""
    cfg = RunConfig(name=hostile)
    assert cli_command(cfg)[2:4] == ["--name", hostile]
    shown, _ = command_previews(cfg)  # what the New-run page offers to copy into a shell
    assert shlex.split(shown) == cli_command(cfg)  # a shell reads it back as the same argument list


def test_env_narrows_gpus_and_shares_cores() -> None:
    env = torchrun_env(RunConfig(devices=(2, 5)), "sqlite:///x.db", base={})
    assert env["CUDA_VISIBLE_DEVICES"] == "2,5" and env["DDPDASH_DB_URL"] == "sqlite:///x.db"
    cores = len(os.sched_getaffinity(0))
    assert env["OMP_NUM_THREADS"] == str(max(1, cores // 2))
    assert "CUDA_VISIBLE_DEVICES" not in torchrun_env(RunConfig(num_procs=2), "sqlite://", base={})


def test_cli_command_lists_only_changed_settings() -> None:
    assert cli_command(RunConfig(batch_size=8, amp="bf16", scale_lr=False)) == [
        "ddpdash", "launch", "--batch-size", "8", "--amp", "bf16", "--no-scale-lr"]


def test_invalid_config_launches_nothing_and_writes_nothing(engine: Engine, home: Path) -> None:
    with pytest.raises(ConfigInvalid, match="batch_size must be ≥ 1"):
        launch(engine, tiny(batch_size=0), CPU_MACHINE)
    with Session(engine) as s:
        from ddpdash.db.runs import list_runs

        assert list_runs(s) == []
    assert not (home / "runs").exists()


def test_a_bad_supervisor_priority_is_refused_before_anything_is_written(
    engine: Engine, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert supervisor_nice({}) == 10 and supervisor_nice({"DDPDASH_SUPERVISOR_NICE": "0"}) == 0
    for bad in ("-5", "20", "low"):
        with pytest.raises(PriorityError, match=f"SUPERVISOR_NICE must be a whole number from 0 to 19, got '{bad}'"):
            supervisor_nice({"DDPDASH_SUPERVISOR_NICE": bad})
    monkeypatch.setenv("DDPDASH_SUPERVISOR_NICE", "high")
    with pytest.raises(LaunchError, match="got 'high'"):
        launch(engine, tiny(), CPU_MACHINE)
    with Session(engine) as s:
        from ddpdash.db.runs import list_runs

        assert list_runs(s) == []
    assert not (home / "runs").exists()


# ---- real runs ------------------------------------------------------------------------------
pytest_slow = pytest.mark.slow


def no_survivors(run: RunInfo) -> bool:
    pids = [p for p in (run.supervisor_pid, run.torchrun_pid, *run.worker_pids) if p]
    assert len(pids) >= 2 + run.world_size, pids  # the supervisor, torchrun and every worker were recorded
    return not any(_alive(p) for p in pids)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest_slow
def test_launch_runs_to_success_with_rows_and_logs_per_rank(engine: Engine) -> None:
    run_id = launch(engine, tiny(max_steps=20), CPU_MACHINE)
    run = wait_final(engine, run_id)
    assert run.status == "succeeded" and run.exit_code == 0
    with Session(engine) as s:
        loss = metric_series(s, run_id, "loss")
        assert rank_states(s, run_id)["status"].tolist() == ["done", "done"]
        kinds = events(s, run_id)["kind"].tolist()
    assert loss.groupby("rank").size().to_dict() == {0: 20, 1: 20}
    for rank in (0, 1):
        assert list(Path(run.run_dir).glob(f"logs/*/attempt_0/{rank}/stderr.log"))
    assert kinds[:3] == ["queued", "admitted", "launched"] and kinds[-1] == "finished"
    assert run.total_steps == 20 and wait_for(lambda: no_survivors(run), 10)


@pytest_slow
def test_a_failing_rank_is_named_with_its_traceback(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DDPDASH_TEST_FAULT", "raise:1:5")
    run_id = launch(engine, tiny(max_steps=10_000), CPU_MACHINE)
    wait_for(lambda: _step(engine, run_id) >= 1, 60)  # training started; the fault comes at step 5
    start = time.monotonic()
    run = wait_final(engine, run_id, timeout=30)
    assert time.monotonic() - start < 10
    assert run.status == "failed" and run.failed_ranks == (1,)
    assert "InjectedFault" in run.error and "injected fault on rank 1 at step 5" in run.error
    assert "Traceback" in run.error or "File " in run.error
    with Session(engine) as s:
        ev = events(s, run_id)
    assert "rank_failed" in ev["kind"].tolist()
    assert wait_for(lambda: no_survivors(run), 10)


def priority(pid: int) -> tuple[int, int | None]:
    """A process's nice value and its session's (its autogroup's; None where the kernel has none)."""
    try:
        autogroup: int | None = int(Path(f"/proc/{pid}/autogroup").read_text().split("nice")[1])
    except OSError:
        autogroup = None
    return psutil.Process(pid).nice(), autogroup


def _step(engine: Engine, run_id: int) -> int:
    with Session(engine) as s:
        states = rank_states(s, run_id)
    return int(states["step"].min()) if len(states) else 0


@pytest_slow
def test_stop_mid_run_leaves_no_process(engine: Engine) -> None:
    run_id = launch(engine, tiny(max_steps=1_000_000), CPU_MACHINE)
    wait_for(lambda: _step(engine, run_id) >= 5, 60)
    # Meanwhile: the supervisor steps back for training (trainer.supervisor.priority.yield_cpu_to_training),
    # and its workers keep the priority they were launched with.
    wait_for(lambda: len(_run(engine, run_id).worker_pids) >= 2, 10)
    running = _run(engine, run_id)
    autogroups = Path("/proc/self/autogroup").exists()
    nice = supervisor_nice()
    assert priority(running.supervisor_pid or 0) == (min(19, os.nice(0) + nice), nice if autogroups else None)
    assert {priority(pid) for pid in running.worker_pids} == {(os.nice(0), 0 if autogroups else None)}
    start = time.monotonic()
    assert stop(engine, run_id) == "stopped"
    assert time.monotonic() - start < 10
    with Session(engine) as s:
        run = get_run(s, run_id)
        states = rank_states(s, run_id)
    assert run.status == "stopped" and set(states["status"]) == {"stopped"}
    assert wait_for(lambda: no_survivors(run), 5)


@pytest_slow
def test_a_run_whose_supervisor_and_ranks_are_all_killed_becomes_lost_and_leaves_nothing(engine: Engine) -> None:
    """With its ranks alive, a run outlives its supervisor (tests/test_faults.py); with nothing left
    training, the next reader calls it lost at once."""
    run_id = launch(engine, tiny(max_steps=1_000_000), CPU_MACHINE)
    wait_for(lambda: _step(engine, run_id) >= 5, 60)
    wait_for(lambda: len(_run(engine, run_id).worker_pids) >= 2, 10)
    running = _run(engine, run_id)
    os.kill(running.supervisor_pid, signal.SIGKILL)  # type: ignore[arg-type]
    for pid in running.worker_pids:
        os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not any(_alive(p) for p in (running.supervisor_pid or 0, *running.worker_pids)), 10)
    wait_for(lambda: run_id in reconcile(engine), 15)  # torchrun's agent may linger a moment
    run = _run(engine, run_id)
    assert run.status == "lost" and "gone" in run.error
    assert wait_for(lambda: no_survivors(running), 10)
    with Session(engine) as s:
        assert "lost" in events(s, run_id)["kind"].tolist()


def _run(engine: Engine, run_id: int) -> RunInfo:
    with Session(engine) as s:
        return get_run(s, run_id)


@pytest_slow
def test_restart_resumes_from_checkpoint_without_duplicate_steps(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DDPDASH_TEST_FAULT", "raise-once:1:15")
    run_id = launch(engine, tiny(max_steps=30, checkpoint_every=10, max_restarts=1, log_every=1), CPU_MACHINE)
    run = wait_final(engine, run_id, timeout=180)
    assert run.status == "succeeded", run.error
    with Session(engine) as s:
        loss = metric_series(s, run_id, "loss")
        ev = events(s, run_id)
    for _, per_rank in loss.groupby("rank"):
        steps = per_rank["step"].tolist()
        assert steps == list(range(1, 31))  # strictly increasing, none repeated, none missing
    restarts = ev[ev["kind"] == "restart"]
    assert len(restarts) == 1 and "step 10" in restarts.iloc[0]["message"]
    assert "rank_failed" in ev["kind"].tolist()


@pytest_slow
def test_a_crash_after_training_finished_still_counts_as_succeeded(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DDPDASH_TEST_FAULT", "abort-exit:1:0")
    run_id = launch(engine, tiny(max_steps=5), CPU_MACHINE)
    run = wait_final(engine, run_id)
    assert run.status == "succeeded" and run.exit_code != 0  # torchrun said 1; every rank had finished
    with Session(engine) as s:
        ev = events(s, run_id)
    assert "exit_warning" in ev["kind"].tolist()


@pytest_slow
def test_two_runs_at_once_both_succeed(engine: Engine) -> None:
    ids = [launch(engine, tiny(max_steps=15, name=f"twin{i}"), CPU_MACHINE) for i in range(2)]
    assert [wait_final(engine, i).status for i in ids] == ["succeeded", "succeeded"]


@pytest_slow
def test_ten_sequential_short_runs_all_succeed(engine: Engine) -> None:
    # The teardown crash this guards against hit a third of runs (NOTES): ten catch it 98 times in 100.
    statuses = []
    for i in range(10):
        run_id = launch(engine, tiny(max_steps=2, sync_check_every=0, name=f"seq{i}"), CPU_MACHINE)
        run = wait_final(engine, run_id)
        statuses.append((run.status, run.error[:300]))
    assert [s for s, _ in statuses] == ["succeeded"] * 10, statuses
