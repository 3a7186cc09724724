"""Schema migrations carry stored runs over: a database written by an earlier ddpdash keeps its points."""

from __future__ import annotations

from collections.abc import Callable

import pandas as pd
import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from ddpdash.db.chunks import read_points
from ddpdash.db.engine import make_engine
from ddpdash.db.migrate import MIGRATIONS_DIR, current_revision, head_revision, upgrade
from ddpdash.db.queries import all_points, count_points

POINTS_PER_RANK = 5000  # more than one chunk's worth (the migration's CHUNK_POINTS is 4096)


def test_points_written_as_rows_survive_the_move_to_chunks_and_back(db_url: str) -> None:
    check_points_survive_the_chunk_migration(make_engine(db_url))


def check_points_survive_the_chunk_migration(engine: Engine) -> None:
    """Used for SQLite here and for PostgreSQL in test_postgres.py."""
    alembic(engine, command.upgrade, "0001")
    run_id, written = _points_as_revision_0001_stored_them(engine)
    upgrade(engine)
    assert current_revision(engine) == head_revision()
    with Session(engine) as s:
        exported = all_points(s, run_id)
        assert count_points(s, run_id) == len(written)
        later = read_points(s, run_id, name="loss", after_step=4000)  # from the second chunk of each rank
    pd.testing.assert_frame_equal(exported, written, check_dtype=False)
    assert later.step.tolist() == list(range(4001, POINTS_PER_RANK + 1)) * 2
    assert later.rank.tolist() == [0] * 1000 + [1] * 1000

    alembic(engine, command.downgrade, "0001")
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT rank, step, name, value, time FROM metric_points "
                                    "ORDER BY rank, step, name")).all()
    assert [tuple(r) for r in rows] == [tuple(r) for r in written.itertuples(index=False)]
    upgrade(engine)  # and forward again, for whoever opens it next
    engine.dispose()


def alembic(engine: Engine, action: Callable[..., None], revision: str) -> None:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        action(cfg, revision)


def _points_as_revision_0001_stored_them(engine: Engine) -> tuple[int, pd.DataFrame]:
    """A run with two ranks and two metrics, inserted as one row per point (rows deliberately out of step
    order: the migration must sort them)."""
    points = pd.DataFrame([
        {"rank": rank, "step": step, "metric": name, "value": step * 0.5 + rank + (name == "lr"), "time": 1e9 + step}
        for rank in (0, 1) for name in ("loss", "lr") for step in range(POINTS_PER_RANK, 0, -1)
    ])
    with engine.begin() as conn:
        run_id = conn.execute(sa.text(
            "INSERT INTO runs (key, name, status, config_json, world_size, run_dir, host, created_at, worker_pids, "
            "failed_ranks, error, tags, notes) VALUES ('old', 'old', 'done', '{}', 2, '', '', 0, '', '', '', '', '') "
            "RETURNING id")).scalar_one()
        conn.execute(sa.text("INSERT INTO metric_points (run_id, rank, step, name, value, time) "
                             "VALUES (:run_id, :rank, :step, :metric, :value, :time)"),
                     [{"run_id": run_id, **row} for row in points.to_dict("records")])
    return run_id, points.sort_values(["rank", "step", "metric"]).reset_index(drop=True)
