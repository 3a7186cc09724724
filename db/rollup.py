"""Vectorised rollups: per-bucket min/max/sum/count of metric series at several bucket widths, merged
with the buckets the writer is still filling. Pure numpy: no database, no Python loop per point, and
one pass for every width and every metric that shares its steps (a batch's metrics do)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np


class Bucket(NamedTuple):
    """One rollup bucket of one metric: a rollup row after its key (run, name, width, rank)."""

    bucket: int  # step // width
    step_min: int
    step_max: int
    vmin: float
    vmax: float
    vsum: float
    count: int
    time_max: float
    vlast: float


def roll_up(steps: np.ndarray, values: np.ndarray, times: np.ndarray, widths: Sequence[int],
            open_buckets: Sequence[Mapping[int, Bucket]]) -> list[list[tuple[int, Bucket]]]:
    """Per metric (a row of `values`, shape metrics × steps), its (width, bucket) rows: for each width
    in turn, the buckets of that many steps these points touch, ascending, the first merged with the
    metric's open bucket of that width (`open_buckets[metric][width]`) when it is the same bucket.
    Steps must be non-decreasing.

    All widths at once: the points are laid out once per width, end to end, and a bucket starts where
    the bucket number changes or a width's run begins; one reduceat then serves every width."""
    n = len(steps)
    width_array = np.asarray(widths, dtype=np.int64)
    index = (steps[np.newaxis, :] // width_array[:, np.newaxis]).ravel()
    new_bucket = np.empty(len(index), dtype=bool)
    new_bucket[0] = True
    np.not_equal(index[1:], index[:-1], out=new_bucket[1:])
    new_bucket[::n] = True
    starts = np.flatnonzero(new_bucket)
    ends = np.append(starts[1:], len(index)) - 1
    first, last = starts % n, ends % n  # positions in `steps`
    laid_out = np.tile(values, len(widths))
    vmin = np.minimum.reduceat(laid_out, starts, axis=1).tolist()
    vmax = np.maximum.reduceat(laid_out, starts, axis=1).tolist()
    vsum = np.add.reduceat(laid_out, starts, axis=1).tolist()
    vlast = values[:, last].tolist()
    shared = (index[starts].tolist(), steps[first].tolist(), steps[last].tolist())
    counts, time_max = (ends - starts + 1).tolist(), times[last].tolist()
    width_of = width_array[starts // n].tolist()
    width_begins = np.flatnonzero(first == 0).tolist()
    out = []
    for i, opened in enumerate(open_buckets):
        buckets = list(map(Bucket._make, zip(*shared, vmin[i], vmax[i], vsum[i], counts, time_max, vlast[i],
                                             strict=True)))
        for j in width_begins:
            earlier = opened.get(width_of[j])
            if earlier is not None and earlier.bucket == buckets[j].bucket:
                buckets[j] = merge(earlier, buckets[j])
        out.append(list(zip(width_of, buckets, strict=True)))
    return out


def merge(earlier: Bucket, later: Bucket) -> Bucket:
    """One bucket from two parts of it, `earlier`'s steps before `later`'s."""
    return later._replace(step_min=earlier.step_min, vmin=min(earlier.vmin, later.vmin),
                          vmax=max(earlier.vmax, later.vmax), vsum=earlier.vsum + later.vsum,
                          count=earlier.count + later.count)


def sorted_by_step(steps: np.ndarray, values: np.ndarray, times: np.ndarray) -> tuple[np.ndarray, ...]:
    """The points in step order (they nearly always are already); `values` is metrics × steps."""
    if len(steps) > 1 and np.any(steps[1:] < steps[:-1]):
        order = np.argsort(steps, kind="stable")
        return steps[order], values[:, order], times[order]
    return steps, values, times
