"""Raw-point retention for long runs: `ddpdash compact` (and a run's own keep_raw_steps) removes the raw points
older than the newest N steps (or D days) and keeps the rollups, so charts still show each bucket's min, max
and mean over the whole run; the newest steps stay raw."""

from __future__ import annotations

import contextlib
import io

import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from ddpdash.db.chunks import read_points
from ddpdash.db.queries import count_points, metric_series, run_metric_summaries
from ddpdash.db.retention import compact_run
from ddpdash.trainer.config import RunConfig
from ddpdash.trainer.metrics import direct_logger
from tests.conftest import make_run

STEPS = 6000


def long_run(engine: Engine, cfg: RunConfig | None = None) -> int:
    """Two ranks, STEPS steps of loss and samples/s, written as ranks write them; rank 1's step 100 is an
    outlier (loss 50) that only the rollups keep once compacted."""
    run_id = make_run(engine, cfg or RunConfig(num_procs=2))
    for rank in (0, 1):
        logger = direct_logger(engine, run_id, rank, send_interval_s=3600)
        for step in range(1, STEPS + 1):
            loss = 50.0 if (rank, step) == (1, 100) else 1.0 / step
            logger.log(step, {"loss": loss, "samples_per_s": 100.0}, at=1_000_000.0 + step)
            if step % 250 == 0:
                logger.flush()  # a batch per 250 steps, as a rank's sender hands them on
        logger.close(status="done")
    return run_id


def cli(engine: Engine, *argv: str) -> str:
    from ddpdash.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["--db-url", str(engine.url), "compact", *argv]) == 0
    return out.getvalue()


def test_compact_keeps_the_newest_steps_raw_and_the_whole_run_in_rollups(engine: Engine) -> None:
    run_id = long_run(engine)
    with Session(engine) as s:
        before = metric_series(s, run_id, "loss")
        summary_before = run_metric_summaries(s, [run_id])
        stored = count_points(s, run_id)
    said = cli(engine, str(run_id), "--keep-steps", "1000")
    assert said.startswith(f"run {run_id}: removed ") and "before step 5,001" in said, said
    with Session(engine) as s:
        left = read_points(s, run_id)
        assert left.step.min() <= 5001 and set(range(5001, STEPS + 1)) <= set(left.step.tolist())
        assert count_points(s, run_id) < stored / 2
        after = metric_series(s, run_id, "loss")  # the whole run: from the rollups, min and max kept
        assert after["vmax"].max() == 50.0 and after["step"].max() == STEPS
        assert after["step"].min() <= 32 and before["vmax"].max() == 50.0  # from the first bucket on, as before
        tail = metric_series(s, run_id, "loss", after_step=5900)  # the newest steps: raw, every point
        assert sorted(tail["step"].unique().tolist()) == list(range(5901, STEPS + 1))
        assert (tail["count"] == 1).all()
        short = metric_series(s, run_id, "loss", max_points=100_000)  # would be raw: compacted, so rollups
        assert short["vmax"].max() == 50.0 and (short["count"] > 1).any()
        pd_equal = run_metric_summaries(s, [run_id]).equals(summary_before)
    assert pd_equal  # final loss, best loss, samples/s: read from rollups, unchanged
    assert "nothing to remove" in cli(engine, str(run_id), "--keep-steps", "2000")  # never un-removes


def test_a_runs_own_setting_and_a_time_window(engine: Engine) -> None:
    keeps = long_run(engine, RunConfig(num_procs=2, keep_raw_steps=500))
    keeps_all = long_run(engine)
    out = cli(engine)  # every run, each by its own keep_raw_steps
    assert f"run {keeps}: removed " in out and "before step 5,501" in out
    assert f"run {keeps_all}: keeps every raw point" in out
    with Session(engine) as s, s.begin():
        # Points are stamped a second apart from t = 1,000,001: "the last 1000 s" at t = 1,006,000 keeps 5001–6000.
        done = compact_run(s, keeps_all, keep_days=1000 / 86_400, now=1_006_000.0)
    assert 5000 - 32 < done.kept_from <= 5001 and done.points > 0  # to the finest rollup bucket: a little kept


def test_bad_retention_is_refused(engine: Engine) -> None:
    from ddpdash.cli import main

    assert main(["--db-url", str(engine.url), "compact", "--keep-steps", "-1"]) == 2
    with Session(engine) as s, pytest.raises(ValueError, match="keep_steps or keep_days"):
        compact_run(s, 1)
