"""The supervisor's end of the metrics relay (trainer/relay.py): one connection per rank (per
attempt), each feeding a MetricWriter that writes for that rank from the supervisor's process."""

from __future__ import annotations

import hmac
import logging
import socket
import threading
import time
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError

from db.columns import unpack
from db.writer import MetricWriter
from trainer.relay import Listener, recv_frame, send_frame

log = logging.getLogger("trainer.supervisor")
REGISTER_DEADLINE_S = 60.0
# Each batch is written as it arrives (_write_now); the writer's own timer only retries a batch the
# database refused (when no further batch comes to carry it), so it can be slow.
WRITER_RETRY_INTERVAL_S = 5.0


class RelayServer:
    """Accepts the ranks' connections on `listener` and writes what they send for run `run_id`."""

    def __init__(self, engine: Engine, run_id: int, listener: Listener) -> None:
        self.engine = engine
        self.run_id = run_id
        self.listener = listener
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._latest: dict[int, threading.Thread] = {}  # rank -> the handler of its newest attempt
        threading.Thread(target=self._accept, name="ddpdash-relay-accept", daemon=True).start()

    def drain(self, timeout_s: float = 30.0) -> None:
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
                hello = recv_frame(conn)
                if not _valid_hello(hello, self.listener.token):
                    log.warning("metrics relay: refused a connection without the run's token")
                    return
                assert hello is not None
                _, _, rank, device, attempt, resume_after_step, pid, host = hello
                self._after_previous_attempt(int(rank))
                heard = _LastHeard()
                writer = self._writer_for(int(rank), str(device), int(attempt), resume_after_step, heard,
                                          (str(host), int(pid)))
                try:
                    _feed(conn, writer, heard)
                finally:
                    writer.close()  # however the connection ended, what came is written (once)
            except Exception:
                log.exception("metrics relay: a rank's connection failed")

    def _writer_for(self, rank: int, device: str, attempt: int, resume_after_step: int | None, heard: _LastHeard,
                    process: tuple[str, int]) -> MetricWriter:
        """The rank's writer; registering it retries a busy database for a while rather than lose the
        rank's metrics for the whole run (its frames wait in the socket meanwhile)."""
        deadline = time.monotonic() + REGISTER_DEADLINE_S
        while True:
            try:
                return MetricWriter(self.engine, self.run_id, rank, device=device, attempt=attempt,
                                    resume_after_step=resume_after_step, alive_at=heard.at, process=process,
                                    flush_interval_s=WRITER_RETRY_INTERVAL_S)
            except DBAPIError as exc:
                if time.monotonic() > deadline:
                    raise
                log.warning("metrics relay: registering rank %d failed (%s); retrying", rank, exc)
                time.sleep(0.5)

    def _after_previous_attempt(self, rank: int) -> None:
        """A restarted rank discards the steps after its checkpoint; the previous attempt's writer
        must have written its last points first, or they would survive the discard."""
        with self._lock:
            previous = self._latest.get(rank)
            self._latest[rank] = threading.current_thread()
        if previous is not None:
            previous.join(60.0)


class _LastHeard:
    """When the rank last sent a frame: its heartbeat (it sends at least every SEND_INTERVAL_S)."""

    def __init__(self) -> None:
        self.time = time.time()

    def at(self) -> float:
        return self.time


def _valid_hello(hello: tuple[Any, ...] | None, token: str) -> bool:
    return (hello is not None and len(hello) == 8 and hello[0] == "hello" and isinstance(hello[1], str)
            and hmac.compare_digest(hello[1], token))


def _write_now(writer: MetricWriter) -> None:
    """Write a batch as soon as it arrives: the live view is then at most a send interval behind the
    rank, not up to the writer's interval more, and the supervisor's work follows the rank's send. A busy
    database keeps the batch buffered; the next batch, the writer's retry timer or close() writes it."""
    try:
        writer.flush()
    except Exception as exc:
        log.warning("metrics relay: writing rank %d's batch failed (%s); it stays buffered", writer.rank, exc)


def _feed(conn: socket.socket, writer: MetricWriter, heard: _LastHeard) -> None:
    while True:
        message = recv_frame(conn)
        if message is None:  # the rank exited or died without saying goodbye: the caller writes what came
            return
        heard.time = time.time()
        kind = message[0]
        if kind == "batch":
            _, groups, events, status, total = message
            writer.log_groups(unpack(groups))
            for event_kind, text, detail, at in events:
                writer.event(event_kind, text, detail, at=at)
            if status:
                writer.set_status(status)
            if total is not None:
                writer.set_total_steps(total)
            _write_now(writer)
        elif kind == "flush":
            try:
                writer.flush()
                send_frame(conn, ("ok",))
            except Exception as exc:  # the database is busy or gone: say so, the rank carries on
                send_frame(conn, ("failed", str(exc)))
        elif kind == "close":
            writer.close(status=message[1])
            send_frame(conn, ("ok",))
            return
        else:
            log.warning("metrics relay: ignoring a %r frame", kind)
