"""The metrics relay: ranks of a launched run hand their metrics to the run's supervisor, which writes
them to the database (trainer/supervisor/relay_server.py), instead of writing from the training process.

Why: a writer thread inside the rank shares the GIL with the training loop. Inserting a second's
worth of points (thousands of rows) hands the GIL back and forth with a loop whose steps are well
under a millisecond, and that cost the loop 10–20 %. Here the rank only appends to a buffer and, once
per interval, sends one marshalled frame over a loopback socket; the database work happens in the
supervisor's process. The rank never imports SQLAlchemy either, which takes it off the launch path.

This module is light on purpose (standard library only): every rank imports it; the supervisor imports
it for the frames and the listening socket.
Frames: 4-byte big-endian length, then `marshal` of a tuple. The first frame is
("hello", token, rank, device, attempt, resume_after_step, pid, host); then ("batch", groups, events,
status, total_steps, replace_from) at least once per interval (the heartbeat), the steps as packed columns
(db/columns.py); ("flush",) and ("close",) are answered with ("ok",) once written, or ("failed", why).
marshal cannot run code; the token keeps other local users out.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import marshal
import os
import secrets
import select
import socket
import struct
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from ddpdash.db.columns import Batch, Event, pack, unpack

if TYPE_CHECKING:
    from .metrics import Sender

log = logging.getLogger(__name__)

ADDRESS_ENV = "DDPDASH_RELAY"  # host:port of the supervisor's relay, set only for ranks it launched
TOKEN_ENV = "DDPDASH_RELAY_TOKEN"
SUPERVISOR_PID_ENV = "DDPDASH_SUPERVISOR_PID"  # whether it still lives decides who records the outcome
ACK_TIMEOUT_S = 30.0
_LENGTH = struct.Struct("!I")


class RelayError(Exception):
    """The relay could not be reached or answered out of turn."""


# ---- frames ----------------------------------------------------------------------------------
class Hello(NamedTuple):
    """Who is on the other end of a rank's connection."""

    rank: int
    device: str
    attempt: int
    resume_after_step: int | None
    pid: int
    host: str


def hello_frame(token: str, hello: Hello) -> tuple[Any, ...]:
    return ("hello", token, *hello)


def read_hello(frame: tuple[Any, ...] | None, token: str) -> Hello | None:
    """The rank's introduction, or None when the frame is not one that carries the run's token."""
    if (frame is None or len(frame) != 8 or frame[0] != "hello" or not isinstance(frame[1], str)
            or not hmac.compare_digest(frame[1], token)):
        return None
    rank, device, attempt, resume, pid, host = frame[2:]
    return Hello(int(rank), str(device), int(attempt), None if resume is None else int(resume), int(pid), str(host))


def batch_frame(batch: Batch) -> tuple[Any, ...]:
    return ("batch", pack(batch.groups), [tuple(e) for e in batch.events], batch.status, batch.total_steps,
            batch.replace_from)


def read_batch(frame: tuple[Any, ...]) -> Batch:
    """A batch frame's contents, checked (ValueError for columns that disagree in length)."""
    _, groups, events, status, total, replace_from = frame
    return Batch(unpack(groups), [Event(*e) for e in events], status, total, replace_from)


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
        return {ADDRESS_ENV: self.address, TOKEN_ENV: self.token, SUPERVISOR_PID_ENV: str(os.getpid())}

    def close(self) -> None:
        self.sock.close()


