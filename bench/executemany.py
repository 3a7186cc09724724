"""Why db/store.py compiles its batch statements itself (`execute_many`) rather than calling
SQLAlchemy's own executemany: one rank's batch (200 steps × 3 metrics: 3 chunk rows, its rollup rows
and the rank's row) written both ways, alternating, in one SQLite database.

    python bench/executemany.py [--quick]

Prints the median time of a batch's statements each way and their ratio (SQLAlchemy ÷ execute_many).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sqlalchemy import Connection

from ddpdash.db import store
from ddpdash.db.columns import group_logs
from ddpdash.db.migrate import open_store
from ddpdash.db.runs import create_run
from ddpdash.db.store import RankCursor, roll_up_series


def batch_rows(run_id: int, rank: int, first_step: int, steps: int = 200) -> tuple[list, list, list]:
    groups = group_logs([(s, float(s), {"loss": 1.0 / s, "samples_per_s": 1e3, "step_time": 0.01})
                         for s in range(first_step, first_step + steps)])
    chunks = store.chunk_rows(run_id, rank, groups)
    rollups, _, _ = roll_up_series(run_id, rank, store._series(groups), RankCursor(run_id, rank).open_buckets)
    return chunks, rollups, [("running", first_step + steps - 1, time.time(), run_id, rank)]


def ours(conn: Connection, rows: tuple[list, list, list]) -> None:
    store.execute_many(conn, store._INSERT_CHUNKS, store.CHUNK_COLUMNS, rows[0])
    store.execute_many(conn, store._UPSERT_ROLLUPS["sqlite"], store.ROLLUP_COLUMNS, rows[1])
    store.execute_many(conn, store._UPDATE_RANK, store._UPDATE_RANK_PARAMS, rows[2])


def sqlalchemys(conn: Connection, rows: tuple[list, list, list]) -> None:
    conn.execute(store._INSERT_CHUNKS, [dict(zip(store.CHUNK_COLUMNS, r, strict=True)) for r in rows[0]])
    conn.execute(store._UPSERT_ROLLUPS["sqlite"], [dict(zip(store.ROLLUP_COLUMNS, r, strict=True)) for r in rows[1]])
    conn.execute(store._UPDATE_RANK, [dict(zip(store._UPDATE_RANK_PARAMS, r, strict=True)) for r in rows[2]])


def measure(rounds: int) -> tuple[float, float]:
    from sqlalchemy.orm import Session

    with tempfile.TemporaryDirectory() as work:
        engine = open_store(f"sqlite:///{work}/bench.db")
        with Session(engine) as s, s.begin():
            run_id = create_run(s, key="bench", name="bench", config_json="{}", world_size=2)
            store.register_rank(s, run_id, 0, device="cpu", attempt=0, host="h", pid=1)
            store.register_rank(s, run_id, 1, device="cpu", attempt=0, host="h", pid=1)
        times: dict[str, list[float]] = {"ours": [], "sqlalchemy": []}
        for i in range(rounds):
            for rank, (name, write) in enumerate((("ours", ours), ("sqlalchemy", sqlalchemys))):
                rows = batch_rows(run_id, rank, 1 + i * 200)
                with engine.begin() as conn:
                    start = time.perf_counter()
                    write(conn, rows)
                    times[name].append(time.perf_counter() - start)
        engine.dispose()
    return statistics.median(times["ours"]), statistics.median(times["sqlalchemy"])


def main() -> None:
    rounds = 100 if "--quick" in sys.argv else 400
    mine, theirs = measure(rounds)
    print(f"a batch's statements: execute_many {mine * 1e3:.3f} ms, SQLAlchemy executemany {theirs * 1e3:.3f} ms "
          f"({theirs / mine:.2f}×, {rounds} batches each, alternating)")


if __name__ == "__main__":
    main()
