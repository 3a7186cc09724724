"""Target — the Runs page at a team's size: 10,000 finished runs in 500 sweeps of 20, each run's 2 ranks
written through the real writer (db.store.write_batch: chunks and rollups). The query part of the page's
first draw (history.runs_page: the page of runs with their settings, final/best loss and samples/s, and
the sweep filter's list) and of a filter by one sweep, beside a plain `SELECT * FROM runs` of the same
rows in the same run. Target ≤ 200 ms each.

    python bench/runs_page.py [--quick | --smoke]
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from array import array
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from sqlalchemy import insert, text
from sqlalchemy.orm import Session

from bench.common import Result, describe, interleaved, median_spread, run_main
from ddpdash.dashboard import history
from ddpdash.db.columns import Batch, Group
from ddpdash.db.migrate import open_store
from ddpdash.db.models import Run
from ddpdash.db.store import RankCursor, write_batch
from ddpdash.db.vocab import Metric, RunStatus
from ddpdash.trainer.config import RunConfig

STEPS = 20
SWEEP_SIZE = 20


def seed(engine, runs: int) -> None:  # type: ignore[no-untyped-def]
    now = time.time() - runs
    rows = []
    for i in range(runs):
        sweep = f"sweep-{i // SWEEP_SIZE:04d}"
        cfg = RunConfig(name=f"run-{i}", num_procs=2, batch_size=16 << (i % 3), group=f"{sweep} point {i % 5}")
        rows.append({"key": f"k{i}", "name": cfg.name, "status": RunStatus.SUCCEEDED, "config_json": cfg.to_json(),
                     "world_size": 2, "run_dir": "", "host": "bench", "created_at": now + i, "started_at": now + i,
                     "ended_at": now + i + 0.5, "queue_order": now + i, "admitted_at": now + i, "sweep": sweep,
                     "group_name": cfg.group, "tags": "", "notes": "", "worker_pids": "", "failed_ranks": "",
                     "error": ""})
    with engine.begin() as conn:
        conn.execute(insert(Run), rows)
        ids = [r for (r,) in conn.execute(text("SELECT id FROM runs ORDER BY id"))]
        for n, run_id in enumerate(ids):
            for rank in range(2):
                steps = array("q", range(1, STEPS + 1))
                loss = array("d", (2.0 / (1 + s / 5) + 0.001 * n for s in steps))
                speed = array("d", (1000.0 + n % 97 for _ in steps))
                group = Group((Metric.LOSS, Metric.SAMPLES_PER_S), steps, array("d", (now + n + s for s in steps)),
                              (loss, speed))
                write_batch(conn, RankCursor(run_id, rank), Batch([group], []), now + n)


def page_query(engine, sweep: str = "") -> float:  # type: ignore[no-untyped-def]
    t = time.perf_counter()
    with Session(engine) as s:
        page = history.runs_page(s, history.RunFilter(sweep=sweep), "id", True, 1, 50)
    elapsed = time.perf_counter() - t
    assert len(page.rows) == (20 if sweep else 50) and page.rows["final_loss"].notna().all(), page.rows
    return elapsed


def plain_select(engine) -> float:  # type: ignore[no-untyped-def]
    t = time.perf_counter()
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT * FROM runs")).all()
        [json.loads(r.config_json) for r in rows]  # what any reader of the rows must do with a config
    return time.perf_counter() - t


def measure(runs: int, repeats: int) -> list[Result]:
    with tempfile.TemporaryDirectory() as work:
        engine = open_store(f"sqlite:///{Path(work) / 'ddpdash.db'}")
        started = time.perf_counter()
        seed(engine, runs)
        print(f"-- {runs:,} runs in {runs // SWEEP_SIZE} sweeps, 2 ranks × {STEPS} steps each, written through "
              f"write_batch in {time.perf_counter() - started:.1f} s")
        sweep = f"sweep-{(runs // SWEEP_SIZE) // 2:04d}"
        times = interleaved({"Runs page, first page": lambda: page_query(engine),
                             f"Runs page, filtered to {sweep}": lambda: page_query(engine, sweep),
                             "plain SELECT * FROM runs (+ json.loads)": lambda: plain_select(engine)}, repeats)
        engine.dispose()
    for name, values in times.items():
        print("  " + describe(name, [v * 1000 for v in values], " ms"))
    first, _ = median_spread(times["Runs page, first page"])
    filtered, _ = median_spread(times[f"Runs page, filtered to {sweep}"])
    plain, _ = median_spread(times["plain SELECT * FROM runs (+ json.loads)"])
    print(f"  first page {first / plain:.2f}× the plain SELECT, a sweep filter {filtered / plain:.2f}×")
    return [Result(f"Runs page, {runs:,} runs: first page",
                   f"{first * 1000:.0f} ms ({first / plain:.2f}× plain SELECT)", "≤ 200 ms", first <= 0.2),
            Result(f"Runs page, {runs:,} runs: filter by sweep", f"{filtered * 1000:.0f} ms", "≤ 200 ms",
                   filtered <= 0.2)]


SIZES = {"smoke": (400, 1), "quick": (10_000, 3), "full": (10_000, 7)}


def main() -> None:
    run_main(__doc__, SIZES, measure)


if __name__ == "__main__":
    main()