def supervisor_gone(env: Mapping[str, str] | None = None) -> bool:
    """Whether the supervisor that launched this rank has died (a zombie counts as dead)."""
    raw = (os.environ if env is None else env).get(SUPERVISOR_PID_ENV, "")
    if not raw.isdigit():
        return False
    try:
        with open(f"/proc/{raw}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def relay_from_env(env: Mapping[str, str] | None = None) -> tuple[str, str] | None:
    env = os.environ if env is None else env
    address, token = env.get(ADDRESS_ENV), env.get(TOKEN_ENV)
    return (address, token) if address and token else None


# ---- the rank's end --------------------------------------------------------------------------
class RelaySender:
    """A rank's sender (trainer/metrics.py) when its supervisor writes the database: every batch goes
    as one frame. Connects at once (OSError if the supervisor cannot be reached); never raises after.

    Should the supervisor go (killed, or its machine's OOM killer), `fallback` makes the sender that takes
    over — the store itself, for a launched rank — and the batch that could not be sent goes there, as
    does everything after it: training goes on and keeps its metrics."""

    def __init__(self, address: str, token: str, hello: Hello,
                 fallback: Callable[[], Sender] | None = None) -> None:
        self.rank = hello.rank
        self.dropped = 0
        self.taken_over: Sender | None = None  # the fallback, once the supervisor is gone
        self._fallback = fallback
        self._broken = False
        host, port = address.rsplit(":", 1)
        self._sock = socket.create_connection((host, int(port)), timeout=ACK_TIMEOUT_S)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        send_frame(self._sock, hello_frame(token, hello))

    def send(self, batch: Batch) -> None:
        if self.taken_over is not None:
            self.taken_over.send(batch)
            return
        if self._broken:
            self.dropped += _steps(batch)
            return
        if self._peer_gone():
            self._give_up(RelayError("the supervisor closed the connection"), batch)
            return
        try:
            send_frame(self._sock, batch_frame(batch))
        except (OSError, ValueError, TypeError) as exc:
            self._give_up(exc, batch)

    def flush(self) -> None:
        if self.taken_over is not None:
            self.taken_over.flush()
            return
        self._request(("flush",))

    def close(self, batch: Batch) -> None:
        self.send(batch)
        if self.taken_over is not None:
            self.taken_over.close(Batch([], [], batch.status, batch.total_steps))
            return
        self._request(("close",))
        self._sock.close()

    def _peer_gone(self) -> bool:
        """Whether the supervisor's end has closed: a killed process's socket is closed by the kernel, and
        a frame sent into it would vanish without an error (the first send after a close succeeds)."""
        try:
            readable, _, _ = select.select([self._sock], [], [], 0)
            return bool(readable) and self._sock.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):  # ValueError: the socket is closed already (fd -1)
            return True

    def _request(self, message: tuple[Any, ...]) -> None:
        """Send `message` and wait for the supervisor's ("ok",): everything before it is written."""
        if self._broken:
            return
        try:
            send_frame(self._sock, message)
            reply = recv_frame(self._sock)
        except (OSError, ValueError, RelayError) as exc:
            self._give_up(exc, None)
            return
        if reply is None or reply[0] not in ("ok", "failed"):
            self._give_up(RelayError(f"the supervisor answered {reply!r} to {message[0]}"), None)
        elif reply[0] == "failed":
            log.warning("rank %d: the supervisor could not write metrics yet: %s", self.rank, reply[1:])

    def _give_up(self, exc: Exception, unsent: Batch | None) -> None:
        """The supervisor is gone (killed, or the run is being torn down): training goes on; its
        metrics go to the fallback if there is one, else they are counted as dropped."""
        self._broken = True
        with contextlib.suppress(OSError):
            self._sock.close()
        if self._fallback is not None:
            try:
                self.taken_over = self._fallback()
            except Exception as fallback_exc:  # the store is unreachable too: nothing left to try
                log.warning("rank %d: metrics relay lost (%s) and the store unreachable (%s); metrics dropped",
                            self.rank, exc, fallback_exc)
            else:
                log.warning("rank %d: metrics relay lost (%s); writing metrics to the store directly", self.rank, exc)
                if unsent is not None:
                    self.taken_over.send(unsent)
                return
        self.dropped += _steps(unsent) if unsent is not None else 0
        log.warning("rank %d: metrics relay lost (%s); later metrics are dropped", self.rank, exc)


def _steps(batch: Batch) -> int:
    return sum(len(g.steps) for g in batch.groups)
