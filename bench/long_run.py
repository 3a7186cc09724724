"""Long-run storage: 8 ranks × 10M steps × 4 metrics written as ranks write them (through the writer, a batch
per rank every 25k steps). Bytes on disk per point (the database file over every point logged, rollups and
indexes included; target ≤ 24 B), the write rate, and the loss chart over the whole run and over its last 1 %
(target ≤ 50 ms each); beside, in the same run, the same points of rank 0 stored one row per point (what a
plain table costs), and the bytes per point once `ddpdash compact` keeps the last 1 % raw. MLflow's and
TensorBoard's own storage are measured where installed (`pip install -e '.[bench]'`).

    python bench/long_run.py [--quick | --smoke]
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from sqlalchemy import text
from sqlalchemy.orm import Session

from bench.common import INSERT_ROW_SQL, ROW_TABLE_DDL, Result, describe, median_spread, run_main
from bench.seed import seed_big_run
from ddpdash.dashboard.charts import loss_chart
from ddpdash.db.chunks import Points, read_points
from ddpdash.db.migrate import open_store
from ddpdash.db.queries import metric_series
from ddpdash.db.retention import compact_run

METRICS = ("loss", "samples_per_s", "step_time", "data_time")


def file_bytes(engine, path: Path) -> int:  # type: ignore[no-untyped-def]
    with engine.connect() as conn:
        conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")  # what the WAL holds, into the file
    return path.stat().st_size + sum(p.stat().st_size for p in path.parent.glob(path.name + "-*"))


def chart_ms(engine, run_id: int, after_step: int = -1) -> float:  # type: ignore[no-untyped-def]
    t = time.perf_counter()
    with Session(engine) as s:
        df = metric_series(s, run_id, "loss", after_step=after_step)
    loss_chart(df)
    return (time.perf_counter() - t) * 1000


def rows_bytes_per_point(folder: Path, run_id: int, points: Points) -> float:
    """Rank 0's points, one row per point with the usual index, in a database of their own."""
    from sqlalchemy import create_engine

    rows_engine = create_engine(f"sqlite:///{folder}/rows.db")  # a plain table: no runs table to refer to
    with rows_engine.begin() as conn:
        for ddl in ROW_TABLE_DDL:
            conn.exec_driver_sql(ddl.replace(" REFERENCES runs (id) ON DELETE CASCADE", ""))
        for name in sorted(set(points.name.tolist())):
            mine = points.where(points.name == name)
            conn.exec_driver_sql(INSERT_ROW_SQL, list(zip([run_id] * len(mine.step), [0] * len(mine.step),
                                                          mine.step.tolist(), [name] * len(mine.step),
                                                          mine.value.tolist(), mine.time.tolist(), strict=True)))
    with rows_engine.connect() as conn:
        count = conn.execute(text("SELECT count(*) FROM point_rows")).scalar_one()
    size = file_bytes(rows_engine, folder / "rows.db")
    rows_engine.dispose()
    return size / max(count, 1)


def on_disk(path: Path) -> int:
    """A file's bytes with its journals beside it, or a folder's files'."""
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return sum(p.stat().st_size for p in path.parent.glob(path.name + "*") if p.is_file())


def each_point(points: Points) -> Iterator[tuple[str, int, float, float]]:
    """(name, step, value, time) a point at a time, as a logging call takes them."""
    return zip(points.name.tolist(), points.step.tolist(), points.value.tolist(), points.time.tolist(), strict=True)


def mlflow_bytes_per_point(folder: Path, points: Points) -> float:
    """The same points through MLflow's client into its own SQLite store (`log_batch`, 1,000 metrics a call,
    its limit), the store's growth over the points."""
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    path = folder / "mlflow.db"
    client = MlflowClient(tracking_uri=f"sqlite:///{path}")
    run = client.create_run("0")
    empty = on_disk(path)
    metrics = [Metric(name, value, int(at * 1000), step) for name, step, value, at in each_point(points)]
    for start in range(0, len(metrics), 1000):
        client.log_batch(run.info.run_id, metrics=metrics[start : start + 1000])
    client.set_terminated(run.info.run_id)
    return (on_disk(path) - empty) / max(len(metrics), 1)


def tensorboard_bytes_per_point(folder: Path, points: Points) -> float:
    """The same points through TensorBoard's `SummaryWriter.add_scalar`: its event files over the points."""
    from torch.utils.tensorboard import SummaryWriter

    path = folder / "tb"
    writer = SummaryWriter(str(path))
    writer.flush()
    empty = on_disk(path)
    for name, step, value, at in each_point(points):
        writer.add_scalar(name, value, step, walltime=at)
    writer.close()
    return (on_disk(path) - empty) / max(len(points.step), 1)


