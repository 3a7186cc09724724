"""The metrics relay: ranks of a launched run hand their metrics to the run's supervisor, which writes
them to the database (trainer/relay_server.py), instead of writing from the training process.

Why: a writer thread inside the rank shares the GIL with the training loop. Inserting a second's
worth of points (thousands of rows) hands the GIL back and forth with a loop whose steps are well
under a millisecond, and that cost the loop 10–20 %. Here the rank only appends to a buffer and, once
per interval, sends one marshalled frame over a loopback socket; the database work happens in the
supervisor's process. The rank never imports SQLAlchemy either, which takes it off the launch path.

This module is light on purpose (standard library only): every rank imports it.
Frames: 4-byte big-endian length, then `marshal` of a tuple. The first frame is
("hello", token, rank, device, attempt, resume_after_step, pid, host); then ("batch", groups, events,
status, total_steps) at least once per interval (the heartbeat), the steps as packed columns
(db/columns.py); ("flush",) and ("close", status) are answered with ("ok",) once written. marshal
cannot run code; the token keeps other local users out.
"""

from __future__ import annotations

import logging
import marshal
import os
import secrets
import socket
import struct
import threading
from collections.abc import Mapping
from typing import Any

from db.buffer import LogBuffer
from db.columns import group_logs, pack

log = logging.getLogger(__name__)

ADDRESS_ENV = "DDPDASH_RELAY"  # host:port of the supervisor's relay, set only for ranks it launched
TOKEN_ENV = "DDPDASH_RELAY_TOKEN"
# Once a second: each frame costs the supervisor a write whatever its size (a commit, the rollup
# buckets still filling rewritten), and with no idle core that CPU is taken from a rank. Going from
# 0.5 s to 1 s (with fewer rollup rows) took the two-rank logging benchmark's batch cost from 1.1–1.6 %
# to 0.4–0.7 % (bench/README.md); the Live page refreshes every 1.5 s anyway. Also the heartbeat: the
# supervisor stamps the rank alive on every frame.
SEND_INTERVAL_S = 1.0
ACK_TIMEOUT_S = 30.0
_LENGTH = struct.Struct("!I")


class RelayError(Exception):
    """The relay could not be reached or answered out of turn."""


# ---- frames ----------------------------------------------------------------------------------
def send_frame(sock: socket.socket, message: tuple[Any, ...]) -> None:
    data = marshal.dumps(message)
    sock.sendall(_LENGTH.pack(len(data)) + data)


def recv_frame(sock: socket.socket) -> tuple[Any, ...] | None:
    """The next frame, or None when the peer has closed the connection."""
    header = _recv_exactly(sock, _LENGTH.size)
    if header is None:
        return None
    body = _recv_exactly(sock, _LENGTH.unpack(header)[0])
    if body is None:
        return None
    message = marshal.loads(body)
    if not isinstance(message, tuple) or not message:
        raise RelayError(f"malformed relay frame: {type(message).__name__}")
    return message


def _recv_exactly(sock: socket.socket, size: int) -> bytes | None:
    chunks, left = [], size
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


# ---- the supervisor's end: a listening socket, made before torchrun starts -------------------
class Listener:
    """A loopback socket for one run's ranks, and the secret they must present."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0), backlog=128)
        self.token = secrets.token_hex(16)

    @property
    def address(self) -> str:
        host, port = self.sock.getsockname()[:2]
        return f"{host}:{port}"

    def env(self) -> dict[str, str]:
        """What torchrun passes on to the ranks."""
        return {ADDRESS_ENV: self.address, TOKEN_ENV: self.token}

    def close(self) -> None:
        self.sock.close()


def relay_from_env(env: Mapping[str, str] | None = None) -> tuple[str, str] | None:
    env = os.environ if env is None else env
    address, token = env.get(ADDRESS_ENV), env.get(TOKEN_ENV)
    return (address, token) if address and token else None


# ---- the rank's end --------------------------------------------------------------------------
class RelayClient(LogBuffer):
    """MetricWriter's interface for a rank whose supervisor writes the database. Never raises into,
    or blocks, the training step; close() returns once the supervisor has written everything."""

    def __init__(
        self,
        address: str,
        token: str,
        rank: int,
        *,
        device: str = "cpu",
        attempt: int = 0,
        resume_after_step: int | None = None,
        send_interval_s: float = SEND_INTERVAL_S,
    ) -> None:
        super().__init__(rank, status=None)
        self.send_interval_s = send_interval_s
        self._total: int | None = None
        self._send_lock = threading.Lock()
        self._broken = False
        host, port = address.rsplit(":", 1)
        self._sock = socket.create_connection((host, int(port)), timeout=ACK_TIMEOUT_S)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        send_frame(self._sock, ("hello", token, rank, device, attempt, resume_after_step, os.getpid(),
                                socket.gethostname()))
        self._thread = threading.Thread(target=self._run, name=f"ddpdash-relay-r{rank}", daemon=True)
        self._thread.start()

    def set_total_steps(self, total: int) -> None:
        self._total = total

    def flush(self) -> None:
        """Send what is buffered and wait until the supervisor has written it."""
        self._request(("flush",))

    def close(self, status: str | None = None) -> None:
        if not self._halt(status):
            return
        self._request(("close", self._status))
        self._sock.close()

    # ---- background --------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.send_interval_s)
            self._wake.clear()
            if self._stop.is_set():
                return  # close() sends what is left
            self._send_batch()

    def _send_batch(self) -> bool:
        logs, events = self._take()
        with self._send_lock:
            if self._broken:
                self.dropped += len(logs)
                return False
            try:
                send_frame(self._sock, ("batch", pack(group_logs(logs)), events, self._status, self._total))
                return True
            except (OSError, ValueError, TypeError) as exc:
                self._give_up(exc, len(logs))
                return False

    def _request(self, message: tuple[Any, ...]) -> None:
        """Send the buffer, then `message`, and wait for the supervisor's ("ok",)."""
        if not self._send_batch():
            return
        with self._send_lock:
            if self._broken:
                return
            try:
                send_frame(self._sock, message)
                reply = recv_frame(self._sock)
            except (OSError, ValueError, RelayError) as exc:
                self._give_up(exc, 0)
                return
        if reply is None or reply[0] not in ("ok", "failed"):
            self._give_up(RelayError(f"the supervisor answered {reply!r} to {message[0]}"), 0)
        elif reply[0] == "failed":
            log.warning("rank %d: the supervisor could not write metrics yet: %s", self.rank, reply[1:])

    def _give_up(self, exc: Exception, lost: int) -> None:
        # The supervisor is gone (it was killed, or the run is being torn down): training goes on,
        # and ddpdash's reconcile marks the run lost and stops it.
        self._broken = True
        self.dropped += lost
        log.warning("rank %d: metrics relay lost (%s); later metrics are dropped", self.rank, exc)
