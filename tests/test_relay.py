"""The metrics relay: a rank's logger → RelaySender → the supervisor's RelayServer → RankWriter → database."""

from __future__ import annotations

import marshal
import math
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping

import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from ddpdash.db.columns import Batch, LogRow, group_logs, pack, unpack
from ddpdash.db.queries import count_points, events, metric_series, rank_states
from ddpdash.db.runs import get_run
from ddpdash.trainer import metrics
from ddpdash.trainer.metrics import RankLogger
from ddpdash.trainer.relay import (
    Hello,
    Listener,
    RelayError,
    RelaySender,
    recv_frame,
    relay_from_env,
    send_frame,
)
from ddpdash.trainer.supervisor import relay_server
from ddpdash.trainer.supervisor.relay_server import RelayServer
from tests.conftest import ROOT, make_run, wait_for


@pytest.fixture
def relay(engine: Engine) -> Iterator[tuple[RelayServer, int]]:
    run_id = make_run(engine)
    server = RelayServer(engine, run_id, Listener())
    yield server, run_id
    server.drain(timeout_s=5)


def client(server: RelayServer, rank: int = 0, *, token: str | None = None, device: str = "cpu", attempt: int = 0,
           resume_after_step: int | None = None, send_interval_s: float = 1.0) -> RankLogger:
    """A rank's logger sending to `server`, as a launched rank makes it."""
    return connect(server.listener.address, token or server.listener.token, rank, device=device, attempt=attempt,
                   resume_after_step=resume_after_step, send_interval_s=send_interval_s)


def connect(address: str, token: str, rank: int, *, device: str = "cpu", attempt: int = 0,
            resume_after_step: int | None = None, send_interval_s: float = 1.0) -> RankLogger:
    hello = Hello(rank, device, attempt, resume_after_step, os.getpid(), socket.gethostname())
    return RankLogger(RelaySender(address, token, hello), rank, send_interval_s=send_interval_s)


def test_everything_a_rank_sends_is_written_for_that_rank(engine: Engine, relay: tuple[RelayServer, int]) -> None:
    server, run_id = relay
    c = client(server, rank=1, device="cpu", send_interval_s=0.05)
    c.set_total_steps(500)
    for step in range(1, 501):
        c.log(step, {"loss": 1.0 / step, "lr": 0.1})
    c.event("started", "2 rank(s)")
    c.close(status="done")  # returns once the supervisor has written it all
    with Session(engine) as s:
        assert count_points(s, run_id) == 1000
        state = rank_states(s, run_id).iloc[0]
        assert (state["rank"], state["status"], state["step"]) == (1, "done", 500)
        assert (state["host"], state["pid"]) == (socket.gethostname(), os.getpid())  # the rank's, not the server's
        assert get_run(s, run_id).total_steps == 500
        assert list(events(s, run_id)["kind"]) == ["started"]
        series = metric_series(s, run_id, "loss")
        assert series["value"].min() == pytest.approx(1 / 500)


def test_numpy_scalars_are_sent_as_floats_and_non_numbers_dropped(
    engine: Engine, relay: tuple[RelayServer, int]
) -> None:
    import numpy as np

    server, run_id = relay
    c = client(server, send_interval_s=0.05)
    c.log(1, {"loss": np.float32(0.5), "acc": np.float64(0.25)})  # type: ignore[dict-item]
    c.log(2, {"loss": 0.4, "note": "n/a"})  # type: ignore[dict-item]  # not a number: dropped, loss kept
    c.close()
    assert c.dropped == 0
    with Session(engine) as s:
        assert count_points(s, run_id) == 3
        assert metric_series(s, run_id, "loss")["value"].tolist() == [0.5, pytest.approx(0.4)]


def test_the_first_point_arrives_at_once(engine: Engine, relay: tuple[RelayServer, int]) -> None:
    server, run_id = relay
    c = client(server, send_interval_s=60)
    c.log(1, {"loss": 2.0})
    wait_for(lambda: _points(engine, run_id) == 1, 5, every=0.02)
    c.close()


class HeldSender:
    """A sender that keeps what it is given; its first send waits for `release` (a supervisor that is slow)."""

    def __init__(self) -> None:
        self.dropped = 0
        self.batches: list[Batch] = []
        self.release = threading.Event()

    def send(self, batch: Batch) -> None:
        self.batches.append(batch)
        if len(self.batches) == 1:
            self.release.wait(10)

    def flush(self) -> None: ...

    def close(self, batch: Batch) -> None:
        self.batches.append(batch)

    def steps(self) -> list[int]:
        return [step for b in self.batches for g in b.groups for step in g.steps]


