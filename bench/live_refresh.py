"""Target 4 — live refresh: one Live-page refresh for a running 8-rank run with 100k points per rank
(loss, samples/s, step and data-wait time): server time of the fragment's work — read only the
points newer than those held, rank table, charts — after one new step per rank. Also the cost of a
full first draw, for comparison. Target ≤ 100 ms.

    python bench/live_refresh.py [--quick | --smoke]
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from sqlalchemy.orm import Session

from bench.common import Result, describe, median_spread, run_main
from bench.seed import seed_big_run
from ddpdash.dashboard import charts, livedata
from ddpdash.db.migrate import open_store
from ddpdash.db.queries import events, rank_states
from ddpdash.db.runs import get_run
from ddpdash.trainer.metrics import direct_logger

METRICS = ("loss", "samples_per_s", "step_time", "data_time")


def refresh(engine, cache: livedata.SeriesCache, run_id: int) -> None:  # type: ignore[no-untyped-def]
    """What the Live fragment does each tick, minus Streamlit's own rendering."""
    with Session(engine) as s:
        run = get_run(s, run_id)
        states = rank_states(s, run_id)
        events(s, run_id)
        cache.refresh(s)
    livedata.progress(run, states)
    livedata.rank_table(run, states, cache)
    charts.loss_chart(cache.get("loss"))
    charts.throughput_chart(cache.get("samples_per_s"))
    charts.timing_chart(cache.get("step_time"), cache.get("data_time"))


def measure(ranks: int, steps: int, repeats: int) -> list[Result]:
    with tempfile.TemporaryDirectory() as folder:
        engine = open_store(f"sqlite:///{folder}/bench.db")
        t = time.perf_counter()
        run_id = seed_big_run(engine, ranks, steps, METRICS)
        print(f"seeded {ranks} ranks × {steps:,} steps × {len(METRICS)} metrics in {time.perf_counter() - t:.1f} s")
        writers = [direct_logger(engine, run_id, r, send_interval_s=3600) for r in range(ranks)]
        first, ticks = [], []
        for i in range(repeats):
            cache = livedata.SeriesCache(run_id)
            t = time.perf_counter()
            refresh(engine, cache, run_id)
            first.append(time.perf_counter() - t)
            for w in writers:  # the run moves on by one step between ticks
                w.log(steps + i + 1, {m: 1.0 for m in METRICS})
                w.flush()
            t = time.perf_counter()
            refresh(engine, cache, run_id)
            ticks.append(time.perf_counter() - t)
        for w in writers:
            w.close()
    print("  " + describe("first draw (all series, downsampled)", [v * 1000 for v in first], " ms"))
    print("  " + describe("refresh tick (new points only)", [v * 1000 for v in ticks], " ms"))
    med, spread = median_spread(ticks)
    return [Result(f"live refresh ({ranks} ranks × {steps:,} points)", f"{med * 1000:.1f} ms (spread "
                   f"{spread * 1000:.1f}; first draw {median_spread(first)[0] * 1000:.0f} ms)", "≤ 100 ms",
                   med <= 0.100)]


# Arguments of measure() for each mode: --smoke (the test suite), --quick, and the full run.
SIZES = {"smoke": (2, 2_000, 2), "quick": (8, 100_000, 5), "full": (8, 100_000, 15)}


def main() -> None:
    run_main(__doc__, SIZES, measure)


if __name__ == "__main__":
    main()
