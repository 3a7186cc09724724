"""The Streamlit app through AppTest: real pages, real database, real runs for the launch journey."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session
from streamlit.testing.v1 import AppTest

from ddpdash.db.queries import rank_states
from ddpdash.db.runs import get_run, list_runs
from ddpdash.trainer.config import RunConfig
from tests.conftest import ROOT, wait_final, wait_for
from tests.seed import seed_run

APP = str(ROOT / "dashboard" / "app.py")


def open_page(script: str | None = None, **query: str) -> AppTest:
    at = AppTest.from_file(APP, default_timeout=90)
    for key, value in query.items():
        at.query_params[key] = value
    at.run()
    if script:
        at.switch_page(script)
        for key, value in query.items():
            at.query_params[key] = value
        at.run()
    return ran(at)


def ran(at: AppTest) -> AppTest:
    """Every step of a page test: the page must have raised nothing."""
    assert not at.exception, [e.value for e in at.exception]
    return at


def errors(at: AppTest) -> list[str]:
    return [e.value for e in at.error]


def chart_specs(at: AppTest) -> list[dict]:
    return [json.loads(c.proto.spec) for c in at.get("vega_lite_chart")]


def chart_rows(at: AppTest) -> list[list[dict]]:
    """The data rows each chart sent to the browser (Streamlit ships them as Arrow tables)."""
    import pyarrow as pa

    out = []
    for c in at.get("vega_lite_chart"):
        rows: list[dict] = []
        for dataset in c.proto.datasets:
            rows.extend(pa.ipc.open_stream(dataset.data.data).read_all().to_pylist())
        out.append(rows)
    return out


# ---- New run -----------------------------------------------------------------------------------
def test_batch_size_zero_is_shown_next_to_the_field_and_nothing_launches(engine: Engine, home: Path) -> None:
    at = open_page("views/new_run.py")
    ran(at.number_input(key="cfg_batch_size").set_value(0).run())
    assert "Batch size must be ≥ 1, got 0" in errors(at)
    ran(next(b for b in at.button if b.label == "Launch").click().run())
    assert "Nothing was launched: fix the problems shown next to the fields." in errors(at)
    with Session(engine) as s:
        assert list_runs(s) == []
    assert not (home / "runs").exists()


def test_nccl_on_a_cpu_machine_is_refused(engine: Engine) -> None:
    at = open_page("views/new_run.py")
    ran(at.selectbox(key="cfg_backend").select("nccl").run())
    assert any("nccl needs CUDA GPUs" in e for e in errors(at))
    ran(next(b for b in at.button if b.label == "Launch").click().run())
    with Session(engine) as s:
        assert list_runs(s) == []


def test_fp16_is_not_offered_on_cpu(engine: Engine) -> None:
    at = open_page("views/new_run.py")
    assert at.selectbox(key="cfg_amp").options == ["off", "bf16"]


def test_summary_shows_global_batch_and_scaled_lr(engine: Engine) -> None:
    at = open_page("views/new_run.py")
    ran(at.number_input(key="cfg_batch_size").set_value(16).run())
    text = " ".join(m.value for m in at.markdown)
    assert "32 = 16 × 2 ranks × 1 accum" in text and "0.1 (0.05 × 2 ranks)" in text


def test_command_previews_match_the_form(engine: Engine) -> None:
    at = open_page("views/new_run.py")
    ran(at.number_input(key="cfg_batch_size").set_value(8).run())
    codes = [c.value for c in at.code]
    assert codes[0] == "ddpdash launch --batch-size 8"
    assert "torch.distributed.run" in codes[1] and "--nproc-per-node 2" in codes[1]


def test_size_preset_fills_the_model_fields(engine: Engine) -> None:
    at = open_page("views/new_run.py")
    ran(at.selectbox(key="_preset").select("tiny").run())
    assert at.number_input(key="cfg_width").value == 16 and at.number_input(key="cfg_depth").value == 1


def test_clone_prefills_the_form(engine: Engine) -> None:
    run_id = seed_run(engine, RunConfig(name="orig", batch_size=12, lr=0.2), steps=5)
    at = open_page("views/new_run.py", clone=str(run_id))
    assert at.number_input(key="cfg_batch_size").value == 12
    assert at.text_input(key="cfg_name").value == "orig-clone"


@pytest.mark.slow
def test_launch_from_the_form_then_watch_and_stop(engine: Engine) -> None:
    at = open_page("views/new_run.py")
    ran(at.text_input(key="cfg_name").input("from-the-form").run())
    ran(at.number_input(key="cfg_max_steps").set_value(1_000_000).run())
    ran(at.number_input(key="cfg_width").set_value(16).run())
    ran(next(b for b in at.button if b.label == "Launch").click().run())
    with Session(engine) as s:
        runs = list_runs(s)
    assert len(runs) == 1 and runs[0].name == "from-the-form"
    run_id = runs[0].id
    assert at.query_params["run"] == str(run_id)  # st.switch_page asked for the Live page of the new run
    wait_for(lambda: _steps(engine, run_id) >= 3, 90)
    at = open_page("views/live.py", run=str(run_id))  # AppTest does not follow switch_page by itself
    ranks = next(df.value for df in at.dataframe if "heartbeat age (s)" in df.value.columns)
    assert ranks["rank"].tolist() == [0, 1] and (ranks["step"] > 0).all()
    loss_rows = chart_rows(at)[0]
    assert {r["series"] for r in loss_rows} >= {"rank 0", "rank 1", "mean of ranks"}
    ran(next(b for b in at.button if b.label == "Yes, stop it").click().run())
    assert wait_final(engine, run_id, 15).status == "stopped"


def _steps(engine: Engine, run_id: int) -> int:
    with Session(engine) as s:
        states = rank_states(s, run_id)
    return int(states["step"].min()) if len(states) == 2 else 0


# ---- Live --------------------------------------------------------------------------------------
def test_live_without_runs_points_to_new_run(engine: Engine) -> None:
    at = open_page()
    assert any("No runs yet" in i.value for i in at.info)


def test_live_shows_a_failed_runs_traceback(engine: Engine) -> None:
    from ddpdash.db.runs import add_event
    run_id = seed_run(engine, RunConfig(name="broken"), steps=20, status="failed")
    with Session(engine) as s, s.begin():
        add_event(s, run_id, "rank_failed", "rank 1: RuntimeError: boom", rank=1, detail="Traceback ...\nboom")
    at = open_page(run=str(run_id))
    assert any("rank_failed" in e.label for e in at.expander)
    assert any("Traceback ...\nboom" in c.value for c in at.code)


@pytest.mark.slow
def test_a_million_point_run_reaches_the_browser_within_the_point_budget(engine: Engine) -> None:
    from ddpdash.db.queries import DEFAULT_POINT_BUDGET

    cfg = RunConfig(name="big", num_procs=8)
    t0 = time.time()
    run_id = seed_run(engine, cfg, steps=125_000, metrics=("loss",))
    assert time.time() - t0 < 120
    at = open_page(run=str(run_id))
    rows = chart_rows(at)[0]
    per_series: dict[str, int] = {}
    for r in rows:
        per_series[r["series"]] = per_series.get(r["series"], 0) + 1
    assert len(per_series) == 9  # 8 ranks and their mean
    assert max(per_series.values()) <= DEFAULT_POINT_BUDGET
    assert min(per_series.values()) >= DEFAULT_POINT_BUDGET // 4  # downsampled, not starved


# ---- Runs --------------------------------------------------------------------------------------
def test_runs_page_edits_tags_and_deletes_a_run(engine: Engine, home: Path) -> None:
    keep = seed_run(engine, RunConfig(name="keep"), steps=10)
    doomed = seed_run(engine, RunConfig(name="doomed"), steps=10)
    at = open_page("views/runs.py")
    table = next(df.value for df in at.dataframe if "final_loss" in df.value.columns)
    assert sorted(table["id"].tolist()) == [keep, doomed]
    ran(at.selectbox(key="manage_pick").select(keep).run())
    next(t for t in at.text_input if t.label == "Tags (comma-separated)").input("baseline, fast")
    ran(next(b for b in at.button if b.label == "Save").click().run())  # a form: values go in on submit
    with Session(engine) as s:
        assert get_run(s, keep).tags == ("baseline", "fast")
    ran(at.selectbox(key="manage_pick").select(doomed).run())
    ran(next(b for b in at.button if b.label == "Yes, delete it").click().run())
    with Session(engine) as s:
        assert [r.id for r in list_runs(s)] == [keep]


# ---- Compare -----------------------------------------------------------------------------------
def _three_runs(engine: Engine) -> list[int]:
    base = RunConfig(name="scale", recipe="mlp")
    return [
        seed_run(engine, base.replace(name="w1", num_procs=1), speed_per_rank=1000.0),
        seed_run(engine, base.replace(name="w2", num_procs=2), speed_per_rank=900.0),
        seed_run(engine, base.replace(name="w2-adam", num_procs=2, optimizer="adam"), speed_per_rank=950.0),
    ]


def test_compare_shows_overlay_diff_and_summary(engine: Engine) -> None:
    ids = _three_runs(engine)
    at = open_page("views/compare.py", runs=",".join(map(str, ids)))
    assert at.multiselect[0].value == ids
    overlay = chart_rows(at)[0]
    assert {r["series"] for r in overlay} == {f"#{ids[0]} w1", f"#{ids[1]} w2", f"#{ids[2]} w2-adam"}
    frames = [df.value for df in at.dataframe]
    diff = next(df for df in frames if "setting" in df.columns)
    assert set(diff["setting"]) == {"name", "num_procs", "optimizer"}
    summary = next(df for df in frames if "best_loss" in df.columns)
    assert len(summary) == 3
    scaling = next(df for df in frames if "efficiency" in df.columns)
    row = scaling[scaling["world_size"] == 2].iloc[0]
    assert row["efficiency"] == pytest.approx(0.9)


def test_compare_choice_round_trips_through_the_url(engine: Engine) -> None:
    ids = _three_runs(engine)
    at = open_page("views/compare.py")
    ran(at.multiselect[0].set_value(ids[:2]).run())
    assert at.query_params["runs"] == f"{ids[0]},{ids[1]}"
    again = open_page("views/compare.py", runs=at.query_params["runs"])
    assert again.multiselect[0].value == ids[:2]


def test_runs_and_compare_show_the_same_final_loss_for_a_long_run(engine: Engine) -> None:
    """Final loss is each rank's last logged value, averaged over ranks, on every page (db.queries.
    run_metric_summaries); a 5,000-step run is downsampled for the charts, which must not change it."""
    import math

    ids = [seed_run(engine, RunConfig(name=name, num_procs=2), steps=5000) for name in ("long-a", "long-b")]
    expected = 2.0 * math.exp(-4) + 0.1 + 0.005  # tests/seed.py: the last step's loss, mean of ranks 0 and 1
    runs = open_page("views/runs.py")
    table = next(df.value for df in runs.dataframe if "final_loss" in df.value.columns).set_index("id")
    compare = open_page("views/compare.py", runs=",".join(map(str, ids)))
    summary = next(df.value for df in compare.dataframe if "best_loss" in df.value.columns).set_index("run")
    for run_id, name in zip(ids, ("long-a", "long-b"), strict=True):
        assert table.loc[run_id, "final_loss"] == pytest.approx(expected)
        assert summary.loc[f"#{run_id} {name}", "final_loss"] == pytest.approx(expected)


def test_an_edited_run_shows_at_once_and_a_deleted_one_is_not_offered(engine: Engine) -> None:
    run_id = seed_run(engine, RunConfig(name="before"), steps=10)
    other = seed_run(engine, RunConfig(name="other"), steps=10)
    at = open_page("views/runs.py")
    ran(at.selectbox(key="manage_pick").select(run_id).run())
    next(t for t in at.text_input if t.label == "Name").input("after")
    ran(next(b for b in at.button if b.label == "Save").click().run())
    table = next(df.value for df in at.dataframe if "final_loss" in df.value.columns)
    assert table.set_index("id").loc[run_id, "name"] == "after"  # not the cached table of a moment ago
    from ddpdash.trainer.control import delete_run

    delete_run(engine, other)  # from another tab, or the CLI, while this page shows it
    ran(at.selectbox(key="manage_pick").select(other).run())  # the stale choice: a message, not a traceback
    ran(at.run())


def test_an_export_is_built_only_when_asked(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    from ddpdash.db import queries

    run_id = seed_run(engine, RunConfig(name="exported"), steps=10)
    calls: list[int] = []
    real = queries.all_points
    monkeypatch.setattr(queries, "all_points", lambda s, rid: calls.append(rid) or real(s, rid))
    at = open_page("views/runs.py")
    ran(at.selectbox(key="manage_pick").select(run_id).run())
    ran(at.run())
    assert calls == []  # the page was drawn twice with the export buttons, and built no export
    assert [b.label for b in at.get("download_button")] == ["Export CSV", "Export JSON"]
