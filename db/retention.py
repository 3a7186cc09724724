"""Raw-point retention for long runs: keep every metric's raw points for the newest N steps (or days) and
the rollups for all, so a database does not grow without bound while charts still show each bucket's
min, max and mean over the whole run. Off by default (RunConfig.keep_raw_steps = 0); `ddpdash compact`
applies it, and a run's supervisor applies its own setting as it trains and when it ends.

    compact_run(s, run_id, keep_steps=N | keep_days=D) -> Compacted
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from .chunks import discard_before
from .models import ROLLUP_WIDTHS, MetricRollup, Run


@dataclass(frozen=True)
class Compacted:
    run_id: int
    kept_from: int  # raw points from this step on are all still stored
    chunks: int  # rows removed now
    points: int

    def text(self) -> str:
        if not self.chunks:
            return f"run {self.run_id}: nothing to remove (raw points kept from step {self.kept_from:,})"
        return (f"run {self.run_id}: removed {self.points:,} raw points before step {self.kept_from:,} "
                f"({self.chunks:,} chunks); their rollups (min, max, mean per bucket) stay")


def compact_run(s: Session, run_id: int, *, keep_steps: int | None = None, keep_days: float | None = None,
                now: float | None = None) -> Compacted:
    """Remove the run's raw points older than its newest `keep_steps` steps, or than `keep_days` days (the
    stricter of the two when both are given). The caller commits."""
    if keep_steps is None and keep_days is None:
        raise ValueError("say how much to keep: keep_steps or keep_days")
    if (keep_steps is not None and keep_steps < 0) or (keep_days is not None and keep_days < 0):
        raise ValueError("keep_steps and keep_days must not be negative")
    cuts = []
    if keep_steps is not None:
        last = s.scalar(select(func.max(MetricRollup.step_max)).where(MetricRollup.run_id == run_id,
                                                                      MetricRollup.width == ROLLUP_WIDTHS[-1]))
        if last is not None:
            cuts.append(int(last) - keep_steps + 1)
    if keep_days is not None:
        before = (now or time.time()) - keep_days * 86_400
        # The newest step logged before that time, from the finest rollups' bucket ends.
        older = s.scalar(select(func.max(MetricRollup.step_max)).where(
            MetricRollup.run_id == run_id, MetricRollup.width == ROLLUP_WIDTHS[0], MetricRollup.time_max < before))
        if older is not None:
            cuts.append(int(older) + 1)
    kept_from = raw_kept_from(s, run_id)
    cut = max([kept_from, *cuts])
    chunks, points = discard_before(s, run_id, cut) if cut > kept_from else (0, 0)
    if cut > kept_from:
        s.execute(update(Run).where(Run.id == run_id).values(raw_kept_from=cut))
    return Compacted(run_id, cut, chunks, points)


def raw_kept_from(s: Session, run_id: int) -> int:
    return int(s.scalar(select(Run.raw_kept_from).where(Run.id == run_id)) or 0)
