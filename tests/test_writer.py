"""A rank's metrics into the store (the rank's logger, db.store's RankWriter) and the downsampling queries."""

from __future__ import annotations

import multiprocessing as mp
import time

import pandas as pd
import pytest
from sqlalchemy import Engine, select
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from ddpdash.db import store
from ddpdash.db.columns import Batch, group_logs
from ddpdash.db.engine import make_engine
from ddpdash.db.models import ROLLUP_WIDTHS, MetricRollup
from ddpdash.db.queries import all_points, count_points, metric_series, rank_states
from ddpdash.db.store import RankWriter
from ddpdash.trainer.metrics import direct_logger
from tests.conftest import make_run, wait_for


def test_first_point_is_written_at_once_and_later_ones_wait_for_the_flush(engine: Engine) -> None:
    run_id = make_run(engine)
    w = direct_logger(engine, run_id, 0, send_interval_s=60)
    w.log(1, {"loss": 1.0})
    wait_for(lambda: points(engine, run_id) == 1, 5, every=0.02)
    w.log(2, {"loss": 0.5})  # returns at once; written at the next flush (60 s away) or at close
    with Session(engine) as s:
        assert count_points(s, run_id) == 1
    w.close(status="done")
    with Session(engine) as s:
        assert count_points(s, run_id) == 2
        assert rank_states(s, run_id).iloc[0]["status"] == "done"


def points(engine: Engine, run_id: int) -> int:
    with Session(engine) as s:
        return count_points(s, run_id)


def test_background_thread_flushes_within_a_second_or_so(engine: Engine) -> None:
    run_id = make_run(engine)
    w = direct_logger(engine, run_id, 0, send_interval_s=0.2)
    w.log(1, {"loss": 1.0})
    w.log(2, {"loss": 0.9})
    wait_for(lambda: points(engine, run_id) == 2, 5, every=0.05)
    w.close()


def test_heartbeat_and_step_update_with_each_flush(engine: Engine) -> None:
    run_id = make_run(engine)
    w = direct_logger(engine, run_id, 3, send_interval_s=60)
    before = time.time()
    w.log(7, {"loss": 0.5})
    w.flush()
    with Session(engine) as s:
        state = rank_states(s, run_id).iloc[0]
    assert state["rank"] == 3 and state["step"] == 7 and state["heartbeat_at"] >= before
    w.close()


def write_series(engine: Engine, run_id: int, rank: int, steps: int, flush_every: int = 997) -> list[float]:
    w = direct_logger(engine, run_id, rank, send_interval_s=3600)
    values = [((i * 7919) % 1000) / 10.0 for i in range(1, steps + 1)]
    for i, v in enumerate(values, start=1):
        w.log(i, {"loss": v})
        if i % flush_every == 0:
            w.flush()
    w.close()
    return values


def test_downsampled_series_respects_the_budget_and_keeps_peaks(engine: Engine) -> None:
    run_id = make_run(engine)
    values = write_series(engine, run_id, 0, 20_000)
    values[12_345] = 1e6  # a spike must survive downsampling
    w = direct_logger(engine, run_id, 1, send_interval_s=3600)
    for i, v in enumerate(values, start=1):
        w.log(i, {"loss": v})
    w.close()
    with Session(engine) as s:
        df = metric_series(s, run_id, "loss", max_points=500)
    assert set(df["rank"]) == {0, 1}
    assert df.groupby("rank").size().max() <= 500
    assert df[df["rank"] == 1]["vmax"].max() == 1e6
    assert df[df["rank"] == 0]["vmax"].max() == max(values[:12_345] + values[12_346:])
    assert df.groupby("rank")["count"].sum().tolist() == [20_000, 20_000]


