"""A rank's metrics, on the training step's side: `log()` is an append that returns at once; a background
thread hands what piled up to a sender once per interval. Runs in the ranks.

The sender is where the batches go:
- trainer.relay.RelaySender: to the supervisor that launched the run (a frame over a loopback socket;
  the rank never imports SQLAlchemy);
- ddpdash.db.store.RankWriter: straight into the store, for ranks started by hand (`direct_logger`).

Standard library only at import: a rank that relays never loads the database layer.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Protocol

from ddpdash.db.columns import MAX_BUFFERED_LOGS, Batch, Event, Group, LogRow, group_logs, uniform_group

if TYPE_CHECKING:
    from sqlalchemy import Engine

# Once a second: each batch costs the supervisor a write whatever its size (a commit, the rollup buckets
# still filling rewritten), and with no idle core that CPU is taken from a rank; the Live page refreshes
# every 1.5 s anyway (bench/README.md has the measurements). Each batch is also the rank's heartbeat.
SEND_INTERVAL_S = 1.0
# How often the thread looks for a run's first point (sent at once), until there is one, in the run's first
# minute; a rank that logs later, or never (a script may log on rank 0 only), keeps the one-second cadence.
FIRST_POINT_POLL_S = 0.05
FIRST_POINT_WINDOW_S = 60.0
_HARD_CAP = 2 * MAX_BUFFERED_LOGS


class Sender(Protocol):
    """Takes a rank's batches, in order, from the logger's thread. Never raises into the logger."""

    dropped: int  # steps it could not deliver

    def send(self, batch: Batch) -> None: ...
    def flush(self) -> None: ...  # returns once everything sent is written
    def close(self, batch: Batch) -> None: ...  # the last batch; returns once it is written (or given up)


class RankLogger:
    """One rank's metrics and events. Never raises into, or blocks, the training step."""

    def __init__(self, sender: Sender, rank: int, *, send_interval_s: float = SEND_INTERVAL_S,
                 replaces_steps: bool = False) -> None:
        """`replaces_steps`: this is a restarted attempt that does not know its checkpoint's step (a user's
        script): its first logged step and those after it replace what the failed attempt stored."""
        self.sender = sender
        self._replace_pending = replaces_steps
        self.rank = rank
        self.send_interval_s = send_interval_s
        self._dropped = 0
        self._overflowed = False
        self._sent_a_step = False  # until then the thread looks for the first point often (_run)
        # The thread keeps this to MAX_BUFFERED_LOGS steps, counting what it drops (_trim); the deque's own cap,
        # twice that, is for a thread that cannot run for that long: past it, drops are said, not counted.
        self._logs: collections.deque[LogRow] = collections.deque(maxlen=_HARD_CAP)
        # The training step's entry: one C call, no Python frame of ours (bench/logging_overhead.py: in a
        # step of half a millisecond, every bytecode on this path shows). Rows are (step, time, values).
        self.append_row: Callable[[LogRow], None] = self._logs.append
        self._events: collections.deque[Event] = collections.deque()
        self._status: str | None = None
        self._total: int | None = None
        self.on_tick: Callable[[], object] | None = None  # run on the logger's thread after each send (requests)
        # Run on the logger's thread over each step's values before they are handed on (a script's log()
        # leaves the check for non-numbers and non-finite values to it: off the training step's path).
        self.check_values: Callable[[Mapping[str, object], int], Mapping[str, float]] | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._send_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"ddpdash-metrics-r{rank}", daemon=True)
        self._thread.start()

    @property
    def dropped(self) -> int:
        return self._dropped + self.sender.dropped

    def log(self, step: int, values: Mapping[str, float], at: float | None = None) -> None:
        """Queue one step's values (plain floats), stamped now or `at`: `append_row` with the row made here."""
        self.append_row((step, time.time() if at is None else at, values))

    def event(self, kind: str, message: str, detail: str = "", at: float | None = None) -> None:
        self._events.append(Event(kind, message, detail, time.time() if at is None else at))
        self._wake.set()  # rare, and worth seeing at once (a failure, a restart)

    def set_status(self, status: str) -> None:
        self._status = status

    def set_total_steps(self, total: int) -> None:
        """Rank 0 tells the run how many steps it will take (for progress and ETA)."""
        self._total = total

    def flush(self) -> None:
        """Hand on what is buffered now and wait until it is written."""
        with self._send_lock:
            self.sender.send(self._take())
            self.sender.flush()

    def close(self, status: str | None = None) -> None:
        """Stop the thread and hand on everything left with the final status; closing twice sends once."""
        if status:
            self._status = status
        if self._stop.is_set():
            return
        self._stop.set()
        self._wake.set()
        self._thread.join()
        with self._send_lock:
            self.sender.close(self._take())

    def _run(self) -> None:
        started = last_send = time.monotonic()
        while not self._stop.is_set():
            # Until a step has been sent (in the run's first minute), look for it every FIRST_POINT_POLL_S: the
            # first point goes at once, so the run shows up live sooner (the step path only appends).
            polling = not self._sent_a_step and time.monotonic() - started < FIRST_POINT_WINDOW_S
            woken = self._wake.wait(FIRST_POINT_POLL_S if polling else self.send_interval_s)
            self._wake.clear()
            if self._stop.is_set():
                return  # close() sends what is left
            if polling and not woken and not self._logs and time.monotonic() - last_send < self.send_interval_s:
                continue  # nothing yet, and the next batch (each one a heartbeat) is not due
            last_send = time.monotonic()
            with self._send_lock:
                self.sender.send(self._take())
            if self.on_tick is not None:
                try:
                    self.on_tick()
                except Exception:  # what it does is a diagnosis: never the end of the logger's thread
                    logging.getLogger(__name__).exception("a metrics-thread task failed")

    def _trim(self) -> None:
        """Keep at most MAX_BUFFERED_LOGS steps waiting, the newest, counting the others as dropped."""
        logs = self._logs
        if len(logs) >= _HARD_CAP and not self._overflowed:
            self._overflowed = True
            logging.getLogger(__name__).warning(
                "rank %d: over %d steps waited to be sent; the oldest were dropped, uncounted", self.rank, _HARD_CAP)
        for _ in range(len(logs) - MAX_BUFFERED_LOGS):
            logs.popleft()
            self._dropped += 1

    def _take(self) -> Batch:
        self._trim()
        logs, events = _drain(self._logs), _drain(self._events)
        self._sent_a_step = self._sent_a_step or bool(logs)
        replace_from = None
        if self._replace_pending and logs:
            replace_from, self._replace_pending = min(row[0] for row in logs), False
        return Batch(self._grouped(logs), events, self._status, self._total, replace_from)

    def _grouped(self, logs: list[LogRow]) -> list[Group]:
        """The steps as groups; with `check_values`, only finite numbers. The usual case in C: the steps'
        columns built at once and each summed (a sum is finite only if every term is, or it overflowed:
        then the careful path finds them all finite anyway)."""
        if self.check_values is None or not logs:
            return group_logs(logs)
        group = uniform_group(logs)
        if group is not None and all(math.isfinite(sum(column)) for column in group.columns):
            return [group]
        return group_logs(_checked(logs, self.check_values))


