"""Faults that must end in the truth, and input that gets one clear line (issue: faults, outages,
hostile input). Each reproduces the fault on two tiny gloo ranks, then checks what a user sees."""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from ddpdash.db.migrate import StoreError, open_store
from ddpdash.db.queries import events, metric_series, rank_states
from ddpdash.db.runs import get_run
from ddpdash.db.vocab import EventKind, RankStatus, RunStatus
from ddpdash.trainer.config import ConfigInvalid, Machine, RunConfig, validate
from ddpdash.trainer.control import alive, launch, reconcile
from ddpdash.trainer.memory import estimate
from tests.conftest import CPU_MACHINE, ROOT, make_run, tiny, torchrun_by_hand, wait_final, wait_for

slow = pytest.mark.slow


def steps_per_rank(engine: Engine, run_id: int) -> dict[int, list[int]]:
    with Session(engine) as s:
        loss = metric_series(s, run_id, "loss", max_points=100_000)
    return {int(rank): sorted(group["step"].tolist()) for rank, group in loss.groupby("rank")}


def assert_every_step_once(engine: Engine, run_id: int, steps: int, world: int = 2) -> None:
    assert steps_per_rank(engine, run_id) == {rank: list(range(1, steps + 1)) for rank in range(world)}


# ---- 5: a database reset never hands a new run an old run's folder or checkpoint ----------------------
@slow
def test_after_a_database_reset_a_new_run_gets_a_new_folder_and_trains_from_step_0(
    engine: Engine, db_url: str, home: Path
) -> None:
    first = launch(engine, tiny(max_steps=30, checkpoint_every=10), CPU_MACHINE)
    old = wait_final(engine, first)
    assert old.status == RunStatus.SUCCEEDED and (Path(old.run_dir) / "checkpoint.pt").exists()
    engine.dispose()
    for leftover in home.glob("ddpdash.db*"):
        leftover.unlink()  # the reset: ids start at 1 again, the runs folders stay
    fresh = open_store(db_url)
    try:
        second = launch(fresh, tiny(max_steps=30, checkpoint_every=10), CPU_MACHINE)
        assert second == first  # the same id again...
        run = wait_final(fresh, second)
        assert run.status == RunStatus.SUCCEEDED
        assert Path(run.run_dir) != Path(old.run_dir)  # ...but never the same folder
        assert_every_step_once(fresh, second, 30)  # trained from step 1, not "resumed" at 30
        with Session(fresh) as s:
            assert EventKind.RESTART not in events(s, second)["kind"].tolist()
    finally:
        fresh.dispose()


def test_a_checkpoint_is_resumed_only_by_the_run_that_wrote_it(tmp_path: Path) -> None:
    import torch

    from ddpdash.trainer.train import read_checkpoint, save_checkpoint

    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = tmp_path / "checkpoint.pt"
    save_checkpoint(path, model, opt, torch.amp.GradScaler("cpu", enabled=False), 15000, "run-a")
    assert read_checkpoint(path, "run-a")["step"] == 15000  # type: ignore[index]
    assert read_checkpoint(path, "run-b") is None


# ---- 6: a run without a supervisor is judged by its ranks' heartbeats --------------------------------
def test_a_hand_started_run_is_judged_by_its_heartbeats(engine: Engine) -> None:
    import socket

    run_id = make_run(engine, status=RunStatus.RUNNING, host=socket.gethostname())
    from ddpdash.db.store import register_rank

    with Session(engine) as s, s.begin():
        register_rank(s, run_id, 0, device="cpu", attempt=0, host=socket.gethostname(), pid=os.getpid())
    assert reconcile(engine) == []  # its rank beats: it trains
    with Session(engine) as s:
        assert get_run(s, run_id).status == RunStatus.RUNNING
    assert reconcile(engine, now=time.time() + 61) == [run_id]  # a minute without a beat: lost
    with Session(engine) as s:
        assert "no heartbeat from its ranks" in get_run(s, run_id).error


