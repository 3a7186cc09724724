"""Target 4 — live refresh: one Live-page refresh for a running 8-rank run with 100k points per rank
(loss, samples/s, step and data-wait time): server time of the fragment's work — read only the
points newer than those held, rank table, charts — after one new step per rank. Also the cost of a
full first draw, for comparison. Target ≤ 100 ms.

And at 64 ranks (8 nodes × 8 GPUs) × 200k steps: a tick ≤ 100 ms and the first draw ≤ 300 ms, the
charts as the page draws them there (every rank's band, the mean and three outlier ranks), beside the
same refresh drawing all 64 ranks as lines.

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


def refresh(engine, cache: livedata.SeriesCache, run_id: int, every_rank: bool = False) -> None:  # type: ignore[no-untyped-def]
    """What the Live fragment does each tick, minus Streamlit's own rendering (`every_rank`: each rank a
    line, whatever their number)."""
    with Session(engine) as s:
        run = get_run(s, run_id)
        states = rank_states(s, run_id)
        events(s, run_id)
        cache.refresh(s)
    livedata.progress(run, states)
    livedata.rank_table(run, states, cache)
    drawn = None if every_rank else livedata.drawn_ranks(run.world_size, [], cache.get("loss"))
    charts.loss_chart(cache.get("loss"), ranks=drawn)
    charts.throughput_chart(cache.get("samples_per_s"), ranks=drawn)
    charts.timing_chart(cache.get("step_time"), cache.get("data_time"), ranks=drawn)
    livedata.step_breakdown(cache)


def measure(ranks: int, steps: int, repeats: int, many: tuple[int, int] = (0, 0)) -> list[Result]:
    results = measure_one(ranks, steps, repeats, tick_target=0.100)
    if many[0]:
        results += measure_one(*many, repeats, tick_target=0.100, first_target=0.300, alternative=True)
    return results


def measure_one(ranks: int, steps: int, repeats: int, tick_target: float, first_target: float | None = None,
                alternative: bool = False) -> list[Result]:
    with tempfile.TemporaryDirectory() as folder:
        engine = open_store(f"sqlite:///{folder}/bench.db")
        t = time.perf_counter()
        run_id = seed_big_run(engine, ranks, steps, METRICS)
        print(f"seeded {ranks} ranks × {steps:,} steps × {len(METRICS)} metrics in {time.perf_counter() - t:.1f} s")
        writers = [direct_logger(engine, run_id, r, send_interval_s=3600) for r in range(ranks)]
        variants = [False, True] if alternative else [False]
        first: dict[bool, list[float]] = {v: [] for v in variants}
        ticks: dict[bool, list[float]] = {v: [] for v in variants}
        for i in range(repeats):
            for every_rank in (variants if i % 2 == 0 else variants[::-1]):  # interleaved, order alternating
                cache = livedata.SeriesCache(run_id, livedata.point_budget(ranks))
                t = time.perf_counter()
                refresh(engine, cache, run_id, every_rank)
                first[every_rank].append(time.perf_counter() - t)
                for w in writers:  # the run moves on by one step between ticks
                    w.log(steps + 2 * i + every_rank + 1, {m: 1.0 for m in METRICS})
                    w.flush()
                t = time.perf_counter()
                refresh(engine, cache, run_id, every_rank)
                ticks[every_rank].append(time.perf_counter() - t)
        for w in writers:
            w.close()
    label = {False: "", True: f", every one of the {ranks} ranks a line"}
    for v in variants:
        print("  " + describe(f"first draw (all series, downsampled){label[v]}", [x * 1000 for x in first[v]], " ms"))
        print("  " + describe(f"refresh tick (new points only){label[v]}", [x * 1000 for x in ticks[v]], " ms"))
    med, spread = median_spread(ticks[False])
    first_med = median_spread(first[False])[0]
    results = [Result(f"live refresh ({ranks} ranks × {steps:,} points)", f"{med * 1000:.1f} ms (spread "
                      f"{spread * 1000:.1f}; first draw {first_med * 1000:.0f} ms)", f"≤ {tick_target * 1000:.0f} ms",
                      med <= tick_target)]
    if first_target is not None:
        results.append(Result(f"live first draw ({ranks} ranks × {steps:,} points)", f"{first_med * 1000:.0f} ms",
                              f"≤ {first_target * 1000:.0f} ms", first_med <= first_target))
    return results


# Arguments of measure() for each mode: --smoke (the test suite), --quick, and the full run.
SIZES = {"smoke": (2, 2_000, 2, (16, 500)), "quick": (8, 100_000, 5, (64, 50_000)),
         "full": (8, 100_000, 15, (64, 200_000))}


def main() -> None:
    run_main(__doc__, SIZES, measure)


if __name__ == "__main__":
    main()
