"""Asking a run's ranks for something while they train — a Flight Recorder dump, a profile of the next N
steps — through a file in the run folder (RunDir.requests), never a signal: a rank blocked in a collective
still answers, since each rank reads its requests on its metrics thread, once a tick (a directory listing
a second: nothing on the training step).

    ask(run_dir, kind, **fields) -> request id     the dashboard or the CLI (trainer.stacks, trainer.profiling)
    RankRequests(run_dir, rank, ...).poll()        each rank's metrics thread (trainer.metrics.RankLogger.on_tick)

Standard library only: every rank imports it.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .rundir import RunDir

log = logging.getLogger(__name__)

FLIGHT_RECORDER = "flight_recorder"  # dump the rank's collective trace buffer into RunDir.flight_recorder(id)
PROFILE = "profile"  # profile the next `steps` steps into RunDir.profile(id)
KINDS = (FLIGHT_RECORDER, PROFILE)


def ask(run_dir: RunDir, kind: str, **fields: Any) -> str:
    """Leave a request for every rank of the run; returns its id (the name of the folder its answers go to)."""
    assert kind in KINDS, kind
    request_id = f"{kind}-{time.time_ns()}"
    run_dir.requests.mkdir(parents=True, exist_ok=True)
    tmp = run_dir.requests / f".{request_id}.tmp"
    tmp.write_text(json.dumps({"kind": kind, "at": time.time(), **fields}))
    os.replace(tmp, run_dir.requests / f"{request_id}.json")  # a rank never reads half a request
    return request_id


def withdraw(run_dir: RunDir, request_id: str) -> None:
    """The request is answered (or given up on): ranks started later must not act on it."""
    (run_dir.requests / f"{request_id}.json").unlink(missing_ok=True)


class RankRequests:
    """A rank's side: `poll()` acts on new requests; a profile request waits in `profile` for the loop."""

    def __init__(self, run_dir: RunDir, rank: int, dump_flight_recorder: Callable[[Path, int], bool]) -> None:
        self.run_dir = run_dir
        self.rank = rank
        self.dump_flight_recorder = dump_flight_recorder
        self.started_at = time.time()  # a request older than this rank was for an attempt before it
        self.seen: set[str] = set()
        self.profile: tuple[str, int] | None = None  # (request id, steps), until the loop takes it

    def poll(self) -> None:
        try:
            names = os.listdir(self.run_dir.requests)
        except OSError:
            return  # nothing asked yet
        for name in names:
            if name.endswith(".json") and name not in self.seen:
                self.seen.add(name)
                self._act(name.removesuffix(".json"))

    def take_profile(self) -> tuple[str, int] | None:
        wanted, self.profile = self.profile, None
        return wanted

    def _act(self, request_id: str) -> None:
        try:
            request = json.loads((self.run_dir.requests / f"{request_id}.json").read_text())
        except (OSError, ValueError):
            return  # withdrawn meanwhile, or not ours
        if float(request.get("at", 0)) < self.started_at:
            return
        if request.get("kind") == FLIGHT_RECORDER:
            self.dump_flight_recorder(self.run_dir.flight_recorder(request_id), self.rank)
        elif request.get("kind") == PROFILE:
            self.profile = (request_id, max(1, int(request.get("steps", 1))))