def test_steps_that_pile_up_past_the_bound_are_dropped_oldest_first_and_counted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(metrics, "MAX_BUFFERED_LOGS", 100)
    sender = HeldSender()
    logger = RankLogger(sender, 0, send_interval_s=3600)
    logger.log(1, {"loss": 1.0})
    wait_for(lambda: len(sender.batches) == 1, 5, every=0.01)  # the first point went at once: the thread waits
    for step in range(2, 252):
        logger.append_row((step, time.time(), {"loss": 1.0 / step}))  # the trainer's own entry
    sender.release.set()
    logger.close()
    assert sender.steps() == [1, *range(152, 252)]
    assert logger.dropped == 150


def test_a_rank_that_logs_nothing_still_sends_its_heartbeat_every_interval() -> None:
    sender = HeldSender()
    sender.release.set()
    logger = RankLogger(sender, 1, send_interval_s=0.2)  # a script that logs on rank 0 only
    wait_for(lambda: len(sender.batches) >= 3, 5, every=0.02)
    logger.close()
    assert sender.steps() == []


def test_a_scripts_values_are_checked_only_where_one_is_not_a_finite_number() -> None:
    sender, checked = HeldSender(), []
    sender.release.set()
    logger = RankLogger(sender, 0, send_interval_s=3600)

    def finite_only(values: Mapping[str, object], step: int) -> dict[str, float]:
        checked.append(step)
        return {k: float(v) for k, v in values.items() if math.isfinite(float(v))}  # type: ignore[arg-type]

    logger.check_values = finite_only
    for step in range(1, 6):
        logger.log(step, {"loss": 1.0 / step, "acc": 0.5})
    logger.log(6, {"loss": math.inf, "acc": 0.75})
    logger.log(7, {"loss": 0.1, "acc": 1})  # an int: a number, converted as it is
    logger.close()
    assert checked == [6, 7]  # the usual case (all finite floats) never reaches the check
    rows = [(int(step), dict(zip(g.names, (c[i] for c in g.columns), strict=True)))
            for b in sender.batches for g in b.groups for i, step in enumerate(g.steps)]
    assert rows[-2:] == [(6, {"acc": 0.75}), (7, {"loss": 0.1, "acc": 1.0})]
    assert [step for step, _ in rows] == list(range(1, 8))


def test_every_batch_is_written_as_it_arrives(engine: Engine, relay: tuple[RelayServer, int]) -> None:
    server, run_id = relay
    c = client(server, send_interval_s=0.1)
    c.log(1, {"loss": 2.0})
    wait_for(lambda: _points(engine, run_id) == 1, 5, every=0.02)
    c.log(2, {"loss": 1.5})
    c.log(3, {"loss": 1.0})
    # Within a few send intervals: each frame is written as it arrives, nothing waits for a timer.
    wait_for(lambda: _points(engine, run_id) == 3, 2.0, every=0.02)
    c.close()


def test_heartbeat_is_when_the_supervisor_last_heard_from_the_rank(
    engine: Engine, relay: tuple[RelayServer, int]
) -> None:
    server, run_id = relay
    host, port = server.listener.address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)))
    send_frame(sock, ("hello", server.listener.token, 0, "cpu", 0, None, 4242, "node-a"))
    send_frame(sock, ("batch", pack(group_logs([(1, time.time(), {"loss": 1.0})])), [], None, None, None))
    wait_for(lambda: _points(engine, run_id) == 1, 10, every=0.02)
    with Session(engine) as s:
        heard = rank_states(s, run_id).iloc[0]["heartbeat_at"]
    time.sleep(2.5)  # silent, like a frozen process: the heartbeat must not move
    with Session(engine) as s:
        state = rank_states(s, run_id).iloc[0]
    assert state["heartbeat_at"] == heard and time.time() - heard >= 2.5
    assert (state["host"], state["pid"]) == ("node-a", 4242)
    sock.close()


def test_a_rank_that_dies_without_closing_keeps_what_it_sent(engine: Engine, relay: tuple[RelayServer, int]) -> None:
    server, run_id = relay
    code = (
        "import sys; from tests.test_relay import connect\n"
        "c = connect(sys.argv[1], sys.argv[2], 0, send_interval_s=0.05)\n"
        "[c.log(i, {'loss': float(i)}) for i in range(1, 101)]\n"
        "c.flush()\n"  # sent and written: what follows is a death, not a race
        "import os; os._exit(1)\n"  # no close(): killed mid-run
    )
    died = subprocess.run([sys.executable, "-c", code, server.listener.address, server.listener.token], cwd=ROOT,
                          timeout=60, capture_output=True, text=True)
    assert died.returncode == 1, died.stderr  # os._exit(1), not an import error
    server.drain(timeout_s=10)
    with Session(engine) as s:
        assert count_points(s, run_id) == 100
        assert rank_states(s, run_id).iloc[0]["status"] == "running"  # the supervisor judges the outcome


