"""Telling someone: a webhook (RunConfig.webhook, else DDPDASH_WEBHOOK_URL) gets a JSON POST when a run
succeeds, fails, is lost or hangs, and on a desync, a non-finite loss or a straggler. The body carries a
`text` line, so a Slack or Mattermost incoming webhook shows it as is, beside the fields a program reads:

    {"text": "ddpdash run #12 \\"mlp-sweep\\" failed: rank(s) [1] failed", "event": "failed", "run_id": 12, ...}

Delivery runs on a thread of its own, off the training path: each alert is tried with growing pauses
(RETRY_DELAYS_S), never raises into its caller, and one that cannot be delivered is logged and recorded on
the run as an `alert_failed` event. The supervisor posts its run's alerts (trainer/supervisor/diagnose.py);
reconciliation posts `lost` (its supervisor is gone).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ddpdash.db.vocab import EventKind

log = logging.getLogger(__name__)

WEBHOOK_ENV = "DDPDASH_WEBHOOK_URL"
# Event kinds that are alerts, and the word each is posted as.
ALERTS = {EventKind.FINISHED: "succeeded", EventKind.FAILED: "failed", EventKind.LOST: "lost",
          EventKind.HUNG: "hung", EventKind.DESYNC: "desync", EventKind.NONFINITE: "non-finite",
          EventKind.STRAGGLER: "straggler"}
ALERT_KINDS = tuple(ALERTS)
RETRY_DELAYS_S = (1.0, 2.0, 4.0, 8.0)  # after the first try: five in all, over about a quarter of a minute
POST_TIMEOUT_S = 5.0
TEXT_LIMIT = 1500  # a chat message's line; the whole message is in `message`


def webhook_url(config: dict[str, Any]) -> str:
    """Where a run's alerts go: its own setting, else the environment's; "" for nowhere (or a bad URL)."""
    from .config import webhook_problem

    url = str(config.get("webhook") or os.environ.get(WEBHOOK_ENV, "")).strip()
    if url and (why := webhook_problem(url)):
        log.warning("webhook: %s %s; no alerts sent", WEBHOOK_ENV, why)
        return ""
    return url


@dataclass(frozen=True)
class Alert:
    kind: str  # the event kind (EventKind)
    run_id: int
    run_name: str
    message: str
    rank: int | None = None
    at: float = 0.0

    @property
    def event(self) -> str:
        return ALERTS.get(self.kind, self.kind)

    def body(self) -> dict[str, Any]:
        text = f'ddpdash run #{self.run_id} "{self.run_name}" {self.event}: {self.message}'
        return {"text": text if len(text) <= TEXT_LIMIT else text[:TEXT_LIMIT] + "…", "event": self.event,
                "kind": self.kind, "run_id": self.run_id, "run_name": self.run_name, "message": self.message,
                "rank": self.rank, "time": self.at or time.time(), "host": socket.gethostname()}


def post(url: str, body: dict[str, Any], timeout_s: float = POST_TIMEOUT_S) -> None:
    """One POST; raises with the reason when it is not answered with a 2xx."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json", "User-Agent": "ddpdash"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        if not 200 <= response.status < 300:
            raise urllib.error.HTTPError(url, response.status, response.reason, response.headers, None)


def why_failed(exc: BaseException) -> str:
    if isinstance(exc, urllib.error.HTTPError):
        return f"HTTP {exc.code} {exc.reason}"
    if isinstance(exc, urllib.error.URLError):
        return str(exc.reason)
    return f"{type(exc).__name__}: {exc}"


class Notifier:
    """Posts alerts to one URL, in order, on its own thread; `on_failure(alert, why)` hears of each one given up."""

    def __init__(self, url: str, on_failure: Callable[[Alert, str], None],
                 delays_s: tuple[float, ...] = RETRY_DELAYS_S, daemon: bool = True) -> None:
        self.url = url
        self.on_failure = on_failure
        self.delays_s = delays_s
        self.delivered = 0
        self._queue: queue.Queue[Alert | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="ddpdash-alerts", daemon=daemon)
        self._thread.start()

    def send(self, alert: Alert) -> None:
        self._queue.put(alert)

    def close(self, timeout_s: float = 60.0) -> None:
        """Deliver what is queued (tries and pauses included) for at most `timeout_s`, then stop."""
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while (alert := self._queue.get()) is not None:
            self._deliver(alert)

    def _deliver(self, alert: Alert) -> None:
        why = ""
        for attempt, pause in enumerate((0.0, *self.delays_s)):
            time.sleep(pause)
            try:
                post(self.url, alert.body())
                self.delivered += 1
                return
            except Exception as exc:  # whatever the endpoint does, the caller carries on
                why = why_failed(exc)
                log.warning("webhook: %s alert of run %d not delivered (try %d): %s", alert.event, alert.run_id,
                            attempt + 1, why)
        try:
            self.on_failure(alert, f"{why} after {len(self.delays_s) + 1} tries")
        except Exception:
            log.exception("webhook: could not record a failed delivery")


def record_failure(engine: Any, run_id: int) -> Callable[[Alert, str], None]:
    """An `on_failure` that records the lost alert on the run (an `alert_failed` event)."""
    def record(alert: Alert, why: str) -> None:
        from sqlalchemy.orm import Session

        from ddpdash.db.runs import add_event

        with Session(engine) as s, s.begin():
            add_event(s, run_id, EventKind.ALERT_FAILED, f"the {alert.event} alert could not be delivered: {why}")
    return record


def notify_once(engine: Any, run_id: int, run_name: str, config: dict[str, Any], kind: str, message: str) -> None:
    """Post one alert from a process that is not the run's supervisor (reconciliation: `lost`); the post
    runs on a thread the process waits for at exit, never in the caller."""
    url = webhook_url(config)
    if not url:
        return
    notifier = Notifier(url, record_failure(engine, run_id), daemon=False)
    notifier.send(Alert(kind, run_id, run_name, message, at=time.time()))
    notifier.close(timeout_s=0)  # the thread finishes the delivery and ends
