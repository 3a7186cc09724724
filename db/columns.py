"""Steps as columns: the form in which metrics travel from a rank (trainer/metrics.py) to the store
(db/store.py), over the supervisor's relay (trainer/relay.py) or straight from the rank.

A group is (metric names, steps, times, one column of values per name) for consecutive steps that
logged the same metrics — in a training loop, nearly always a whole batch. Columns are machine arrays:
built in C, sent as raw bytes, and read by numpy without a copy. Standard library only: every rank
imports this.
"""

from __future__ import annotations

import itertools
import logging
from array import array
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

log = logging.getLogger(__name__)

MAX_BUFFERED_LOGS = 200_000  # steps held in memory at most, on the rank or for the store; the oldest go first

LogRow = tuple[int, float, Mapping[str, float]]  # (step, time, values): what log() appends, kept a plain tuple


class Group(NamedTuple):
    """Consecutive steps that logged the same metrics, one column of values per name."""

    names: tuple[str, ...]
    steps: array[int]
    times: array[float]
    columns: tuple[array[float], ...]


# A group on the wire: the arrays as raw bytes (the relay is loopback only: one machine, one byte order).
PackedGroup = tuple[tuple[str, ...], bytes, bytes, tuple[bytes, ...]]


class Event(NamedTuple):
    kind: str  # db.vocab.EventKind
    message: str
    detail: str
    time: float


class Batch(NamedTuple):
    """What a rank hands on at once: its steps since the last batch, its events, and its news."""

    groups: list[Group]
    events: list[Event]
    status: str | None = None  # db.vocab.RankStatus, when it changed
    total_steps: int | None = None  # the run's step count, when rank 0 knows it
    replace_from: int | None = None  # a restarted attempt's first step: the rank's points from it on are replaced


def merge_batches(batches: Sequence[Batch]) -> Batch:
    """Batches written together (held through an outage) as one: their steps and events in order, the
    newest status and step count."""
    return Batch([g for b in batches for g in b.groups], [e for b in batches for e in b.events],
                 next((b.status for b in reversed(batches) if b.status), None),
                 next((b.total_steps for b in reversed(batches) if b.total_steps is not None), None),
                 next((b.replace_from for b in batches if b.replace_from is not None), None))


def group_logs(logs: Sequence[LogRow]) -> list[Group]:
    """Steps as column groups. A rank's sender holds the GIL the training loop needs while it does this,
    so the usual case is the cheap path: a column per metric, converted to doubles in C (numpy scalars
    and 1-element tensors included). Steps with other metrics, or values that are no numbers, take the
    careful path: a group per run of steps with the same metrics, non-numbers dropped."""
    if not logs:
        return []
    group = uniform_group(logs)
    if group is not None:
        return [group]
    groups = []
    careful = ((int(step), float(at), _as_floats(vals)) for step, at, vals in logs)
    for group_names, rows in itertools.groupby(careful, key=lambda row: tuple(row[2])):
        same = list(rows)
        groups.append(_group(group_names, same, [row[2] for row in same]))
    return groups


def uniform_group(logs: Sequence[LogRow]) -> Group | None:
    """The usual case's one group, or None: every step logged exactly the first one's metrics (the same
    count, and each name found: KeyError else), all numbers (converted to doubles in C)."""
    values = [row[2] for row in logs]
    names = tuple(values[0])
    if sum(map(len, values)) != len(names) * len(values):
        return None
    try:
        return _group(names, logs, values)
    except Exception:  # another metric, a non-number: the careful path
        return None


def pack(groups: Sequence[Group]) -> list[PackedGroup]:
    return [(names, steps.tobytes(), times.tobytes(), tuple(c.tobytes() for c in columns))
            for names, steps, times, columns in groups]


def unpack(packed: Sequence[PackedGroup]) -> list[Group]:
    """Groups from the wire, checked: a frame whose columns disagree in length is refused (ValueError)."""
    groups = []
    for names, steps, times, columns in packed:
        group = Group(tuple(names), _array("q", steps), _array("d", times), tuple(_array("d", c) for c in columns))
        if len(group.columns) != len(group.names) or any(len(c) != len(group.steps)
                                                          for c in (group.times, *group.columns)):
            raise ValueError("a packed group's columns differ in length")
        groups.append(group)
    return groups


def steps_in(groups: Iterable[Group]) -> int:
    return sum(len(g.steps) for g in groups)


def last_step(groups: Sequence[Group]) -> int | None:
    """The step logged last, whether it logged any metric or not; None without steps."""
    return next((g.steps[-1] for g in reversed(groups) if len(g.steps)), None)


def _group(names: tuple[str, ...], logs: Sequence[LogRow], values: Sequence[Mapping[str, Any]]) -> Group:
    return Group(names, array("q", [row[0] for row in logs]), array("d", [row[1] for row in logs]),
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