def test_a_connection_without_the_token_is_refused(engine: Engine, relay: tuple[RelayServer, int]) -> None:
    server, run_id = relay
    c = client(server, token="not-the-token", send_interval_s=0.05)
    c.log(1, {"loss": 1.0})
    c.close()  # never raises into training: the refusal is logged and the metrics dropped
    with Session(engine) as s:
        assert count_points(s, run_id) == 0
        assert rank_states(s, run_id).empty


def test_a_restarted_rank_replaces_what_the_failed_attempt_wrote_after_the_checkpoint(
    engine: Engine, relay: tuple[RelayServer, int]
) -> None:
    server, run_id = relay
    first = client(server, send_interval_s=0.05)
    for step in range(1, 31):
        first.log(step, {"loss": float(step)})
    first.flush()
    first.sender._sock.close()  # type: ignore[attr-defined]  # the attempt is killed: no goodbye
    second = client(server, attempt=1, resume_after_step=20, send_interval_s=0.05)
    for step in range(21, 41):
        second.log(step, {"loss": -float(step)})
    second.close(status="done")
    with Session(engine) as s:
        frame = metric_series(s, run_id, "loss", max_points=100)
        state = rank_states(s, run_id).iloc[0]
    assert sorted(frame["step"]) == list(range(1, 41))  # each step once
    assert (frame[frame["step"] > 20]["value"] < 0).all()  # and after the checkpoint, the new attempt's
    assert state["attempt"] == 1


def test_a_rank_keeps_training_when_the_supervisor_is_gone(engine: Engine) -> None:
    listener = Listener()
    c = connect(listener.address, listener.token, 0, send_interval_s=0.01)
    listener.close()  # accepted by the backlog, never served
    for step in range(1, 2001):
        c.log(step, {"loss": 1.0})
    c.close()
    assert c.dropped > 0


def test_ranks_find_the_relay_in_their_environment() -> None:
    listener = Listener()
    assert relay_from_env(listener.env()) == (listener.address, listener.token)
    assert relay_from_env({}) is None
    listener.close()


def test_steps_survive_packing_whatever_they_log() -> None:
    import numpy as np
    import torch

    same = [(step, 100.0 + step, {"loss": 1 / step, "lr": 0.1}) for step in range(1, 6)]
    assert through_the_wire(same) == same
    assert len(group_logs(same)) == 1  # one column per metric for the whole batch
    mixed = [
        (1, 1.0, {"loss": np.float32(0.5), "lr": 0.1}),
        (2, 2.0, {"lr": 0.1, "loss": 0.25}),  # the same metrics in another order
        (3, 3.0, {"loss": torch.tensor(0.125), "lr": 0.1, "val_loss": 2}),  # an evaluation step
        (4, 4.0, {"loss": 0.0625, "note": "n/a", "grads": torch.ones(2)}),  # not numbers: dropped
        (5, 5.0, {}),
    ]
    assert through_the_wire(mixed) == [
        (1, 1.0, {"loss": 0.5, "lr": 0.1}),
        (2, 2.0, {"lr": 0.1, "loss": 0.25}),
        (3, 3.0, {"loss": 0.125, "lr": 0.1, "val_loss": 2.0}),
        (4, 4.0, {"loss": 0.0625}),
        (5, 5.0, {}),
    ]
    assert group_logs([]) == []


def through_the_wire(logs: list[LogRow]) -> list[LogRow]:
    """Steps as the supervisor receives them, one (step, time, values) each again."""
    groups = unpack(marshal.loads(marshal.dumps(pack(group_logs(logs)))))
    return [(step, at, dict(zip(names, vals, strict=True)))
            for names, steps, times, columns in groups
            for step, at, *vals in zip(steps, times, *columns, strict=True)]


def test_malformed_frames_are_rejected() -> None:
    a, b = socket.socketpair()
    a.sendall(b"\x00\x00\x00\x01N")  # marshal of None: not a tuple
    with pytest.raises(RelayError, match="malformed"):
        recv_frame(b)
    a.close()
    b.close()


def _points(engine: Engine, run_id: int) -> int:
    with Session(engine) as s:
        return count_points(s, run_id)


def test_a_busy_database_at_registration_is_retried_not_fatal(
    engine: Engine, relay: tuple[RelayServer, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    from sqlalchemy.exc import OperationalError

    server, run_id = relay
    real, calls = relay_server.RankWriter, []

    def busy_once(*args: object, **kw: object) -> object:
        calls.append(1)
        if len(calls) == 1:
            raise OperationalError("INSERT", {}, Exception("database is locked"))
        return real(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(relay_server, "RankWriter", busy_once)
    c = client(server, send_interval_s=0.05)
    c.log(1, {"loss": 1.0})
    c.close(status="done")
    assert len(calls) == 2 and c.dropped == 0
    with Session(engine) as s:
        assert count_points(s, run_id) == 1
