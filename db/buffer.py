"""The training-step side shared by both metric paths: db.writer.MetricWriter (writes the database
from a thread) and trainer.relay.RelayClient (sends to the supervisor). Standard library only: a rank
that relays imports this and never SQLAlchemy."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Mapping

MAX_BUFFERED_LOGS = 200_000  # log() calls held in memory at most; the oldest are dropped past it

LogRow = tuple[int, float, Mapping[str, float]]  # (step, time, values)
EventRow = tuple[str, str, str, float]  # (kind, message, detail, time)


class LogBuffer:
    """`log()` is an append that returns at once; a background thread takes what piled up."""

    _thread: threading.Thread  # the subclass's background thread

    def __init__(self, rank: int, status: str | None) -> None:
        self.rank = rank
        self.dropped = 0
        self._logs: collections.deque[LogRow] = collections.deque(maxlen=MAX_BUFFERED_LOGS)
        self._events: collections.deque[EventRow] = collections.deque()
        self._status = status
        self._quiet = True  # nothing logged yet
        self._stop = threading.Event()
        self._wake = threading.Event()  # the first point goes at once: the run shows up live sooner

    def log(self, step: int, values: Mapping[str, float], at: float | None = None) -> None:
        """Queue one step's values (plain floats), stamped now or `at` (imports, the relay). On the
        training step's path: an append and little else; the background thread does the rest."""
        logs = self._logs
        if len(logs) == MAX_BUFFERED_LOGS:
            self.dropped += 1
        logs.append((step, time.time() if at is None else at, values))
        if self._quiet:
            self._quiet = False
            self._wake.set()

    def event(self, kind: str, message: str, detail: str = "", at: float | None = None) -> None:
        self._events.append((kind, message, detail, time.time() if at is None else at))
        self._wake.set()  # rare, and worth seeing at once (a failure, a restart)

    def set_status(self, status: str) -> None:
        self._status = status

    def _halt(self, status: str | None) -> bool:
        """Stop the background thread (the subclass's `_thread`); the caller writes what is left.
        False when it was stopped already: closing twice writes once."""
        if status:
            self._status = status
        if self._stop.is_set():
            return False
        self._stop.set()
        self._wake.set()
        self._thread.join()
        return True

    def _take(self) -> tuple[list[LogRow], list[EventRow]]:
        return drain(self._logs), drain(self._events)

    def _put_back_events(self, events: list[EventRow]) -> None:
        """Events that could not be written go back in front, to be retried."""
        self._events.extendleft(reversed(events))


def drain(queue: collections.deque) -> list:  # type: ignore[type-arg]
    """What is in `queue` now, oldest first, taken out one by one: safe while another thread appends
    (what it appends meanwhile stays for the next time)."""
    popleft = queue.popleft
    return [popleft() for _ in range(len(queue))]