@slow
def test_a_hand_started_torchrun_is_never_called_lost_while_it_trains(engine: Engine, db_url: str,
                                                                      tmp_path: Path) -> None:
    done = threading.Event()
    result: list[subprocess.CompletedProcess[str]] = []

    def by_hand() -> None:
        result.append(torchrun_by_hand(tiny(max_steps=150), tmp_path / "mine", db_url,
                                       extra_env={"DDPDASH_TEST_FAULT": "sleep:0:0.02"}))
        done.set()

    threading.Thread(target=by_hand, daemon=True).start()
    while not done.wait(0.5):
        assert reconcile(engine) == []  # every reader reconciles; none may call it lost
    assert result[0].returncode == 0, result[0].stderr[-2000:]
    with Session(engine) as s:
        from ddpdash.db.runs import list_runs

        [run] = list_runs(s)
    assert run.status == RunStatus.SUCCEEDED
    assert_every_step_once(engine, run.id, 150)


# ---- 7: a dead supervisor: training goes on, keeps its metrics, and the truth is recorded --------------
@slow
def test_a_killed_supervisor_leaves_training_running_and_every_metric_kept(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DDPDASH_TEST_FAULT", "sleep:0:0.02")  # ≈ 6 s of training: time to kill the supervisor
    run_id = launch(engine, tiny(max_steps=300), CPU_MACHINE)
    wait_for(lambda: _min_step(engine, run_id) >= 20, 90)
    supervisor = _run(engine, run_id).supervisor_pid
    os.kill(supervisor, signal.SIGKILL)  # type: ignore[arg-type]
    killed_at = time.monotonic()
    # What the Live page and `--wait` do every few seconds: they notice within 10 s.
    wait_for(lambda: reconcile(engine) == [] and _has_event(engine, run_id, EventKind.SUPERVISOR_LOST), 10)
    assert time.monotonic() - killed_at < 10
    run = wait_final(engine, run_id, 120)
    assert run.status == RunStatus.SUCCEEDED, run.error  # recorded by rank 0, not left "running" or "lost"
    assert_every_step_once(engine, run_id, 300)  # nothing dropped after the supervisor died
    with Session(engine) as s:
        assert set(rank_states(s, run_id)["status"]) == {RankStatus.DONE}
    wait_for(lambda: not any(alive(p) for p in (run.torchrun_pid, *run.worker_pids)), 10)


def _run(engine: Engine, run_id: int):  # type: ignore[no-untyped-def]
    with Session(engine) as s:
        return get_run(s, run_id)


def _min_step(engine: Engine, run_id: int) -> int:
    with Session(engine) as s:
        states = rank_states(s, run_id)
    return int(states["step"].min()) if len(states) == 2 else 0


def _has_event(engine: Engine, run_id: int, kind: str) -> bool:
    with Session(engine) as s:
        return kind in events(s, run_id)["kind"].tolist()


# ---- 4: a database outage does not end healthy training ------------------------------------------------
@slow
def test_thirty_seconds_of_a_locked_database_lose_nothing(engine: Engine, home: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DDPDASH_TEST_FAULT", "sleep:0:0.02")
    run_id = launch(engine, tiny(max_steps=600), CPU_MACHINE)
    wait_for(lambda: _min_step(engine, run_id) >= 10, 90)
    lock = sqlite3.connect(home / "ddpdash.db", timeout=30)
    lock.execute("BEGIN EXCLUSIVE")  # every writer now waits, then fails: the outage
    time.sleep(30)
    lock.rollback()
    lock.close()
    run = wait_final(engine, run_id, 300)
    assert run.status == RunStatus.SUCCEEDED, run.error
    assert_every_step_once(engine, run_id, 600)


# ---- 11: bounds, and a memory estimate before launch --------------------------------------------------
@pytest.mark.parametrize(("setting", "value", "message"), [
    ("max_steps", 10**29, "max_steps must be ≤ 2,147,483,647"),
    ("batch_size", 1_000_000_000, "batch_size must be ≤ 1,048,576"),
    ("num_workers", 1000, "num_workers must be ≤ 64"),
    ("seed", 10**23, "seed must be ≤ 4,294,967,295"),
    ("width", 10**6, "width must be ≤ 65,536"),
])
def test_every_number_has_an_upper_bound(setting: str, value: int, message: str) -> None:
    errors = [str(e) for e in validate(RunConfig.from_dict({setting: value}), CPU_MACHINE)]
    assert any(message in e for e in errors), errors


def test_a_run_that_would_not_fit_in_memory_is_refused_with_the_estimate() -> None:
    machine = Machine(cpu_count=2, memory_free_bytes=8 * 2**30)
    big = RunConfig(num_procs=2, width=20_000, depth=2)  # ≈ 400M parameters: ≈ 6 GiB per rank with SGD
    [error] = [e for e in validate(big, machine) if e.field == "memory_check"]
    assert "needs" in error.message and "8.00 GiB free" in error.message and "parameters" in error.message
    assert validate(big.replace(memory_check=False), machine) == []  # the override
    assert validate(RunConfig(), machine) == []
    assert estimate(big).parameters == 64 * 20_000 + 20_000 + 20_000 * 20_000 + 20_000 + 20_000 * 10 + 10


@slow
def test_the_memory_estimate_covers_what_a_rank_really_uses(tmp_path: Path) -> None:
    """Peak RSS of one real training process against its estimate: the estimate is on the high side,
    and not absurdly so."""
    cfg = tiny(name="rss", num_procs=1, width=3000, depth=2, max_steps=5, sync_check_every=0)
    run_dir = tmp_path / "rss"
    run_dir.mkdir()
    (run_dir / "config.json").write_text(cfg.to_json())
    code = ("import resource, sys; from ddpdash.trainer.train import main; main(sys.argv[1:]); "
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)")
    env = {**os.environ, "DDPDASH_DB_URL": f"sqlite:///{tmp_path / 'rss.db'}", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code, "--config", str(run_dir / "config.json")], env=env,
                         capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    peak = int(out.stdout.strip().splitlines()[-1])
    predicted = estimate(cfg).host_bytes
    assert peak <= predicted <= 3 * peak, (peak, predicted)


# ---- 12: one clear line instead of a traceback ----------------------------------------------------------
def cli(*args: str, home: Path, env: dict[str, str] | None = None, stdin: str | None = None
        ) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if k != "DDPDASH_DB_URL"}
    full.update({"DDPDASH_HOME": str(home), **(env or {})})
    return subprocess.run([sys.executable, "-m", "ddpdash.cli", *args], env=full, capture_output=True, text=True,
                          timeout=60, cwd=ROOT, input=stdin)


def one_line_error(result: subprocess.CompletedProcess[str], *, code: int = 2) -> str:
    assert result.returncode == code, (result.returncode, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ddpdash: error:") and "Traceback" not in result.stderr, lines
    return lines[0]


@pytest.mark.parametrize(("content", "message"), [
    (b"\xff\xfe{\x00}", "is not UTF-8 text"),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b"[1, 2]", "must hold a JSON object of settings, got list"),
])
def test_a_config_file_that_is_no_config_is_one_line(tmp_path: Path, content: bytes, message: str) -> None:
    bad = tmp_path / "bad.json"
    bad.write_bytes(content)
    assert message in one_line_error(cli("launch", "--config", str(bad), home=tmp_path / "home"))
    assert not (tmp_path / "home" / "runs").exists()


def test_a_config_that_never_ends_is_refused_without_reading_it_all(tmp_path: Path) -> None:
    assert "larger than 1 MiB" in one_line_error(cli("launch", "--config", "/dev/zero", home=tmp_path))


def test_a_database_that_cannot_be_used_is_one_line(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / "ddpdash.db").write_bytes(b"this is not a database, just bytes" * 100)
    assert "cannot use the database" in one_line_error(cli("runs", home=home))
    assert "not a database URL" in one_line_error(cli("runs", home=home, env={"DDPDASH_DB_URL": "nonsense://x"}))
    unreachable = "postgresql+psycopg://nobody@127.0.0.1:9/none?connect_timeout=2"
    assert "cannot use the database" in one_line_error(cli("runs", home=home, env={"DDPDASH_DB_URL": unreachable}))
    with pytest.raises(StoreError, match="file is not a database"):
        open_store(f"sqlite:///{home / 'ddpdash.db'}")


def test_an_unusable_home_and_a_bad_port_are_one_line(tmp_path: Path) -> None:
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("x")
    assert "cannot make the folder" in one_line_error(cli("runs", home=not_a_folder / "home"))
    assert "must be a port number from 1 to 65535" in cli("ui", home=tmp_path, env={"PORT": "abc"}).stderr


def test_export_refuses_folders_missing_folders_and_existing_files(tmp_path: Path, engine: Engine,
                                                                  home: Path) -> None:
    from tests.seed import seed_run

    run_id = str(seed_run(engine, RunConfig(name="exported"), steps=5))
    assert "is a folder" in one_line_error(cli("export", run_id, "-o", str(tmp_path), home=home))
    assert "does not exist" in one_line_error(cli("export", run_id, "-o", str(tmp_path / "no" / "x.csv"), home=home))
    target = tmp_path / "run.csv"
    target.write_text("precious")
    assert "pass --force" in one_line_error(cli("export", run_id, "-o", str(target), home=home))
    assert target.read_text() == "precious"  # nothing lost
    assert cli("export", run_id, "-o", str(target), "--force", home=home).returncode == 0
    assert target.read_text().startswith("rank,step,metric,value,time")


def test_a_closed_pipe_is_not_a_traceback(tmp_path: Path, engine: Engine, home: Path) -> None:
    from ddpdash.db.runs import add_event
    from tests.seed import seed_run

    run_id = str(seed_run(engine, RunConfig(name="piped"), steps=5))
    with Session(engine) as s, s.begin():
        for i in range(3000):  # more than a pipe holds: `show` is still writing when the reader leaves
            add_event(s, int(run_id), "note", f"event number {i} of a long run's history")
    show = subprocess.Popen([sys.executable, "-m", "ddpdash.cli", "show", run_id], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, "DDPDASH_HOME": str(home)}, cwd=ROOT)
    assert show.stdout is not None
    first = show.stdout.readline()  # what `| head -1` reads, then it leaves
    show.stdout.close()
    _, err = show.communicate(timeout=60)
    assert first.decode().startswith(f"run {run_id}:")
    assert b"Traceback" not in err and b"BrokenPipe" not in err, err


