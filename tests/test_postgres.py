"""ddpdash on PostgreSQL (the multi-node store): migrations, the writer, the queries and a real
two-rank torchrun run, against a private server started for these tests."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from ddpdash.dashboard import history
from ddpdash.db.engine import make_engine
from ddpdash.db.migrate import current_revision, head_revision, open_store
from ddpdash.db.queries import count_points, metric_series, rank_states
from ddpdash.trainer.control import delete_run
from ddpdash.trainer.metrics import direct_logger
from tests.conftest import make_run, run_in_dir, tiny, torchrun_by_hand
from tests.pg import postgres_server
from tests.test_migrations import check_points_survive_the_chunk_migration


@pytest.fixture(scope="module")
def pg_url() -> Iterator[str]:
    with postgres_server() as url:
        yield url


@pytest.fixture
def pg(pg_url: str) -> Iterator[Engine]:
    engine = open_store(pg_url)
    yield engine
    engine.dispose()


def test_migrations_reach_head_and_are_idempotent(pg: Engine, pg_url: str) -> None:
    assert current_revision(pg) == head_revision()
    open_store(pg_url).dispose()  # a second open is a no-op


def test_points_survive_the_move_to_chunks_on_postgres(pg: Engine) -> None:
    with pg.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("CREATE DATABASE from_0001"))
    check_points_survive_the_chunk_migration(make_engine(pg.url.set(database="from_0001")))


def test_writer_and_downsampling_on_postgres(pg: Engine) -> None:
    run_id = make_run(pg)
    w = direct_logger(pg, run_id, 0, send_interval_s=3600)
    for step in range(1, 5001):
        w.log(step, {"loss": 1.0 / step, "samples_per_s": 100.0})
        if step % 1000 == 0:
            w.flush()
    w.close(status="done")
    with Session(pg) as s:
        assert count_points(s, run_id) == 10_000
        df = metric_series(s, run_id, "loss", max_points=200)
        raw = metric_series(s, run_id, "loss", max_points=10_000)
        assert rank_states(s, run_id)["status"].tolist() == ["done"]
    assert len(df) <= 200 and df["count"].sum() == 5000 and df["vmax"].max() == 1.0
    assert raw["step"].tolist() == list(range(1, 5001))


def test_history_and_delete_on_postgres(pg: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DDPDASH_HOME", str(tmp_path))
    from ddpdash.trainer.config import RunConfig
    from tests.seed import seed_run

    a = seed_run(pg, RunConfig(name="pg-a", num_procs=1), steps=50)
    b = seed_run(pg, RunConfig(name="pg-b", num_procs=2), steps=50)
    with Session(pg) as s:
        frame = history.runs_frame(s).set_index("id")
    assert frame.loc[b, "samples_per_s"] == pytest.approx(2000.0)
    assert frame.loc[a, "final_loss"] == pytest.approx(2.0 * math.exp(-4) + 0.1)  # tests/seed.py's last loss
    with Session(pg) as s:  # the Runs page's SQL (filters, sort, page) on PostgreSQL
        whole = history.runs_frame(s)
        for f in (history.RunFilter(), history.RunFilter(text="PG-B"), history.RunFilter(statuses=("succeeded",))):
            for sort_by in ("name", "final_loss", "started"):
                page = history.runs_page(s, f, sort_by, False, 1, 1)
                expected, _ = history.sort_and_page(history.filter_runs(whole, f), sort_by, False, 1, 1)
                assert page.rows["id"].tolist() == expected["id"].tolist(), (f, sort_by)
    delete_run(pg, a)
    with Session(pg) as s:
        assert a not in history.runs_frame(s)["id"].tolist()


@pytest.mark.slow
def test_a_real_torchrun_run_writes_every_rank_to_postgres(pg: Engine, pg_url: str, tmp_path: Path) -> None:
    run_dir = tmp_path / "pg-run"
    result = torchrun_by_hand(tiny(max_steps=15), run_dir, pg_url)
    assert result.returncode == 0, result.stderr[-3000:]
    run = run_in_dir(pg, run_dir)
    with Session(pg) as s:
        loss = metric_series(s, run.id, "loss")
    assert run.status == "succeeded"
    assert loss.groupby("rank")["step"].max().to_dict() == {0: 15, 1: 15}


@pytest.mark.slow
def test_a_postgres_server_down_for_twenty_seconds_loses_nothing(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    from ddpdash.db.vocab import RunStatus
    from ddpdash.trainer.control import launch
    from tests.conftest import CPU_MACHINE, tiny, wait_final, wait_for
    from tests.pg import controlled_postgres_server
    from tests.test_faults import _min_step, assert_every_step_once

    monkeypatch.setenv("DDPDASH_HOME", str(tmp_path))
    monkeypatch.setenv("DDPDASH_TEST_FAULT", "sleep:0:0.02")
    with controlled_postgres_server() as server:
        engine = open_store(server.url)
        run_id = launch(engine, tiny(max_steps=600), CPU_MACHINE)
        wait_for(lambda: _min_step(engine, run_id) >= 10, 90)
        server.stop()
        time.sleep(20)
        server.start()
        run = wait_final(engine, run_id, 300)
        assert run.status == RunStatus.SUCCEEDED, run.error
        assert_every_step_once(engine, run_id, 600)
        engine.dispose()


def test_the_queue_lock_holds_on_postgres(pg: Engine, pg_url: str) -> None:
    """Five processes decide at once over runs that all want GPU 0 or 1, on PostgreSQL: one run per GPU."""
    import itertools
    import multiprocessing
    import socket

    from ddpdash.db.runs import create_run, get_run, update_run
    from ddpdash.db.vocab import RunStatus
    from ddpdash.trainer.config import RunConfig
    from tests.test_queue import _admit_in_a_process

    with Session(pg) as s, s.begin():
        ids = [create_run(s, key=f"pg-race-{i}", name=f"pg-race-{i}", world_size=1, admitted=False, run_dir="q",
                          host=socket.gethostname(), config_json=RunConfig(devices=(i % 2,)).to_json())
               for i in range(10)]
    with multiprocessing.get_context("spawn").Pool(5) as pool:
        admitted = list(itertools.chain.from_iterable(pool.starmap(_admit_in_a_process, [(pg_url, 20)] * 5)))
    assert sorted(admitted) == ids[:2]
    with Session(pg) as s, s.begin():
        assert [get_run(s, i).admitted_at is not None for i in ids] == [True, True] + [False] * 8
        for run_id in ids:
            update_run(s, run_id, status=RunStatus.CANCELLED)