# The others log a point at a time (MLflow ≈ 10k points/s here): they get rank 0's first steps, at most these.
OTHERS_STEPS = 25_000
OTHERS = {"mlflow": ("MLflow (SQLite store, log_batch)", mlflow_bytes_per_point),
          "tensorboard": ("TensorBoard (event files, add_scalar)", tensorboard_bytes_per_point)}


def others_bytes_per_point(folder: Path, points: Points) -> dict[str, float]:
    """Bytes per point of each of MLflow and TensorBoard that is installed, for the same points."""
    found = {}
    steps = len(set(points.step.tolist()))
    for module, (label, measure_one) in OTHERS.items():
        if not _installed(module):
            print(f"  {label}: not installed, not measured (pip install -e '.[bench]')")
            continue
        found[module] = measure_one(folder, points)
        print(f"  {label}: {found[module]:.1f} B per point (rank 0's first {steps:,} steps, "
              f"{len(points.step):,} points)")
    return found


def measure(ranks: int, steps: int, repeats: int) -> list[Result]:
    with tempfile.TemporaryDirectory() as work:
        folder = Path(work)
        db = folder / "bench.db"
        engine = open_store(f"sqlite:///{db}")
        empty = file_bytes(engine, db)
        t = time.perf_counter()
        run_id = seed_big_run(engine, ranks, steps, METRICS, status="succeeded")
        took = time.perf_counter() - t
        points = ranks * steps * len(METRICS)
        per_point = (file_bytes(engine, db) - empty) / points
        print(f"-- {ranks} ranks × {steps:,} steps × {len(METRICS)} metrics = {points:,} points")
        print(f"  written in {took:.0f} s through the writer: {points / took:,.0f} points/s")
        print(f"  on disk: {per_point:.1f} B per point (raw chunks, rollups at 12 widths, indexes)")
        chart_ms(engine, run_id)  # warm: the page cache, and Altair's first chart
        whole = [chart_ms(engine, run_id) for _ in range(repeats)]
        last = [chart_ms(engine, run_id, after_step=int(steps * 0.99)) for _ in range(repeats)]
        print("  " + describe("loss chart, whole run", whole, " ms"))
        print("  " + describe("loss chart, last 1 %", last, " ms"))
        with Session(engine) as s:
            rank0 = read_points(s, run_id, rank=0)
        rows = rows_bytes_per_point(folder, run_id, rank0)
        print(f"  one row per point (rank 0's points, SQLite, indexed): {rows:.1f} B per point")
        others = others_bytes_per_point(folder, rank0.where(rank0.step < rank0.step.min() + OTHERS_STEPS))
        del rank0
        with Session(engine) as s, s.begin():
            done = compact_run(s, run_id, keep_steps=steps // 100)
        with engine.connect() as conn:
            conn.exec_driver_sql("VACUUM")
        compacted = (file_bytes(engine, db) - empty) / points
        print(f"  after `ddpdash compact --keep-steps {steps // 100:,} --vacuum`: {compacted:.1f} B per point logged "
              f"({done.points:,} raw points removed; the rollups keep the whole run)")
        after = [chart_ms(engine, run_id) for _ in range(repeats)]
        print("  " + describe("loss chart, whole run, compacted", after, " ms"))
        engine.dispose()
    versus = "".join(f", {name}: {value:.0f} B" for name, value in others.items())
    whole_med, last_med = median_spread(whole)[0], median_spread(last)[0]
    return [Result("long run: bytes per point", f"{per_point:.1f} B (one row per point: {rows:.0f} B{versus})",
                   "≤ 24 B", per_point <= 24),
            Result("long run: loss chart, whole run", f"{whole_med:.1f} ms", "≤ 50 ms", whole_med <= 50),
            Result("long run: loss chart, last 1 %", f"{last_med:.1f} ms", "≤ 50 ms", last_med <= 50)]


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


# Arguments of measure() for each mode: --smoke (the test suite), --quick, and the full run.
SIZES = {"smoke": (2, 5_000, 2), "quick": (8, 1_000_000, 5), "full": (8, 10_000_000, 7)}


def main() -> None:
    run_main(__doc__, SIZES, measure)


if __name__ == "__main__":
    main()