@pytest.mark.parametrize(("page", "query"), [
    ("views/live.py", {"run": "²"}),
    ("views/compare.py", {"runs": "²,1"}),
    ("views/new_run.py", {"clone": "99999999999999999999999"}),
    ("views/new_run.py", {"clone": "9223372036854775807"}),
])
def test_odd_ids_in_a_link_are_a_message_not_a_traceback(engine: Engine, page: str, query: dict[str, str]) -> None:
    from tests.test_dashboard_app import open_page

    open_page(page, **query)  # asserts the page raised nothing


def test_config_errors_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigInvalid, match=r"config file .* is not UTF-8"):
        bad = tmp_path / "c.json"
        bad.write_bytes(b"\xff")
        RunConfig.from_file(bad)



# ---- 8: the rank that died or stopped is the one blamed, and a hang ends in time -------------------------
def _worker_of_rank(engine: Engine, run_id: int, rank: int) -> int:
    with Session(engine) as s:
        states = rank_states(s, run_id)
    return int(states.set_index("rank").loc[rank, "pid"])


@slow
def test_a_rank_killed_by_a_signal_is_blamed_not_the_peer_that_lost_it(engine: Engine,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DDPDASH_TEST_FAULT", "sleep:0:0.02")
    run_id = launch(engine, tiny(max_steps=100_000), CPU_MACHINE)
    wait_for(lambda: _min_step(engine, run_id) >= 10, 90)
    os.kill(_worker_of_rank(engine, run_id, 1), signal.SIGKILL)
    run = wait_final(engine, run_id, 60)
    assert run.status == RunStatus.FAILED and run.failed_ranks == (1,), (run.failed_ranks, run.error)
    assert "killed by SIGKILL" in run.error


@slow
def test_a_stopped_rank_is_blamed_and_the_hang_ends_within_the_timeout(engine: Engine,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DDPDASH_TEST_FAULT", "sleep:0:0.02")
    run_id = launch(engine, tiny(max_steps=100_000, pg_timeout_s=10), CPU_MACHINE)
    wait_for(lambda: _min_step(engine, run_id) >= 10, 90)
    pid = _worker_of_rank(engine, run_id, 1)
    os.kill(pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        run = wait_final(engine, run_id, 60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    assert time.monotonic() - stopped_at <= 10 + 10  # pg_timeout_s + 10 s
    assert run.status == RunStatus.FAILED and run.failed_ranks == (1,), (run.failed_ranks, run.error)
    assert "stopped (state T" in run.error


# ---- 10: a healthy run has no straggler; a slow rank is named ---------------------------------------------
def _flags_while_running(engine: Engine, run_id: int, looks: int = 6) -> list[list[str]]:
    from ddpdash.dashboard import livedata

    cache = livedata.SeriesCache(run_id)
    seen = []
    wait_for(lambda: _min_step(engine, run_id) >= 40, 90)
    for _ in range(looks):  # what the Live page shows at each refresh
        with Session(engine) as s:
            run, states = get_run(s, run_id), rank_states(s, run_id)
            cache.refresh(s)
        if run.is_active:
            seen.append([flag for flag in livedata.rank_table(run, states, cache)["flag"] if flag])
        time.sleep(1.5)
    return seen


@slow
@pytest.mark.parametrize("perturbed", [False, True])
def test_a_straggler_is_named_only_when_there_is_one(engine: Engine, monkeypatch: pytest.MonkeyPatch,
                                                     perturbed: bool) -> None:
    if perturbed:
        monkeypatch.setenv("DDPDASH_TEST_FAULT", "sleep:1:0.01")  # rank 1 does 10 ms more work each step
    run_id = launch(engine, tiny(max_steps=100_000), CPU_MACHINE)
    flags = _flags_while_running(engine, run_id)
    assert len(flags) >= 4
    shown = _show(engine, run_id)  # `ddpdash show RUN` says what the page says
    if perturbed:
        named = [f for look in flags for f in look]
        assert sum("rank 1 is the straggler" in f for f in named) >= len(flags) - 1, flags  # within two refreshes
        assert not any("rank 0 is the straggler" in f for f in named), flags
        assert "  straggler rank 1 is the straggler: the others wait ≈" in shown, shown
        # The supervisor names it too, once, as an event (an alert where a webhook is set).
        wait_for(lambda: _straggler_events(engine, run_id), 30)
        assert [r for r, _ in _straggler_events(engine, run_id)] == [1]
    else:
        assert flags == [[]] * len(flags), flags
        assert "  straggler none: no rank holds the others back" in shown, shown
        assert _straggler_events(engine, run_id) == []


def _straggler_events(engine: Engine, run_id: int) -> list[tuple[int, str]]:
    with Session(engine) as s:
        found = events(s, run_id)
    return [(int(e.rank), e.message) for e in found[found["kind"] == EventKind.STRAGGLER].itertuples()]


def _show(engine: Engine, run_id: int) -> str:
    import contextlib
    import io

    from ddpdash.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["--db-url", engine.url.render_as_string(hide_password=False), "show", str(run_id)]) == 0
    return out.getvalue()


# ---- 9: kill -9 and a restart leave no gap in any rank's steps ---------------------------------------------
@slow
def test_a_killed_rank_and_a_restart_leave_every_step_exactly_once(engine: Engine,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DDPDASH_TEST_FAULT", "sleep:0:0.01")
    run_id = launch(engine, tiny(max_steps=400, checkpoint_every=20, max_restarts=1), CPU_MACHINE)
    wait_for(lambda: _min_step(engine, run_id) >= 120, 120)
    os.kill(_worker_of_rank(engine, run_id, 1), signal.SIGKILL)  # its last second of metrics dies with it
    run = wait_final(engine, run_id, 180)
    assert run.status == RunStatus.SUCCEEDED, run.error
    assert_every_step_once(engine, run_id, 400)
    with Session(engine) as s:
        assert EventKind.RESTART in events(s, run_id)["kind"].tolist()


def test_without_error_files_the_ranks_own_failure_events_name_the_cause(engine: Engine, tmp_path: Path) -> None:
    """An mpirun run (or a rank without @record) leaves no torchrun error file: the supervisor reads the
    ranks' rank_failed events, first-hand failures before the peers that lost them."""
    from ddpdash.db.runs import add_event
    from ddpdash.trainer.rundir import RunDir
    from ddpdash.trainer.supervisor.watch import failures_from_events

    run_id = make_run(engine)
    with Session(engine) as s, s.begin():
        add_event(s, run_id, EventKind.RANK_FAILED, "rank 0: RuntimeError: Connection closed by peer", rank=0)
        add_event(s, run_id, EventKind.RANK_FAILED, "rank 1: ValueError: bad batch", rank=1, detail="Traceback …")
        add_event(s, run_id, EventKind.DESYNC, "not a failure")
    with Session(engine) as s:
        [cause] = failures_from_events(s, run_id, RunDir(tmp_path))
    assert (cause.rank, cause.message, cause.traceback) == (1, "rank 1: ValueError: bad batch", "Traceback …")
