"""The writer at 64 ranks: 8 supervisor processes (one a node, 8 ranks each) write into one PostgreSQL what
64 ranks log at 100 steps/s × 4 metrics — each rank's logger hands its batch to the writer once a second,
as a launched rank's relay does — for a stretch of seconds; against raw inserts (one row per point,
`executemany` over psycopg, the table of bench.common.ROW_TABLE_DDL) of the same points at the same pace,
in the same run, on a private PostgreSQL (tests/pg.py). Target: 0 points lost and the writers keep up: what
is left to write when the ranks stop takes under a second.

    python bench/writer_64.py [--quick | --smoke]
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import ROW_TABLE_DDL, Result, describe, interleaved, run_main

NODES, RANKS_PER_NODE, STEPS_PER_S = 8, 8, 100
METRICS = ("loss", "samples_per_s", "step_time", "data_time")
INSERT_PG = "INSERT INTO point_rows (run_id, rank, step, name, value, time) VALUES (%s, %s, %s, %s, %s, %s)"


def _values(step: int) -> dict[str, float]:
    return {"loss": 1.0 / step, "samples_per_s": 1000.0 + step % 7, "step_time": 0.01, "data_time": 0.001}


class _Timed:
    """A rank's writer, timed: the seconds its sends took (the supervisor's work for that rank)."""

    def __init__(self, writer: object) -> None:
        self.writer, self.busy = writer, 0.0

    @property
    def dropped(self) -> int:
        return int(self.writer.dropped)  # type: ignore[attr-defined]

    def send(self, batch: object) -> None:
        start = time.perf_counter()
        self.writer.send(batch)  # type: ignore[attr-defined]
        self.busy += time.perf_counter() - start

    def flush(self) -> None:
        self.writer.flush()  # type: ignore[attr-defined]

    def close(self, batch: object) -> None:
        start = time.perf_counter()
        self.writer.close(batch)  # type: ignore[attr-defined]
        self.busy += time.perf_counter() - start


def _ddpdash_node(url: str, run_id: int, node: int, seconds: int, start_at: float, out: mp.Queue) -> None:
    """One supervisor: its 8 ranks' loggers, each writing the store through a RankWriter (db.store)."""
    from ddpdash.db.engine import make_engine
    from ddpdash.db.store import RankWriter
    from ddpdash.trainer.metrics import RankLogger

    engine = make_engine(url)
    ranks = range(node * RANKS_PER_NODE, (node + 1) * RANKS_PER_NODE)
    timed = {r: _Timed(RankWriter(engine, run_id, r)) for r in ranks}
    loggers = {r: RankLogger(timed[r], r) for r in ranks}  # type: ignore[arg-type]
    _pace(seconds, start_at, lambda step: [loggers[r].log(step, _values(step)) for r in ranks])
    stopped = time.perf_counter()
    for logger in loggers.values():
        logger.close()
    out.put((time.perf_counter() - stopped, sum(t.busy for t in timed.values()),
             sum(t.writer.written_points for t in timed.values()), sum(t.dropped for t in timed.values())))
    engine.dispose()


def _raw_node(url: str, run_id: int, node: int, seconds: int, start_at: float, out: mp.Queue) -> None:
    """The same points as one row each, inserted once a second by a thread per rank (as a relay hands on)."""
    import psycopg

    dsn = url.replace("postgresql+psycopg://", "postgresql://")
    ranks = range(node * RANKS_PER_NODE, (node + 1) * RANKS_PER_NODE)
    pending: dict[int, list[tuple[object, ...]]] = {r: [] for r in ranks}
    lock, done, busy, written = threading.Lock(), threading.Event(), [0.0], [0]

    def writer(rank: int) -> None:
        with psycopg.connect(dsn) as conn:
            while True:
                finished = done.wait(1.0)
                with lock:
                    rows, pending[rank] = pending[rank], []
                if rows:
                    start = time.perf_counter()
                    with conn.cursor() as cur:
                        cur.executemany(INSERT_PG, rows)
                    conn.commit()
                    with lock:
                        busy[0] += time.perf_counter() - start
                        written[0] += len(rows)
                if finished:
                    return

    threads = [threading.Thread(target=writer, args=(r,)) for r in ranks]
    for t in threads:
        t.start()

    def log(step: int) -> None:
        now = time.time()
        with lock:
            for r in ranks:
                pending[r].extend((run_id, r, step, name, value, now) for name, value in _values(step).items())

    _pace(seconds, start_at, log)
    stopped = time.perf_counter()
    done.set()
    for t in threads:
        t.join()
    out.put((time.perf_counter() - stopped, busy[0], written[0], 0))