def _checked(logs: list[LogRow], check: Callable[[Mapping[str, object], int], Mapping[str, float]]) -> list[LogRow]:
    """Rows whose values are all finite floats as they are (a type check and a subtraction each, x - x
    being 0.0 for a finite float); the others through `check`. `logs` is _drain's own list."""
    for i, (step, at, values) in enumerate(logs):
        for value in values.values():
            if type(value) is not float or value - value:
                logs[i] = (step, at, check(values, step))
                break
    return logs


def _drain(queue: collections.deque) -> list:  # type: ignore[type-arg]
    """What is in `queue` now, oldest first, taken out one by one: safe while another thread appends
    (what it appends meanwhile stays for the next time)."""
    popleft = queue.popleft
    return [popleft() for _ in range(len(queue))]


def direct_logger(engine: Engine, run_id: int, rank: int, *, device: str = "cpu", attempt: int = 0,
                  resume_after_step: int | None = None, send_interval_s: float = SEND_INTERVAL_S,
                  replaces_steps: bool = False) -> RankLogger:
    """A logger that writes the store itself (ranks started by hand; tests and benchmarks)."""
    from ddpdash.db.store import RankWriter

    writer = RankWriter(engine, run_id, rank, device=device, attempt=attempt, resume_after_step=resume_after_step)
    return RankLogger(writer, rank, send_interval_s=send_interval_s, replaces_steps=replaces_steps)
