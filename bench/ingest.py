"""Target 2 — ingest throughput: points per second into SQLite through ddpdash's own writer path
(a rank's logger → db.store, rollups included), one writer and 4 concurrent writer processes,
against raw `sqlite3.executemany` of one row per point (bench.common.ROW_TABLE_DDL: the layout ddpdash used
before it stored points in chunks, index and foreign key included) in WAL mode, in the same database
file, measured in the same run. Target ≥ 60% of raw, 0 errors, stored count = logged count.

    python bench/ingest.py [--quick | --smoke]
"""

from __future__ import annotations

import multiprocessing as mp
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import INSERT_ROW_SQL, ROW_TABLE_DDL, Result, describe, interleaved, median_spread, ratios, run_main

METRICS = ("loss", "samples_per_s", "step_time", "data_time")
BATCH = 10_000


def _new_db(folder: str) -> tuple[str, int]:
    from sqlalchemy import text
    from sqlalchemy.orm import Session

    from ddpdash.db.migrate import open_store
    from ddpdash.db.runs import create_run

    url = f"sqlite:///{folder}/bench.db"
    engine = open_store(url)
    with Session(engine) as s, s.begin():
        run_id = create_run(s, key="bench", name="bench", config_json="{}", world_size=4)
        for ddl in ROW_TABLE_DDL:
            s.execute(text(ddl))
    engine.dispose()
    return url, run_id


def _ddpdash_writer(url: str, run_id: int, rank: int, steps: int) -> int:
    from ddpdash.db.engine import make_engine
    from ddpdash.db.store import RankWriter
    from ddpdash.trainer.metrics import RankLogger

    writer = RankWriter(make_engine(url), run_id, rank)
    w = RankLogger(writer, rank)
    for step in range(1, steps + 1):
        w.log(step, {"loss": 1.0 / step, "samples_per_s": 1000.0, "step_time": 0.01, "data_time": 0.001})
    w.close()
    return writer.written_points


def _raw_writer(url: str, run_id: int, rank: int, steps: int) -> int:
    conn = sqlite3.connect(url.removeprefix("sqlite:///"), timeout=30)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    now = time.time()
    rows = [(run_id, rank, step, name, 1.0 / step, now) for step in range(1, steps + 1) for name in METRICS]
    for i in range(0, len(rows), BATCH):
        conn.executemany(INSERT_ROW_SQL, rows[i : i + BATCH])
        conn.commit()
    conn.close()
    return len(rows)


def _stored(url: str, kind: str) -> int:
    conn = sqlite3.connect(url.removeprefix("sqlite:///"))
    query = ("SELECT coalesce(sum(count), 0) FROM metric_chunks" if kind == "ddpdash"
             else "SELECT count(*) FROM point_rows")
    (count,) = conn.execute(query).fetchone()
    conn.close()
    return int(count)


def _run(kind: str, writers: int, steps: int) -> tuple[float, int, int]:
    """Points/s, stored rows and logged rows for `writers` concurrent writer processes."""
    target = _ddpdash_writer if kind == "ddpdash" else _raw_writer
    with tempfile.TemporaryDirectory() as folder:
        url, run_id = _new_db(folder)
        ctx = mp.get_context("fork")
        with ctx.Pool(writers) as pool:
            start = time.perf_counter()
            logged = sum(pool.starmap(target, [(url, run_id, r, steps) for r in range(writers)]))
            elapsed = time.perf_counter() - start
        return logged / elapsed, _stored(url, kind), logged


def measure(steps: int, repeats: int) -> list[Result]:
    results = []
    for writers in (1, 4):
        rates: dict[str, list[float]] = {}
        exact = True
        def one(kind: str, w: int = writers) -> float:
            nonlocal exact
            rate, stored, logged = _run(kind, w, steps)
            exact = exact and stored == logged == w * steps * len(METRICS)
            return rate
        rates = interleaved({"raw sqlite3": lambda: one("raw"), "ddpdash writer": lambda: one("ddpdash")}, repeats)
        print(f"-- {writers} writer process(es), {steps * len(METRICS):,} points each")
        for name, values in rates.items():
            print("  " + describe(name, values, " points/s"))
        share, spread = median_spread(ratios(rates["ddpdash writer"], rates["raw sqlite3"]))
        print(f"  ddpdash / raw: {share:.0%} (spread {spread:.0%}); stored = logged: {exact}")
        results.append(Result(f"ingest ({writers} writer{'s' if writers > 1 else ''})",
                              f"{share:.0%} of raw, {median_spread(rates['ddpdash writer'])[0]:,.0f} points/s, "
                              f"stored=logged {exact}", "≥ 60% of raw, 0 errors, stored = logged",
                              share >= 0.6 and exact))
    return results


# Arguments of measure() for each mode: --smoke (the test suite), --quick, and the full run.
SIZES = {"smoke": (500, 1), "quick": (25_000, 3), "full": (50_000, 5)}


def main() -> None:
    run_main(__doc__, SIZES, measure)


if __name__ == "__main__":
    main()
