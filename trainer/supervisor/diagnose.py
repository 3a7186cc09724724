"""The supervisor's watch over its run's health, on a thread of its own (never the training's, never the
supervise loop's): every few seconds it judges the ranks from their stored metrics (trainer/health.py):

- a rank that stopped stepping: hung. Once per hang its stacks are read and every rank's Flight Recorder
  dumped and analysed (trainer/stacks.py), and a `hung` event says what each rank does;
- the rank the others wait for: a `straggler` event, when the same rank is named twice running (and
  again only when another rank becomes it);

and every alert-worthy event of the run (trainer/alerts.py: the outcome, hung, desync, non-finite,
straggler) is posted to the run's webhook. Where the run keeps raw points for its newest steps only
(RunConfig.keep_raw_steps), it compacts the older ones every few minutes and at the end (db/retention.py).
Runs in the supervisor; works with no browser open.
"""

from __future__ import annotations

import logging
import threading
import time

from sqlalchemy import Engine
from sqlalchemy.orm import Session

from ddpdash.db.queries import events, metric_series
from ddpdash.db.retention import compact_run
from ddpdash.db.runs import add_event, events_after
from ddpdash.db.vocab import EventKind, Metric

from .. import health
from ..alerts import ALERT_KINDS, Alert, Notifier, record_failure, webhook_url
from ..config import RunConfig
from ..stacks import capture_run, latest_capture

log = logging.getLogger(__name__)
CHECK_EVERY_S = 3.0
POINTS = 400  # per rank: enough to know each rank's pace and its newest steps
ALERT_DRAIN_S = 60.0  # how long the ended supervisor waits to deliver what is left (retries included)
COMPACT_EVERY_S = 300.0


class Diagnose:
    def __init__(self, engine: Engine, run_id: int, cfg: RunConfig, every_s: float = CHECK_EVERY_S) -> None:
        self.engine = engine
        self.run_id = run_id
        self.cfg = cfg
        self.every_s = every_s
        url = webhook_url(cfg.to_dict())
        self.notifier = Notifier(url, record_failure(engine, run_id)) if url else None
        self.last_event_id = 0
        self.hang_reported: float | None = None  # the start of the hang last reported
        self.straggler_seen: int | None = None  # named at the last check
        self.straggler_reported: int | None = None
        self.compacted_at = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ddpdash-diagnose", daemon=True)

    def start(self) -> Diagnose:
        self._thread.start()
        return self

    def finish(self) -> None:
        """The run has ended (its outcome recorded): post what is left, then stop."""
        self._stop.set()
        self._thread.join(30.0)
        self._compact()
        if self.notifier is not None:
            self._post_new_alerts()
            self.notifier.close(ALERT_DRAIN_S)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.check()
            except Exception:  # a diagnosis that fails must not end the watch, nor the run
                log.exception("health check failed")

    def check(self, now: float | None = None) -> None:
        now = now or time.time()
        with Session(self.engine) as s:
            loss = metric_series(s, self.run_id, Metric.LOSS, max_points=POINTS)
            step_times = metric_series(s, self.run_id, Metric.STEP_TIME, max_points=POINTS)
        self._hang(loss, now)
        self._straggler(step_times)
        if self.notifier is not None:
            self._post_new_alerts()
        if time.monotonic() - self.compacted_at >= COMPACT_EVERY_S:
            self._compact()

    def _compact(self) -> None:
        self.compacted_at = time.monotonic()
        if not self.cfg.keep_raw_steps:
            return
        try:
            with Session(self.engine) as s, s.begin():
                done = compact_run(s, self.run_id, keep_steps=self.cfg.keep_raw_steps)
            if done.chunks:
                log.info("%s", done.text())
        except Exception:  # the next round tries again; training never waits for it
            log.exception("compaction failed")

    def _hang(self, loss: object, now: float) -> None:
        stalled = health.stalled_ranks(loss, now, self.cfg.hang_after_s)  # type: ignore[arg-type]
        if not stalled:
            self.hang_reported = None
            return
        began = min(now - q[0] for q in stalled.values())
        if self.hang_reported is not None and abs(self.hang_reported - began) < 1.0:
            return  # this hang is reported
        self.hang_reported = began
        with Session(self.engine) as s:
            latest = latest_capture(events(s, self.run_id))
        found = latest if latest is not None and latest.at >= began and latest.finding else None
        found = found or capture_run(self.engine, self.run_id)  # a page may have read it already
        message = f"{health.hang_text(stalled)}: {found.verdict}"
        if found.finding:
            message += f". Flight Recorder: {found.finding}"
        with Session(self.engine) as s, s.begin():
            add_event(s, self.run_id, EventKind.HUNG, message, detail=found.detail())

    def _straggler(self, step_times: object) -> None:
        found = health.find_straggler(step_times)  # type: ignore[arg-type]
        rank = found.rank if found else None
        if found is not None and rank == self.straggler_seen and rank != self.straggler_reported:
            self.straggler_reported = rank
            with Session(self.engine) as s, s.begin():
                add_event(s, self.run_id, EventKind.STRAGGLER, found.text(), rank=rank,
                          detail="median step per rank: " + found.evidence_text())
        self.straggler_seen = rank

    def _post_new_alerts(self) -> None:
        assert self.notifier is not None
        with Session(self.engine) as s:
            new = events_after(s, self.run_id, self.last_event_id, ALERT_KINDS)
        for event_id, ev in new:
            self.last_event_id = event_id
            self.notifier.send(Alert(ev.kind, self.run_id, self.cfg.name, ev.message, ev.rank, ev.time))
