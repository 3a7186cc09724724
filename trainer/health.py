"""How a run's ranks are doing, judged from their stored metrics: a rank that stopped stepping (hung), and
the rank the others wait for (the straggler). Pure functions of metric frames (db.queries.metric_series);
the Live page, `ddpdash show` and the supervisor's watch (trainer/supervisor/diagnose.py) all judge by these.
Frames come in (rank, step) order, as metric_series and the Live page's cache give them: nothing here sorts
(at 64 ranks the sorts were most of a refresh).
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

# A straggler is the rank the others wait for: with DDP every rank's step ends at the same all-reduce,
# so the others' steps (which include that wait) take longer than its own. Flagged when, over the
# recent window, the others' median step takes at least this much longer than its median...
STRAGGLER_WAIT_SHARE = 0.3
STRAGGLER_MIN_WAIT_S = 0.005  # ...and at least this long: a few-microsecond gap is noise, not a wait
STRAGGLER_WINDOW = 30  # the newest points of each rank it judges by (one step is too noisy to tell)
HANG_AFTER_S = 60.0  # RunConfig.hang_after_s's default: a rank whose points stop for this long and for
STALLED_INTERVALS = 10  # this many of its usual intervals between points has stopped stepping


Quiet = tuple[float, float]  # seconds since a rank's newest point, its usual interval between points


def quiet_per_rank(points: pd.DataFrame, now: float) -> dict[int, Quiet]:
    """Per rank of a metric's points (its loss): how long since its newest point, and its usual interval."""
    if points.empty:
        return {}
    per_rank = points.groupby("rank", sort=False).agg(count=("count", "sum"), first=("time", "min"),
                                                       last=("time", "max"))
    known = per_rank[per_rank["count"] >= 3]  # fewer points than that: its pace is not known yet
    return {int(rank): (now - row.last, (row.last - row.first) / (row.count - 1))
            for rank, row in zip(known.index, known.itertuples(index=False), strict=True)}


def stalled(quiet: Quiet | None, after_s: float = HANG_AFTER_S) -> bool:
    return quiet is not None and quiet[0] > max(after_s, STALLED_INTERVALS * quiet[1])


def stalled_ranks(points: pd.DataFrame, now: float, after_s: float = HANG_AFTER_S) -> dict[int, Quiet]:
    return {rank: q for rank, q in quiet_per_rank(points, now).items() if stalled(q, after_s)}


def hang_began(points: pd.DataFrame, now: float, after_s: float = HANG_AFTER_S) -> float | None:
    """When the current hang began (the newest point of the earliest stalled rank), None while no rank is
    stalled: a run's stacks are captured once per hang."""
    starts = [now - q[0] for q in stalled_ranks(points, now, after_s).values()]
    return min(starts) if starts else None


def hang_text(stalled: dict[int, Quiet]) -> str:
    ranks = sorted(stalled)
    who = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
    longest = max(q[0] for q in stalled.values())
    return f"{who} made no new step for {longest:.0f} s"


@dataclass(frozen=True)
class Straggler:
    rank: int
    wait_s: float  # how much longer the others' steps take: the time they wait for it
    own_s: float  # its own median step
    others_s: float  # the others' median step
    evidence: tuple[tuple[int, float], ...] = ()  # every rank's median step, by rank

    def text(self) -> str:
        return (f"rank {self.rank} is the straggler: the others wait ≈ {self.wait_s * 1e3:.0f} ms per step for it "
                f"(their steps take {self.others_s * 1e3:.0f} ms, its own {self.own_s * 1e3:.0f} ms)")

    def evidence_text(self) -> str:
        return ", ".join(f"rank {r} {s * 1e3:.1f} ms" for r, s in self.evidence)


def find_straggler(step_times: pd.DataFrame, window: int = STRAGGLER_WINDOW) -> Straggler | None:
    """The rank the others wait for, judged by each rank's median step time over its newest points:
    the one that waits least, when the others wait markedly (STRAGGLER_WAIT_SHARE, STRAGGLER_MIN_WAIT_S).
    None for a healthy run, or with fewer than two ranks."""
    if step_times.empty:
        return None
    medians = step_times.groupby("rank").tail(window).groupby("rank")["value"].median().dropna()
    if len(medians) < 2:
        return None
    rank = int(medians.idxmin())
    own, others = float(medians[rank]), float(medians.drop(rank).median())
    wait = others - own
    if wait >= STRAGGLER_MIN_WAIT_S and wait >= STRAGGLER_WAIT_SHARE * own:
        return Straggler(rank, wait, own, others, tuple((int(r), float(v)) for r, v in medians.items()))
    return None
