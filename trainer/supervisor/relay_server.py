"""The supervisor's end of the metrics relay (trainer/relay.py): one connection per rank (per attempt),
each written through its own db.store.RankWriter as its frames arrive. Runs in the supervisor."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable

from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError

from ddpdash.db.columns import Batch
from ddpdash.db.store import CLOSE_DEADLINE_S, RankWriter

from ..relay import Hello, Listener, read_batch, read_hello, recv_frame, send_frame

log = logging.getLogger(__name__)
REGISTER_DEADLINE_S = 180.0  # a rank's registration waits out a database outage of up to this long


class RelayServer:
    """Accepts the ranks' connections on `listener` and writes what they send for run `run_id`."""

    def __init__(self, engine: Engine, run_id: int, listener: Listener,
                 on_rank_closed: Callable[[], object] | None = None) -> None:
        """`on_rank_closed` runs when a rank's connection has ended and its writer has written everything."""
        self.engine = engine
        self.run_id = run_id
        self.listener = listener
        self.on_rank_closed = on_rank_closed
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._latest: dict[int, threading.Thread] = {}  # rank -> the handler of its newest attempt
        self._writers: dict[int, RankWriter] = {}  # rank -> the writer of its newest attempt
        self._complete: set[int] = set()  # ranks whose newest connection is open, or ended with a goodbye
        threading.Thread(target=self._accept, name="ddpdash-relay-accept", daemon=True).start()

    def drain(self, timeout_s: float = CLOSE_DEADLINE_S + 30.0) -> None:
        """Wait until every connection has ended and its writer has written everything (the ranks
        have exited), then stop listening. The supervisor calls it before it records the outcome."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in threads):
            log.warning("metrics relay: %d rank connection(s) still open after %.0f s",
                        sum(t.is_alive() for t in threads), timeout_s)
        self.listener.close()

    def written_steps(self) -> dict[int, int]:
        """Per rank, the last step whose metrics are in the store — while no rank's newest connection
        ended without a goodbye; empty otherwise (a rank died with metrics unsent: what its successor
        resumes from must not move past them)."""
        with self._lock:
            if self._complete != set(self._writers):
                return {}
            return {rank: writer.written_step for rank, writer in self._writers.items()}

    # ---- connections -------------------------------------------------------------------------
    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.sock.accept()
            except OSError:
                return  # the listener was closed: the run is over
            t = threading.Thread(target=self._serve, args=(conn,), name="ddpdash-relay-rank", daemon=True)
            with self._lock:
                self._threads.append(t)
            t.start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                hello = read_hello(recv_frame(conn), self.listener.token)
                if hello is None:
                    log.warning("metrics relay: refused a connection without the run's token")
                    return
                self._after_previous_attempt(hello.rank)
                writer = self._writer_for(hello)
                with self._lock:
                    self._writers[hello.rank] = writer
                    self._complete.add(hello.rank)
                said_goodbye = False
                try:
                    said_goodbye = _feed(conn, writer)
                finally:
                    writer.close(Batch([], []))  # however the connection ended, what came is written (once)
                    with self._lock:
                        if not said_goodbye and self._writers.get(hello.rank) is writer:
                            self._complete.discard(hello.rank)
                if self.on_rank_closed is not None:
                    self.on_rank_closed()
            except Exception:
                log.exception("metrics relay: a rank's connection failed")

    def _writer_for(self, hello: Hello) -> RankWriter:
        """The rank's writer; registering it retries a busy database for a while rather than lose the
        rank's metrics for the whole run (its frames wait in the socket meanwhile)."""
        deadline = time.monotonic() + REGISTER_DEADLINE_S
        while True:
            try:
                return RankWriter(self.engine, self.run_id, hello.rank, device=hello.device, attempt=hello.attempt,
                                  resume_after_step=hello.resume_after_step, host=hello.host, pid=hello.pid)
            except DBAPIError as exc:
                if time.monotonic() > deadline:
                    raise
                log.warning("metrics relay: registering rank %d failed (%s); retrying", hello.rank, exc)
                time.sleep(0.5)

    def _after_previous_attempt(self, rank: int) -> None:
        """A restarted rank discards the steps after its checkpoint; the previous attempt's writer
        must have written its last points first, or they would survive the discard."""
        with self._lock:
            previous = self._latest.get(rank)
            self._latest[rank] = threading.current_thread()
        if previous is not None:
            previous.join(60.0)


def _feed(conn: socket.socket, writer: RankWriter) -> bool:
    """Write each batch as it arrives: the live view is then at most a send interval behind the rank,
    and the supervisor's work follows the rank's send. A busy database holds the batch; the next one
    (a rank sends at least once per interval) or the close writes it. True when the rank said goodbye
    (everything it logged came), False when the connection just ended (it died)."""
    while True:
        message = recv_frame(conn)
        if message is None:  # the rank exited or died without saying goodbye: the caller writes what came
            return False
        kind = message[0]
        if kind == "batch":
            writer.send(read_batch(message))
        elif kind in ("flush", "close"):
            try:
                writer.flush()
                send_frame(conn, ("ok",))
            except DBAPIError as exc:  # the database is busy or gone: say so, the rank carries on
                send_frame(conn, ("failed", str(exc)))
            if kind == "close":
                return True
        else:
            log.warning("metrics relay: ignoring a %r frame", kind)