def test_rollups_match_raw_aggregation_across_flush_boundaries(engine: Engine) -> None:
    run_id = make_run(engine)
    values = write_series(engine, run_id, 0, 5000, flush_every=333)
    with Session(engine) as s:
        df = metric_series(s, run_id, "loss", max_points=100)
    raw = pd.DataFrame({"step": range(1, 5001), "value": values})
    # 100 points for 5000 steps need buckets of ≥ 51 steps: the 64-step rollup level, read as stored.
    assert len(df) == 5000 // 64 + 1 and df["count"].sum() == 5000
    first = df.iloc[0]
    covered = raw[raw["step"] <= first["step"]]
    assert first["vmin"] == covered["value"].min() and first["vmax"] == covered["value"].max()
    assert first["step"] == 63 and abs(first["value"] - covered["value"].mean()) < 1e-9


@pytest.mark.parametrize("rewrite", ["upsert", "delete then insert"])
def test_every_rollup_matches_the_points_it_summarises(
    engine: Engine, monkeypatch: pytest.MonkeyPatch, rewrite: str
) -> None:
    """Both ways steps reach a writer — log() in the rank, relayed columns in the supervisor — with
    what real loops do: several metrics, an evaluation metric now and then, another key order, a batch
    the database refused once; every rollup row must equal the aggregate of its points. Open buckets
    are rewritten by an upsert on SQLite and PostgreSQL, by delete-then-insert on other databases."""
    if rewrite != "upsert":
        monkeypatch.setattr(store, "_UPSERT_ROLLUPS", {})
    run_id = make_run(engine)
    direct = direct_logger(engine, run_id, 0, send_interval_s=3600)
    relayed = RankWriter(engine, run_id, 1)
    steps = [(step, 1000.0 + step, loop_values(step)) for step in range(1, 3001)]
    for start in range(0, 3000, 250):
        chunk = steps[start : start + 250]
        for step, at, values in chunk:
            direct.log(step, values, at=at)
        batch = Batch(group_logs(chunk), [])
        if start == 1500:  # the database refuses this batch: it is held and written with the next one
            refuse_once(monkeypatch)
            with pytest.raises(OperationalError):
                relayed.write(batch)
        else:
            relayed.write(batch)
        direct.flush()
    direct.close()
    relayed.close(Batch([], []))
    with Session(engine) as s:
        points = all_points(s, run_id).rename(columns={"metric": "name"})
        rollups = pd.read_sql(select(MetricRollup).where(MetricRollup.run_id == run_id), s.connection())
    assert len(points) == 2 * sum(len(values) for _, _, values in steps)
    assert not points.duplicated(["rank", "name", "step"]).any()
    expected = pd.concat([aggregate(points, width) for width in ROLLUP_WIDTHS])
    got = rollups.drop(columns="run_id").set_index(["rank", "name", "width", "bucket"]).sort_index()
    pd.testing.assert_frame_equal(got, expected.loc[:, got.columns].sort_index(), check_dtype=False)