def _pace(seconds: int, start_at: float, log_step: object) -> None:
    """STEPS_PER_S steps a second for `seconds`, each second's steps logged at its start, from `start_at`."""
    while time.time() < start_at:
        time.sleep(0.005)
    step = 0
    for second in range(seconds):
        for _ in range(STEPS_PER_S):
            step += 1
            log_step(step)  # type: ignore[operator]
        time.sleep(max(0.0, start_at + second + 1 - time.time()))


def _round(kind: str, url: str, run_id: int, seconds: int) -> dict[str, float]:
    target = _ddpdash_node if kind == "ddpdash" else _raw_node
    out: mp.Queue = mp.Queue()
    start_at = time.time() + 1.0  # every node starts its first second together
    procs = [mp.Process(target=target, args=(url, run_id, node, seconds, start_at, out)) for node in range(NODES)]
    for p in procs:
        p.start()
    results = [out.get(timeout=seconds + 120) for _ in procs]
    for p in procs:
        p.join()
    logged = NODES * RANKS_PER_NODE * STEPS_PER_S * seconds * len(METRICS)
    return {"tail_s": max(r[0] for r in results), "busy_share": sum(r[1] for r in results) / (NODES * seconds),
            "written": sum(r[2] for r in results), "dropped": sum(r[3] for r in results), "logged": logged}


def _stored(url: str, kind: str, run_id: int) -> int:
    from sqlalchemy import text

    from ddpdash.db.engine import make_engine

    query = ("SELECT coalesce(sum(count), 0) FROM metric_chunks WHERE run_id = :r" if kind == "ddpdash"
             else "SELECT count(*) FROM point_rows WHERE run_id = :r")
    engine = make_engine(url)
    with engine.connect() as conn:
        stored = int(conn.execute(text(query), {"r": run_id}).scalar_one())
    engine.dispose()
    return stored


def measure(seconds: int, repeats: int) -> list[Result]:
    from sqlalchemy import text
    from sqlalchemy.orm import Session

    from ddpdash.db.migrate import open_store
    from ddpdash.db.runs import create_run
    from tests.pg import postgres_server

    world = NODES * RANKS_PER_NODE
    print(f"  {NODES} supervisors × {RANKS_PER_NODE} ranks, {STEPS_PER_S} steps/s × {len(METRICS)} metrics a rank "
          f"({world * STEPS_PER_S * len(METRICS):,} points/s), {seconds} s a round, {repeats} round(s)")
    with postgres_server() as url:
        engine = open_store(url)

        def one(kind: str) -> dict[str, float]:
            with Session(engine) as s, s.begin():
                run_id = create_run(s, key=f"{kind}-{time.time_ns()}", name=kind, config_json="{}", world_size=world)
                for ddl in ROW_TABLE_DDL:
                    s.execute(text(ddl.replace("INTEGER PRIMARY KEY", "SERIAL PRIMARY KEY")))
            found = _round(kind, url, run_id, seconds)
            found["stored"] = _stored(url, kind, run_id)
            return found

        rounds = interleaved({"ddpdash": lambda: one("ddpdash"), "raw": lambda: one("raw")}, repeats)
        engine.dispose()
    for kind, found in rounds.items():
        print("  " + describe(f"{kind}: left to write when the ranks stop", [r["tail_s"] for r in found], " s"))
        print("  " + describe(f"{kind}: writers' busy share of each supervisor's second",
                              [r["busy_share"] for r in found]))
        print(f"  {kind}: stored {[int(r['stored']) for r in found]} of {int(found[0]['logged']):,} logged")
    ours, raw = rounds["ddpdash"], rounds["raw"]
    lost = max(int(r["logged"] - r["stored"]) for r in ours)
    tail = statistics.median(r["tail_s"] for r in ours)
    share = statistics.median(r["busy_share"] for r in ours) / max(statistics.median(r["busy_share"] for r in raw),
                                                                     1e-9)
    return [Result("writer at 64 ranks (8 supervisors → PostgreSQL)",
                   f"{lost} lost, {tail:.2f} s left at the end, busy {share:.2f}× raw inserts' "
                   f"(raw lost {max(int(r['logged'] - r['stored']) for r in raw)})",
                   "0 lost, < 1 s left", lost == 0 and tail < 1.0)]


# Arguments of measure() for each mode: --smoke (the test suite), --quick, and the full run.
SIZES = {"smoke": (2, 1), "quick": (15, 2), "full": (60, 3)}


def main() -> None:
    run_main(__doc__, SIZES, measure)


if __name__ == "__main__":
    main()
