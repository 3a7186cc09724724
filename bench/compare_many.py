"""Compare at size: 10 runs × 8 ranks × 1M steps of loss (and samples/s). The Compare page's work — load the
comparison (rollups at its point budget), the overlay frame and chart, and the summary table — against a SQL
GROUP BY downsample of the same points stored one row per point, in the same run. Target ≤ 150 ms.

    python bench/compare_many.py [--quick | --smoke]
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from sqlalchemy import text
from sqlalchemy.orm import Session

from bench.chart_query import copy_as_rows
from bench.common import Result, describe, interleaved, median_spread, ratios, run_main
from bench.seed import seed_big_run
from ddpdash.dashboard import charts, history
from ddpdash.db.migrate import open_store

METRICS = ("loss", "samples_per_s")


def ddpdash_path(engine, run_ids: list[int]) -> float:  # type: ignore[no-untyped-def]
    t = time.perf_counter()
    with Session(engine) as s:
        comp = history.load_comparison(s, run_ids)
    charts.overlay_chart(history.overlay_frame(comp))
    history.summary_table(comp)
    return time.perf_counter() - t


def group_by_path(engine, run_ids: list[int], steps: int, budget: int = 2000) -> float:  # type: ignore[no-untyped-def]
    """Per run and rank, buckets of the same width as the chart's from the rows, and each run's last loss."""
    t = time.perf_counter()
    width = max(1, steps // budget + 1)
    with engine.connect() as conn:
        for run_id in run_ids:
            conn.execute(text("SELECT rank, max(step), avg(value), min(value), max(value) FROM point_rows "
                              "WHERE run_id = :run_id AND name = 'loss' GROUP BY rank, step / :width"),
                         {"run_id": run_id, "width": width}).all()
            conn.execute(text("SELECT rank, value FROM point_rows WHERE run_id = :run_id AND name = 'loss' "
                              "AND step = (SELECT max(step) FROM point_rows WHERE run_id = :run_id)"),
                         {"run_id": run_id}).all()
    return time.perf_counter() - t


def measure(runs: int, ranks: int, steps: int, repeats: int) -> list[Result]:
    with tempfile.TemporaryDirectory() as folder:
        engine = open_store(f"sqlite:///{folder}/bench.db")
        t = time.perf_counter()
        run_ids = [seed_big_run(engine, ranks, steps, METRICS, status="succeeded") for _ in range(runs)]
        print(f"seeded {runs} runs × {ranks} ranks × {steps:,} steps × {len(METRICS)} metrics in "
              f"{time.perf_counter() - t:.0f} s through the writer")
        for run_id in run_ids:
            copy_as_rows(engine, run_id)
        ddpdash_path(engine, run_ids)  # warm the page cache, as a dashboard that has drawn once
        times = interleaved({
            "ddpdash (Compare: rollups, overlay chart, summary)": lambda: ddpdash_path(engine, run_ids),
            "SQL GROUP BY downsample of the rows": lambda: group_by_path(engine, run_ids, steps),
        }, repeats)
    for name, values in times.items():
        print("  " + describe(name, [v * 1000 for v in values], " ms"))
    names = list(times)
    med, spread = median_spread(times[names[0]])
    ratio, _ = median_spread(ratios(times[names[0]], times[names[1]]))
    print(f"  ddpdash / GROUP BY: {ratio:.3f}×")
    return [Result(f"compare {runs} runs × {ranks} ranks × {steps:,} points",
                   f"{med * 1000:.0f} ms (spread {spread * 1000:.0f}; {ratio:.2g}× the GROUP BY)", "≤ 150 ms",
                   med <= 0.150)]


# Arguments of measure() for each mode: --smoke (the test suite), --quick, and the full run.
SIZES = {"smoke": (3, 2, 2_000, 2), "quick": (10, 8, 100_000, 5), "full": (10, 8, 1_000_000, 7)}


def main() -> None:
    run_main(__doc__, SIZES, measure)


if __name__ == "__main__":
    main()
