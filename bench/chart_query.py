"""Target 3 — chart query: a run of 1,000,000 points (8 ranks × 125k steps); the time to get what the
Live/Compare loss chart needs (≤ a few thousand points per line, peaks kept) and build the chart,
against a SQL GROUP BY downsample of the raw points and against reading every row. Target ≤ 50 ms.

    python bench/chart_query.py [--quick | --smoke]
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from sqlalchemy import text
from sqlalchemy.orm import Session

from bench.common import INSERT_ROW_SQL, ROW_TABLE_DDL, Result, describe, interleaved, median_spread, ratios, run_main
from bench.seed import seed_big_run
from ddpdash.dashboard.charts import loss_chart
from ddpdash.db.migrate import open_store
from ddpdash.db.queries import DEFAULT_POINT_BUDGET, all_points, metric_series


def ddpdash_path(engine, run_id: int) -> float:  # type: ignore[no-untyped-def]
    t = time.perf_counter()
    with Session(engine) as s:
        df = metric_series(s, run_id, "loss", max_points=DEFAULT_POINT_BUDGET)
    loss_chart(df)
    assert df.groupby("rank").size().max() <= DEFAULT_POINT_BUDGET
    return time.perf_counter() - t


def group_by_path(engine, run_id: int, steps: int) -> float:  # type: ignore[no-untyped-def]
    t = time.perf_counter()
    width = max(1, steps // DEFAULT_POINT_BUDGET + 1)
    with engine.connect() as conn:
        conn.execute(text("SELECT rank, max(step), avg(value), min(value), max(value) FROM point_rows "
                          "WHERE run_id = :run_id AND name = 'loss' GROUP BY rank, step / :width"),
                     {"run_id": run_id, "width": width}).all()
    return time.perf_counter() - t


def read_all_path(engine, run_id: int) -> float:  # type: ignore[no-untyped-def]
    t = time.perf_counter()
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT rank, step, value FROM point_rows WHERE run_id = :run_id AND name = 'loss'"),
                            {"run_id": run_id}).all()
    [dict(rank=r, step=st, value=v) for r, st, v in rows]  # what to_dict would hand the browser
    return time.perf_counter() - t


def copy_as_rows(engine, run_id: int) -> None:  # type: ignore[no-untyped-def]
    """The run's points also as one row per point, for the two baselines (ddpdash stores them in chunks)."""
    with Session(engine) as s:
        points = all_points(s, run_id)
    rows = zip([run_id] * len(points), points["rank"].tolist(), points["step"].tolist(), points["metric"].tolist(),
               points["value"].tolist(), points["time"].tolist(), strict=True)
    with engine.begin() as conn:
        for ddl in ROW_TABLE_DDL:
            conn.exec_driver_sql(ddl)
        conn.exec_driver_sql(INSERT_ROW_SQL, list(rows))


def measure(ranks: int, steps: int, repeats: int) -> list[Result]:
    with tempfile.TemporaryDirectory() as folder:
        engine = open_store(f"sqlite:///{folder}/bench.db")
        t = time.perf_counter()
        run_id = seed_big_run(engine, ranks, steps)
        print(f"seeded {ranks * steps:,} points in {time.perf_counter() - t:.1f} s through the writer")
        copy_as_rows(engine, run_id)
        ddpdash_path(engine, run_id)  # warm the page cache, as a dashboard that has drawn once
        times = interleaved({
            "ddpdash (rollups + chart)": lambda: ddpdash_path(engine, run_id),
            "SQL GROUP BY downsample": lambda: group_by_path(engine, run_id, steps),
            "read every row": lambda: read_all_path(engine, run_id),
        }, repeats)
    for name, values in times.items():
        print("  " + describe(name, [v * 1000 for v in values], " ms"))
    for other in ("SQL GROUP BY downsample", "read every row"):
        speedup, _ = median_spread(ratios(times[other], times["ddpdash (rollups + chart)"]))
        print(f"  {other} / ddpdash: {speedup:.1f}×")
    med, spread = median_spread(times["ddpdash (rollups + chart)"])
    return [Result(f"chart query ({ranks * steps:,} points)", f"{med * 1000:.1f} ms (spread {spread * 1000:.1f})",
                   "≤ 50 ms", med <= 0.050)]


# Arguments of measure() for each mode: --smoke (the test suite), --quick, and the full run.
SIZES = {"smoke": (2, 5_000, 2), "quick": (8, 125_000, 5), "full": (8, 125_000, 15)}


def main() -> None:
    run_main(__doc__, SIZES, measure)


if __name__ == "__main__":
    main()