def test_a_long_outage_keeps_the_newest_steps_and_counts_the_rest(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_id = make_run(engine)
    relayed = RankWriter(engine, run_id, 0)
    monkeypatch.setattr(store, "MAX_BUFFERED_LOGS", 250)
    original = store.execute_many

    def refuse(*args: object) -> None:
        raise OperationalError("INSERT", {}, Exception("database is locked"))

    monkeypatch.setattr(store, "execute_many", refuse)
    for start in range(1, 501, 100):  # five batches of 100 steps, each refused
        with pytest.raises(OperationalError):
            relayed.write(Batch(group_logs([(step, float(step), {"loss": 1.0}) for step in range(start, start + 100)]),
                                []))
    monkeypatch.setattr(store, "execute_many", original)
    relayed.close(Batch([], []))
    assert relayed.dropped == 300  # whole batches, oldest first, until at most 250 steps wait
    with Session(engine) as s:
        assert metric_series(s, run_id, "loss", max_points=10_000)["step"].tolist() == list(range(301, 501))


def loop_values(step: int) -> dict[str, float]:
    values = {"loss": ((step * 7919) % 1000) / 10.0, "lr": 0.1 / (1 + step // 500)}
    if step % 100 == 0:
        values["val_loss"] = step / 1e4
    return dict(reversed(values.items())) if step % 7 == 0 else values


def refuse_once(monkeypatch: pytest.MonkeyPatch) -> None:
    original = store.execute_many

    def refuse(*args: object) -> None:
        monkeypatch.setattr(store, "execute_many", original)
        raise OperationalError("INSERT", {}, Exception("database is locked"))

    monkeypatch.setattr(store, "execute_many", refuse)


def aggregate(points: pd.DataFrame, width: int) -> pd.DataFrame:
    """The rollup rows of one width, computed from the points the slow, obvious way."""
    rows = points.sort_values("step").assign(width=width, bucket=points["step"] // width)
    return rows.groupby(["rank", "name", "width", "bucket"]).agg(
        step_min=("step", "min"), step_max=("step", "max"), vmin=("value", "min"), vmax=("value", "max"),
        vsum=("value", "sum"), count=("value", "size"), time_max=("time", "max"), vlast=("value", "last"))


def test_small_series_come_back_raw(engine: Engine) -> None:
    run_id = make_run(engine)
    values = write_series(engine, run_id, 0, 50)
    with Session(engine) as s:
        df = metric_series(s, run_id, "loss")
    assert df["value"].tolist() == values and df["step"].tolist() == list(range(1, 51))


def test_points_after_a_step_only(engine: Engine) -> None:
    run_id = make_run(engine)
    write_series(engine, run_id, 0, 300)
    with Session(engine) as s:
        df = metric_series(s, run_id, "loss", after_step=250)
    assert df["step"].tolist() == list(range(251, 301))


def test_a_window_of_a_long_run_reads_the_same_buckets_as_a_scan_of_the_level(engine: Engine) -> None:
    run_id = make_run(engine)
    for rank in (0, 2):  # not 0..n-1: the ranks come from the store
        write_series(engine, run_id, rank, 40_000, flush_every=9_973)
    with Session(engine) as s:
        window = metric_series(s, run_id, "loss", after_step=20_000)  # 20k steps at 1,000 points: width 32
        r = MetricRollup.__table__.c
        scan = s.execute(select(r.rank, r.step_max, r.vmin, r.vmax).where(
            r.run_id == run_id, r.name == "loss", r.width == 32, r.step_max > 20_000).order_by(r.rank, r.bucket)).all()
    assert [tuple(row) for row in window[["rank", "step", "vmin", "vmax"]].itertuples(index=False)] == \
        [tuple(row) for row in scan]
    assert window.groupby("rank")["step"].min().tolist() == [20_031, 20_031]  # the bucket 20,000 falls in


def test_resume_discards_steps_after_the_checkpoint(engine: Engine) -> None:
    """Stored in chunks 1–997 and 998–1000: the first is cut at the checkpoint, the second dropped;
    the other rank keeps everything."""
    run_id = make_run(engine)
    values = write_series(engine, run_id, 0, 1000)
    write_series(engine, run_id, 1, 1000)
    w = direct_logger(engine, run_id, 0, send_interval_s=3600, attempt=1, resume_after_step=600)
    for i in range(601, 701):
        w.log(i, {"loss": -1.0})
    w.close()
    with Session(engine) as s:
        raw = metric_series(s, run_id, "loss", max_points=10_000)
        coarse = metric_series(s, run_id, "loss", max_points=20)
        exported = all_points(s, run_id)
        stored = count_points(s, run_id)
    rank0, rank1 = raw[raw["rank"] == 0], raw[raw["rank"] == 1]
    assert rank0["step"].tolist() == list(range(1, 701))
    assert rank0["value"].tolist() == values[:600] + [-1.0] * 100
    assert rank1["step"].tolist() == list(range(1, 1001))
    assert coarse[coarse["rank"] == 0]["count"].sum() == 700 and coarse["vmin"].min() == -1.0
    assert stored == len(exported) == 1700


def _writer_process(db_url: str, run_id: int, rank: int, n: int) -> None:
    engine = make_engine(db_url)
    w = direct_logger(engine, run_id, rank, send_interval_s=0.05)
    for step in range(1, n + 1):
        w.log(step, {"loss": float(step), "samples_per_s": 1.0})
    w.close(status="done")


def test_four_writer_processes_and_a_polling_reader_lose_nothing(engine: Engine, db_url: str) -> None:
    run_id = make_run(engine)
    n = 20_000
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer_process, args=(db_url, run_id, r, n)) for r in range(4)]
    for p in procs:
        p.start()
    reads = 0
    while any(p.is_alive() for p in procs):
        with Session(engine) as s:
            metric_series(s, run_id, "loss")
            rank_states(s, run_id)
        reads += 1
        time.sleep(0.05)
    for p in procs:
        p.join()
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]
    with Session(engine) as s:
        assert count_points(s, run_id) == 4 * n * 2
        states = rank_states(s, run_id)
    assert states["status"].tolist() == ["done"] * 4 and reads > 0


def test_a_restarted_scripts_steps_replace_what_the_failed_attempt_stored(engine: Engine) -> None:
    """A user's script does not tell its checkpoint's step: a restarted attempt's logger marks its first
    batch, and from that step on the rank's points are the new attempt's, once each."""
    from ddpdash.trainer.metrics import RankLogger

    run_id = make_run(engine)
    first = direct_logger(engine, run_id, 0, send_interval_s=3600)
    for step in range(1, 11):
        first.log(step, {"loss": 1.0})
    first.close()
    second = RankLogger(RankWriter(engine, run_id, 0, attempt=1), 0, send_interval_s=3600, replaces_steps=True)
    for step in range(6, 9):  # resumed at step 6
        second.log(step, {"loss": -1.0})
    second.close()
    with Session(engine) as s:
        df = metric_series(s, run_id, "loss", max_points=10_000)
    assert df["step"].tolist() == list(range(1, 9))
    assert df["value"].tolist() == [1.0] * 5 + [-1.0] * 3


def test_consecutive_steps_are_not_stored_and_other_steps_are(engine: Engine) -> None:
    from ddpdash.db.models import MetricChunk

    run_id = make_run(engine)
    w = direct_logger(engine, run_id, 0, send_interval_s=3600)
    for step in range(1, 101):
        w.log(step, {"loss": 1.0 / step, "acc": 0.5})
    w.flush()
    for step in (110, 120, 125):  # log_every > 1, or a gap: the steps themselves are stored
        w.log(step, {"loss": 0.001})
    w.close(status="done")
    with Session(engine) as s:
        chunks = s.execute(select(MetricChunk.step_min, MetricChunk.count, MetricChunk.step_data,
                                  MetricChunk.value_data).order_by(MetricChunk.id)).all()
        every = all_points(s, run_id)
    assert [(lo, n, len(steps)) for lo, n, steps, _ in chunks] == [(1, 100, 0), (1, 100, 0), (110, 3, 24)]
    assert all(len(values) == 8 * n for _, n, _, values in chunks)  # 8 bytes a value; and 8 its time
    loss = every[every["metric"] == "loss"]
    assert loss["step"].tolist() == [*range(1, 101), 110, 120, 125]
    assert loss["value"].iloc[9] == pytest.approx(0.1)


def test_a_rank_that_writes_again_goes_on_from_its_buckets(engine: Engine) -> None:
    """A second writer for a rank (its supervisor gone, the rank writes itself) must extend the rollup buckets
    still filling, not overwrite them with its own points alone."""
    run_id = make_run(engine)
    first = direct_logger(engine, run_id, 0, send_interval_s=3600)
    for step in range(1, 101):
        first.log(step, {"loss": 1.0})
    first.close(status="running")
    second = direct_logger(engine, run_id, 0, send_interval_s=3600)
    for step in range(101, 111):
        second.log(step, {"loss": 3.0})
    second.close(status="done")
    with Session(engine) as s:
        whole = s.execute(select(MetricRollup.step_min, MetricRollup.count, MetricRollup.vsum).where(
            MetricRollup.run_id == run_id, MetricRollup.width == ROLLUP_WIDTHS[-1])).one()
        series = metric_series(s, run_id, "loss", max_points=5)
    assert tuple(whole) == (1, 110, 100 * 1.0 + 10 * 3.0)
    assert series["count"].sum() == 110 and series["step"].min() < 100
