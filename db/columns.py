"""Steps as columns: the form in which metrics travel from a rank to its supervisor (trainer/relay.py)
and in which the writer (db/writer.py) turns them into rows and rollups.

A group is (metric names, steps, times, one column of values per name) for consecutive steps that
logged the same metrics — in a training loop, nearly always a whole batch. Columns are machine arrays:
built in C, sent as raw bytes, and read by numpy without a copy. Standard library only: every rank
imports this.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from array import array
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from db.buffer import LogRow

log = logging.getLogger(__name__)

Group = tuple[tuple[str, ...], "array[int]", "array[float]", tuple["array[float]", ...]]
# The same on the wire: the arrays as raw bytes (the relay is loopback only: one machine, one byte order).
PackedGroup = tuple[tuple[str, ...], bytes, bytes, tuple[bytes, ...]]


def group_logs(logs: Sequence[LogRow]) -> list[Group]:
    """Steps as column groups. A rank's sender holds the GIL the training loop needs while it does this,
    so the usual case is the cheap path: a column per metric, converted to doubles in C (numpy scalars
    and 1-element tensors included). Steps with other metrics, or values that are no numbers, take the
    careful path: a group per run of steps with the same metrics, non-numbers dropped."""
    if not logs:
        return []
    values = [row[2] for row in logs]
    names = tuple(values[0])
    # Every step has exactly the first one's metrics: the same count, and each name found (KeyError else).
    if sum(map(len, values)) == len(names) * len(values):
        with contextlib.suppress(Exception):  # another metric, a non-number: the careful path below
            return [_group(names, logs, values)]
    groups = []
    careful = ((int(step), float(at), _as_floats(vals)) for step, at, vals in logs)
    for group_names, rows in itertools.groupby(careful, key=lambda row: tuple(row[2])):
        same = list(rows)
        groups.append(_group(group_names, same, [row[2] for row in same]))
    return groups


def pack(groups: Sequence[Group]) -> list[PackedGroup]:
    return [(names, steps.tobytes(), times.tobytes(), tuple(c.tobytes() for c in columns))
            for names, steps, times, columns in groups]


def unpack(packed: Sequence[PackedGroup]) -> list[Group]:
    """Groups from the wire, checked: a frame whose columns disagree in length is refused (ValueError)."""
    groups = []
    for names, steps, times, columns in packed:
        group = (tuple(names), _array("q", steps), _array("d", times), tuple(_array("d", c) for c in columns))
        if len(group[3]) != len(group[0]) or any(len(c) != len(group[1]) for c in (group[2], *group[3])):
            raise ValueError("a packed group's columns differ in length")
        groups.append(group)
    return groups


def steps_in(groups: Iterable[Group]) -> int:
    return sum(len(steps) for _, steps, _, _ in groups)


def last_step(groups: Sequence[Group]) -> int | None:
    """The step logged last, whether it logged any metric or not; None without steps."""
    return next((steps[-1] for _, steps, _, _ in reversed(groups) if len(steps)), None)


def _group(names: tuple[str, ...], logs: Sequence[LogRow], values: Sequence[Mapping[str, Any]]) -> Group:
    return (names, array("q", [row[0] for row in logs]), array("d", [row[1] for row in logs]),
            tuple(array("d", [vals[name] for vals in values]) for name in names))


def _array(typecode: str, raw: bytes) -> array[Any]:
    out = array(typecode)
    out.frombytes(raw)
    return out


_WARNED: set[str] = set()  # metrics already warned about: once each, not every step


def _as_floats(values: Mapping[str, Any]) -> dict[str, float]:
    """Every value as a float; one that is no number is dropped (with a warning, once per metric), the
    rest of the step kept."""
    out = {}
    for k, v in values.items():
        try:
            out[k] = float(v)
        except Exception:  # a string, a many-element tensor (RuntimeError), ...
            if k not in _WARNED:
                _WARNED.add(k)
                log.warning("metric %r must be a number, got %r: dropped (and every later one like it)", k, v)
    return out
