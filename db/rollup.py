"""Vectorised rollups: per-bucket min/max/sum/count of a metric series, merged with the bucket the
writer is still filling. Pure numpy: no database, no Python loop per point."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Bucket:
    bucket: int
    step_min: int
    step_max: int
    vmin: float
    vmax: float
    vsum: float
    count: int
    time_max: float
    vlast: float

    def as_tuple(self) -> tuple[int, int, int, float, float, float, int, float, float]:
        return (self.bucket, self.step_min, self.step_max, self.vmin, self.vmax, self.vsum, self.count, self.time_max,
                self.vlast)


def roll_up(steps: np.ndarray, values: np.ndarray, times: np.ndarray, width: int,
            open_bucket: Bucket | None) -> list[Bucket]:
    """Buckets of `width` steps touched by these points (ascending), the first merged with
    `open_bucket` when it is the same bucket. Steps must be non-decreasing."""
    buckets = steps // width
    starts = np.flatnonzero(np.diff(buckets)) + 1
    starts = np.concatenate(([0], starts))
    ends = np.concatenate((starts[1:], [len(steps)])) - 1
    vmin = np.minimum.reduceat(values, starts)
    vmax = np.maximum.reduceat(values, starts)
    vsum = np.add.reduceat(values, starts)
    counts = ends - starts + 1
    out = [
        Bucket(b, s0, s1, lo, hi, sm, c, t, last)
        for b, s0, s1, lo, hi, sm, c, t, last in zip(
            buckets[starts].tolist(), steps[starts].tolist(), steps[ends].tolist(), vmin.tolist(), vmax.tolist(),
            vsum.tolist(), counts.tolist(), times[ends].tolist(), values[ends].tolist(), strict=True,
        )
    ]
    if open_bucket is not None and out and out[0].bucket == open_bucket.bucket:
        first = out[0]
        out[0] = Bucket(first.bucket, open_bucket.step_min, first.step_max, min(first.vmin, open_bucket.vmin),
                        max(first.vmax, open_bucket.vmax), first.vsum + open_bucket.vsum,
                        first.count + open_bucket.count, first.time_max, first.vlast)
    return out


def as_sorted_arrays(steps: list[int], values: list[float], times: list[float]) -> tuple[np.ndarray, ...]:
    s = np.asarray(steps, dtype=np.int64)
    v = np.asarray(values, dtype=np.float64)
    t = np.asarray(times, dtype=np.float64)
    if len(s) > 1 and np.any(np.diff(s) < 0):
        order = np.argsort(s, kind="stable")
        s, v, t = s[order], v[order], t[order]
    return s, v, t
