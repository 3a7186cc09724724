"""The Live page's logic without Streamlit: progress, the per-rank table and its plain-words flags."""

from __future__ import annotations

import time

import pandas as pd

from ddpdash.dashboard import livedata
from ddpdash.dashboard.text import md_escape
from ddpdash.db.runs import RunInfo
from ddpdash.trainer import health


def run_info(status: str = "running", total: int | None = 100, started: float | None = None) -> RunInfo:
    now = time.time()
    return RunInfo(id=1, key="k", name="r", status=status, config={}, world_size=3, run_dir="", host="h",
                   created_at=now - 60, started_at=started or now - 50, ended_at=None, heartbeat_at=now,
                   total_steps=total, supervisor_pid=None, torchrun_pid=None, worker_pids=(), exit_code=None,
                   failed_ranks=(), error="", tags=(), notes="")


def states(steps: list[int], beats: list[float]) -> pd.DataFrame:
    return pd.DataFrame({"rank": range(len(steps)), "host": "h", "pid": 1, "device": "cpu", "status": "running",
                         "step": steps, "attempt": 0, "heartbeat_at": beats})


def cache_with(step_times: list[float]) -> livedata.SeriesCache:
    cache = livedata.SeriesCache(1)
    rows = [{"rank": r, "step": 10, "value": v, "vmin": v, "vmax": v, "time": 0.0, "count": 1}
            for r, v in enumerate(step_times)]
    cache.frames["step_time"] = pd.DataFrame(rows)
    return cache


def test_progress_uses_the_slowest_rank_and_estimates_eta() -> None:
    now = time.time()
    prog = livedata.progress(run_info(started=now - 50), states([20, 25, 30], [now] * 3), now=now)
    assert prog.done == 20 and prog.fraction == 0.2 and round(prog.eta_s or 0) == 200
    assert prog.text().startswith("20/100 steps")


def test_stale_heartbeat_is_flagged_as_a_frozen_or_dead_process() -> None:
    now = time.time()
    table = livedata.rank_table(run_info(), states([5, 5, 5], [now, now - 40, now]), cache_with([0.1] * 3), now)
    assert table.loc[1, "flag"] == "no heartbeat for 40 s: the process is frozen or dead"
    assert table.loc[0, "flag"] == ""


def test_a_rank_that_stops_stepping_is_flagged_though_its_heartbeat_is_fresh() -> None:
    now = time.time()
    cache = cache_with([0.1] * 3)
    # Every rank logged a point a second for 100 s; rank 2's points stopped 90 s ago (stuck in a collective).
    rows = [{"rank": r, "step": i, "value": 1.0, "vmin": 1.0, "vmax": 1.0, "count": 1,
             "time": now - 100 + i}
            for r in range(3) for i in range(100) if not (r == 2 and i > 10)]
    cache.frames["loss"] = pd.DataFrame(rows)
    table = livedata.rank_table(run_info(), states([99, 99, 10], [now] * 3), cache, now)
    assert table.loc[2, "flag"].startswith("no new step for 90 s") and "hung" in table.loc[2, "flag"]
    assert table.loc[0, "flag"] == "" and table.loc[1, "flag"] == ""


def test_a_slow_but_steady_rank_is_not_called_stalled() -> None:
    now = time.time()
    cache = cache_with([0.1] * 3)
    # One point every 30 s: 70 s of quiet is two intervals and a bit, not a hang.
    cache.frames["loss"] = pd.DataFrame([{"rank": 0, "step": i, "value": 1.0, "vmin": 1.0, "vmax": 1.0, "count": 1,
                                          "time": now - 70 - 30 * (5 - i)} for i in range(6)])
    table = livedata.rank_table(run_info(), states([5, 5, 5], [now] * 3), cache, now)
    assert table.loc[0, "flag"] == ""


def test_the_rank_the_others_wait_for_is_the_straggler() -> None:
    """Ranks 0 and 1 wait 25 ms a step in the all-reduce for rank 2, which waits for nobody."""
    now = time.time()
    table = livedata.rank_table(run_info(), states([5, 5, 5], [now] * 3), cache_with([0.035, 0.036, 0.010]), now)
    assert table.loc[2, "flag"] == ("rank 2 is the straggler: the others wait ≈ 26 ms per step for it "
                                    "(their steps take 36 ms, its own 10 ms)")
    assert table.loc[0, "flag"] == "" and table.loc[1, "flag"] == ""


def test_noise_between_healthy_ranks_is_not_a_straggler() -> None:
    """Two ranks whose single steps differ 1.7–3.4× from one point to the next (what a healthy 2-rank run
    on 2 cores logs), alternating: their medians over the window agree."""
    rows = []
    for step in range(1, 61):
        slow = step % 2  # which rank had the slow step this time
        for rank in (0, 1):
            v = 0.0008 * (3.4 if rank == slow and step % 3 else 1.7 if rank == slow else 1.0)
            rows.append({"rank": rank, "step": step, "value": v, "vmin": v, "vmax": v, "time": 0.0, "count": 1})
    assert health.find_straggler(pd.DataFrame(rows)) is None


def test_finished_runs_are_not_flagged() -> None:
    now = time.time()
    table = livedata.rank_table(run_info(status="succeeded"), states([5, 5, 5], [now - 999] * 3),
                                cache_with([0.1, 0.1, 0.9]), now)
    assert (table["flag"] == "").all()


def test_series_cache_fetches_only_new_points(engine) -> None:  # type: ignore[no-untyped-def]
    from sqlalchemy.orm import Session

    from ddpdash.trainer.metrics import direct_logger
    from tests.conftest import make_run

    run_id = make_run(engine)
    w = direct_logger(engine, run_id, 0, send_interval_s=3600)
    for step in range(1, 11):
        w.log(step, {"loss": float(step)})
    w.flush()
    cache = livedata.SeriesCache(run_id)
    with Session(engine) as s:
        cache.refresh(s, ("loss",))
    w.log(11, {"loss": 11.0})
    w.close()
    with Session(engine) as s:
        cache.refresh(s, ("loss",))
    assert cache.get("loss")["step"].tolist() == list(range(1, 12))


def test_user_text_cannot_become_markdown() -> None:
    assert md_escape("**bold** [x](javascript:alert(1)) :red[y] <b>") == (
        r"\*\*bold\*\* \[x\]\(javascript\:alert\(1\)\) \:red\[y\] \<b\>")
