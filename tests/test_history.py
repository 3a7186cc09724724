"""Run history and comparison logic on seeded databases."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
from sqlalchemy import Engine, func, select
from sqlalchemy.orm import Session

from ddpdash.dashboard import history
from ddpdash.db.models import MetricChunk, MetricRollup, RankState, RunEvent
from ddpdash.db.runs import get_run, list_runs, update_run
from ddpdash.trainer.config import RunConfig
from ddpdash.trainer.control import DeleteError, delete_run
from ddpdash.trainer.rundir import new_run_dir
from tests.seed import seed_run


@pytest.fixture
def seeded(engine: Engine) -> dict[str, int]:
    ids = {
        "a": seed_run(engine, RunConfig(name="alpha", recipe="mlp", num_procs=1), loss_scale=1.0, tags=("base",),
                      notes="first try"),
        "b": seed_run(engine, RunConfig(name="beta", recipe="cnn", num_procs=2), loss_scale=0.5, status="failed"),
        "c": seed_run(engine, RunConfig(name="gamma", recipe="mlp", num_procs=4), loss_scale=2.0, tags=("base", "big")),
    }
    return ids


def frame(engine: Engine) -> pd.DataFrame:
    with Session(engine) as s:
        return history.runs_frame(s)


def test_runs_frame_has_one_row_per_run_with_summaries(engine: Engine, seeded: dict[str, int]) -> None:
    df = frame(engine).set_index("id")
    assert len(df) == 3
    a = df.loc[seeded["a"]]
    assert a["world_size"] == 1 and a["global_batch"] == 32 and a["backend"] == "gloo" and a["model"] == "mlp"
    assert a["final_loss"] == pytest.approx(2.0 * pytest.importorskip("math").exp(-4) + 0.1, rel=1e-6)
    assert a["best_loss"] <= a["final_loss"] and a["samples_per_s"] == pytest.approx(1000.0)
    assert df.loc[seeded["c"]]["samples_per_s"] == pytest.approx(4000.0)


def test_filters(engine: Engine, seeded: dict[str, int]) -> None:
    df = frame(engine)
    ids = lambda f: sorted(history.filter_runs(df, f)["id"])  # noqa: E731
    assert ids(history.RunFilter(statuses=("failed",))) == [seeded["b"]]
    assert ids(history.RunFilter(models=("mlp",))) == sorted([seeded["a"], seeded["c"]])
    assert ids(history.RunFilter(tag="big")) == [seeded["c"]]
    assert ids(history.RunFilter(text="FIRST")) == [seeded["a"]]  # notes, case-insensitive
    assert ids(history.RunFilter(text="gam")) == [seeded["c"]]
    assert ids(history.RunFilter(backends=("nccl",))) == []


def test_sort_and_pages(engine: Engine, seeded: dict[str, int]) -> None:
    df = frame(engine)
    page, pages = history.sort_and_page(df, "best_loss", descending=False, page=1, page_size=2)
    assert pages == 2 and page["id"].tolist() == [seeded["b"], seeded["a"]]
    page2, _ = history.sort_and_page(df, "best_loss", descending=False, page=2, page_size=2)
    assert page2["id"].tolist() == [seeded["c"]]
    with pytest.raises(ValueError, match="cannot sort by 'notes'"):
        history.sort_and_page(df, "notes")


def test_thousands_of_runs_page_in_order(engine: Engine) -> None:
    from ddpdash.db.runs import create_run

    with Session(engine) as s, s.begin():
        for i in range(2000):
            create_run(s, key=f"k{i}", name=f"run{i}", config_json=RunConfig().to_json(), world_size=2)
    df = frame(engine)
    page, pages = history.sort_and_page(df, "id", True, 3, 50)
    assert len(df) == 2000 and pages == 40
    assert page["id"].tolist() == list(range(2000 - 100, 2000 - 150, -1))  # newest first, the third 50


def test_config_diff_lists_exactly_the_differing_fields(engine: Engine, seeded: dict[str, int]) -> None:
    with Session(engine) as s:
        runs = [get_run(s, i) for i in seeded.values()]
    diff = history.config_diff(runs)
    assert set(diff["setting"]) == {"name", "recipe", "num_procs"}
    assert diff.set_index("setting").loc["recipe"].tolist() == ["mlp", "cnn", "mlp"]


def test_scaling_efficiency_on_known_numbers(engine: Engine) -> None:
    base = RunConfig(name="s", recipe="mlp")
    ids = [seed_run(engine, base.replace(num_procs=1), speed_per_rank=1000.0),
           seed_run(engine, base.replace(num_procs=2), speed_per_rank=900.0),
           seed_run(engine, base.replace(num_procs=4), speed_per_rank=800.0)]
    with Session(engine) as s:
        table = history.scaling_table(history.load_comparison(s, ids)).set_index("world_size")
    assert table.loc[2, "efficiency"] == pytest.approx(0.9) and table.loc[4, "efficiency"] == pytest.approx(0.8)
    assert table.loc[4, "ideal_samples_per_s"] == pytest.approx(4000.0)
    assert "the 1-process run" in table.loc[4, "baseline"]


def test_scaling_without_a_one_process_run_says_which_baseline(engine: Engine) -> None:
    base = RunConfig(name="s")
    ids = [seed_run(engine, base.replace(num_procs=2), speed_per_rank=1000.0),
           seed_run(engine, base.replace(num_procs=4), speed_per_rank=500.0)]
    with Session(engine) as s:
        table = history.scaling_table(history.load_comparison(s, ids)).set_index("world_size")
    assert table.loc[4, "efficiency"] == pytest.approx(0.5)
    assert "smallest world size present (2" in table.loc[4, "baseline"]


def test_runs_of_different_configs_are_not_compared_for_scaling(engine: Engine) -> None:
    ids = [seed_run(engine, RunConfig(num_procs=1)), seed_run(engine, RunConfig(num_procs=2, lr=0.3))]
    with Session(engine) as s:
        assert history.scaling_table(history.load_comparison(s, ids)).empty


def test_x_axis_transforms(engine: Engine) -> None:
    run_id = seed_run(engine, RunConfig(num_procs=2, batch_size=8, grad_accum_steps=2), steps=10, start=1000.0,
                      step_seconds=0.5)
    with Session(engine) as s:
        comp = history.load_comparison(s, [run_id])
    run = comp.runs[0]
    loss = comp.loss[run_id]
    assert history.with_x(loss, run, "step")["x"].tolist() == loss["step"].astype(float).tolist()
    assert history.with_x(loss, run, "samples")["x"].tolist() == (loss["step"] * 32).tolist()
    assert history.with_x(loss, run, "time")["x"].tolist() == pytest.approx((loss["step"] * 0.5).tolist())
    with pytest.raises(ValueError, match="x axis must be one of"):
        history.with_x(loss, run, "epochs")


def test_overlay_mean_and_band(engine: Engine) -> None:
    run_id = seed_run(engine, RunConfig(num_procs=2), steps=5)
    with Session(engine) as s:
        comp = history.load_comparison(s, [run_id])
    mean = history.overlay_frame(comp, "step")
    per_rank = history.overlay_frame(comp, "step", per_rank=True)
    assert len(mean) == 5 and len(per_rank) == 10
    assert (mean["lo"] <= mean["value"]).all() and (mean["value"] <= mean["hi"]).all()
    assert (mean["hi"] - mean["lo"]).round(6).eq(0.01).all()  # rank 1 logs 0.01 above rank 0


def test_target_loss_summary(engine: Engine) -> None:
    run_id = seed_run(engine, RunConfig(num_procs=1), steps=100, start=0.0, step_seconds=1.0)
    with Session(engine) as s:
        comp = history.load_comparison(s, [run_id])
    row = history.summary_table(comp, target_loss=1.0).iloc[0]
    first = next(step for step in range(1, 101) if 2.0 * __import__("math").exp(-step / 25) + 0.1 <= 1.0)
    assert row["time_to_target_s"] == pytest.approx(first) and row["samples_to_target"] == first * 32
    assert pd.isna(history.summary_table(comp, target_loss=0.01).iloc[0]["time_to_target_s"])


def test_url_run_ids_parse_leniently() -> None:
    assert history.parse_run_ids("3,5, 9,x,3") == [3, 5, 9]
    assert history.parse_run_ids(["1", "2,4"]) == [1, 2, 4]
    assert history.parse_run_ids(None) == []


def _count(engine: Engine, model: type, run_id: int) -> int:
    with Session(engine) as s:
        return int(s.scalar(select(func.count()).select_from(model).where(model.run_id == run_id)) or 0)


def test_delete_removes_every_row_and_file_of_a_run_and_nothing_else(engine: Engine, home: Path) -> None:
    keep = seed_run(engine, RunConfig(num_procs=2), steps=20)
    doomed = seed_run(engine, RunConfig(num_procs=2), steps=20)
    folders = {}
    for run_id in (keep, doomed):
        folder = new_run_dir(run_id)
        folder.checkpoint.write_bytes(b"x")
        folder.logs.mkdir()
        with Session(engine) as s, s.begin():
            update_run(s, run_id, run_dir=str(folder.path))
            from ddpdash.db.runs import add_event

            add_event(s, run_id, "note", "hello")
        folders[run_id] = folder
    delete_run(engine, doomed)
    for model in (MetricChunk, MetricRollup, RankState, RunEvent):
        assert _count(engine, model, doomed) == 0
        assert _count(engine, model, keep) > 0
    assert not folders[doomed].path.exists() and folders[keep].checkpoint.exists()
    with Session(engine) as s:
        assert [r.id for r in list_runs(s)] == [keep]


def test_delete_refuses_a_running_run(engine: Engine) -> None:
    run_id = seed_run(engine, RunConfig(), steps=5, status="running")
    with pytest.raises(DeleteError, match="stop it before deleting it"):
        delete_run(engine, run_id)


def test_the_runs_page_in_sql_matches_the_whole_table(engine: Engine, seeded: dict[str, int]) -> None:
    """history.runs_page (filtered, sorted and paged in SQL) shows what filtering and sorting the whole table
    shows, for each filter and sort."""
    with Session(engine, expire_on_commit=False) as s, s.begin():
        update_run(s, seeded["b"], sweep="sw", group_name="sw g1", notes="Fast one")
    with Session(engine) as s:
        whole = history.runs_frame(s)
        for f in (history.RunFilter(), history.RunFilter(statuses=("failed",)), history.RunFilter(tag="base"),
                  history.RunFilter(sweep="sw"), history.RunFilter(text="fast")):
            for sort_by in ("id", "name", "final_loss", "world_size"):
                page = history.runs_page(s, f, sort_by, True, 1, 2)
                expected, pages = history.sort_and_page(history.filter_runs(whole, f), sort_by, True, 1, 2)
                assert page.rows["id"].tolist() == expected["id"].tolist(), (f, sort_by)
                assert (page.pages, page.total) == (pages, 3)
        second = history.runs_page(s, history.RunFilter(), "id", False, 2, 2)
    assert second.rows["id"].tolist() == [seeded["c"]] and second.matched == 3
