"""The DDP diagnostics of issue 18 on real 2-rank gloo runs, each provoked: where a step's time goes (and the
communication share), a profile on demand, a non-finite loss, and alerts to a webhook that also fails on
purpose — what the Live page, the Runs page and the CLI say of each. (The hang's stacks and Flight Recorder
finding: tests/test_stacks.py; the straggler: tests/test_faults.py.)"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from ddpdash.dashboard import history, livedata
from ddpdash.db.queries import events, metric_series
from ddpdash.db.runs import create_run, update_run
from ddpdash.db.vocab import EventKind, Metric, RunStatus
from ddpdash.trainer import alerts
from ddpdash.trainer.config import RunConfig
from ddpdash.trainer.control import LaunchError, launch, prepare, reconcile, stop
from tests.conftest import CPU_MACHINE, tiny, wait_final, wait_for
from tests.test_scripts import script

pytestmark = pytest.mark.slow


def show(engine: Engine, run_id: int) -> str:
    from ddpdash.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["--db-url", str(engine.url), "show", str(run_id)]) == 0
    return out.getvalue()


def kinds(engine: Engine, run_id: int) -> list[str]:
    with Session(engine) as s:
        return list(events(s, run_id)["kind"])


# ---- 1: the Flight Recorder of a failed run ----------------------------------------------------------------
def test_a_failed_runs_error_names_the_collective_a_rank_never_joined(engine: Engine,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DDPDASH_TEST_FAULT", "raise:1:5")  # rank 1 raises after step 5; rank 0 waits in step 6's
    run = wait_final(engine, launch(engine, tiny(max_steps=30, sync_check_every=0), CPU_MACHINE))
    assert run.status == RunStatus.FAILED and run.failed_ranks == (1,)
    assert "Flight Recorder: rank 1 never joined collective #" in run.error, run.error
    assert "all_reduce (rank 0 waits in it)" in run.error


# ---- 2: where a step's time goes --------------------------------------------------------------------------
def test_each_ranks_step_is_split_into_phases_and_communication(engine: Engine) -> None:
    from tests.test_dashboard_app import chart_specs, open_page, ran

    run = wait_final(engine, launch(engine, tiny(max_steps=60), CPU_MACHINE))
    assert run.status == RunStatus.SUCCEEDED
    with Session(engine) as s:
        series = {name: metric_series(s, run.id, name) for name in (*Metric.PHASES, Metric.COMM_TIME,
                                                                     Metric.COMM_OVERLAP_TIME, Metric.COMM_SHARE)}
    for name, df in series.items():
        assert sorted(df["rank"].unique()) == [0, 1], name
        assert (df["value"] >= 0).all(), name
    # DDP's sampled timings: the all-reduce runs partly beside the backward, and is part of the step.
    assert (series[Metric.COMM_OVERLAP_TIME]["value"] <= series[Metric.COMM_TIME]["value"] + 1e-9).all()
    assert series[Metric.COMM_SHARE]["value"].between(0, 1).all() and series[Metric.COMM_SHARE]["value"].max() > 0
    at = open_page("views/live.py", run=str(run.id))
    ran(at.run())
    titles = [spec.get("title") for spec in chart_specs(at)]
    assert "Time per step" in titles and "Communication share" in titles, titles
    out = show(engine, run.id)
    assert "time per step, rank 0: data wait" in out and "communication (not overlapped)" in out, out
    assert "; communication share " in out
    with Session(engine) as s:  # the Runs page (and Compare, from the same summaries) gain the median share
        rows = history.runs_page(s, history.RunFilter()).rows
    assert 0 < float(rows.loc[rows["id"] == run.id, "comm_share"].iloc[0]) <= 1


def test_a_script_times_its_phases_and_watches_its_ddp_model(engine: Engine, tmp_path: Path) -> None:
    path = script(tmp_path, body="""
        with ddpdash.phase("optimizer"):
            time.sleep(0.002)
        ddpdash.log({"loss": loss.item()}, step=step)
    """, setup="ddpdash.watch(model)", steps=30)
    run = wait_final(engine, launch(engine, RunConfig(script=str(path), num_procs=2), CPU_MACHINE), 120)
    assert run.status == RunStatus.SUCCEEDED, run.error
    with Session(engine) as s:
        optimizer = metric_series(s, run.id, Metric.OPTIMIZER_TIME)
        share = metric_series(s, run.id, Metric.COMM_SHARE)
    assert sorted(optimizer["rank"].unique()) == [0, 1] and optimizer["value"].median() >= 0.002
    assert sorted(share["rank"].unique()) == [0, 1] and share["value"].between(0, 1).all()


# ---- 4: a profile on demand --------------------------------------------------------------------------------
def test_a_profile_of_the_next_steps_from_the_cli_and_on_the_page(engine: Engine) -> None:
    from tests.test_dashboard_app import open_page, ran

    run_id = launch(engine, tiny(max_steps=100_000), CPU_MACHINE)
    wait_for(lambda: len(_loss(engine, run_id)) >= 20, 90)
    out = subprocess.run([sys.executable, "-m", "ddpdash.cli", "--db-url", str(engine.url), "profile", str(run_id),
                          "--steps", "3", "--timeout", "60"], capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stdout + out.stderr
    for rank in (0, 1):
        assert f"-- rank {rank}: steps " in out.stdout, out.stdout
    traces = sorted(Path(line.split(", trace ")[1]) for line in out.stdout.splitlines() if ", trace " in line)
    assert len(traces) == 2
    for trace in traces:
        with gzip.open(trace) as f:
            assert json.load(f)["traceEvents"]  # a Chrome trace: Perfetto and chrome://tracing open it
    assert "c10d::allreduce_" in out.stdout  # the all-reduce is among each rank's top operators
    at = open_page("views/live.py", run=str(run_id))
    ran(at.run())
    assert "Profile" in [h.value for h in at.subheader]
    tables = [d.value for d in at.dataframe if "operator" in d.value.columns]
    assert len(tables) == 2 and all(len(t) > 3 for t in tables)
    assert kinds(engine, run_id).count(EventKind.PROFILE) == 2
    stop(engine, run_id)


def test_a_scripts_ranks_are_profiled_over_their_next_log_calls(engine: Engine, tmp_path: Path) -> None:
    path = script(tmp_path, body="""
        time.sleep(0.02)
        ddpdash.log({"loss": loss.item()}, step=step)
    """, steps=3000)
    run_id = launch(engine, RunConfig(script=str(path), num_procs=2), CPU_MACHINE)
    wait_for(lambda: len(_loss(engine, run_id)) >= 10, 90)
    out = subprocess.run([sys.executable, "-m", "ddpdash.cli", "--db-url", str(engine.url), "profile", str(run_id),
                          "--steps", "2", "--timeout", "60"], capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "-- rank 0: steps " in out.stdout and "-- rank 1: steps " in out.stdout
    stop(engine, run_id)


def _loss(engine: Engine, run_id: int):  # type: ignore[no-untyped-def]
    with Session(engine) as s:
        return metric_series(s, run_id, Metric.LOSS)


# ---- 5: numbers that go wrong, and telling someone -----------------------------------------------------------
class Hook:
    """A local webhook: records every POST; fails the first one, and every `always_fail` alert, on purpose."""

    def __init__(self, always_fail: str = "") -> None:
        self.bodies: list[dict] = []
        self.tries = 0
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                hook.tries += 1
                failing = hook.tries == 1 or body["event"] == always_fail
                self.send_response(500 if failing else 200)
                self.end_headers()
                if not failing:
                    hook.bodies.append(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = HTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}/hook"

    def events(self) -> list[str]:
        return [b["event"] for b in self.bodies]


@pytest.fixture
def hook() -> Iterator[Hook]:
    h = Hook(always_fail="succeeded")
    yield h
    h.server.shutdown()


def test_a_non_finite_loss_is_an_event_a_banner_and_an_alert(engine: Engine, monkeypatch: pytest.MonkeyPatch,
                                                             hook: Hook) -> None:
    from tests.test_dashboard_app import open_page, ran

    monkeypatch.setenv("DDPDASH_TEST_FAULT", "nan:1:10")  # rank 1's weight turns NaN after step 10
    run = wait_final(engine, launch(engine, tiny(max_steps=30, webhook=hook.url), CPU_MACHINE))
    assert run.status == RunStatus.SUCCEEDED  # a NaN does not stop training: the page and the alert say it
    with Session(engine) as s:
        found = events(s, run.id)
    nonfinite = found[found["kind"] == EventKind.NONFINITE]
    assert "rank 1: non-finite loss (nan) at step 11" in list(nonfinite["message"])
    assert livedata.first_nonfinite(found) == "rank 1: non-finite loss (nan) at step 11"
    at = open_page("views/live.py", run=str(run.id))
    ran(at.run())
    assert any("Numbers went wrong — rank 1: non-finite loss (nan) at step 11" in e.value for e in at.error)
    assert "nonfinite rank 1: rank 1: non-finite loss (nan) at step 11" in show(engine, run.id)
    # The alerts: the first POST failed and was retried; "succeeded" fails every try and is recorded on the run.
    wait_for(lambda: EventKind.ALERT_FAILED in kinds(engine, run.id), 60)
    assert "non-finite" in hook.events() and "succeeded" not in hook.events(), hook.events()
    body = next(b for b in hook.bodies if b["event"] == "non-finite")
    assert body["run_id"] == run.id and body["text"].startswith(f'ddpdash run #{run.id} "tiny" non-finite: rank ')
    with Session(engine) as s:
        failed = events(s, run.id).query("kind == @EventKind.ALERT_FAILED")["message"].tolist()
    assert failed == ["the succeeded alert could not be delivered: HTTP 500 Internal Server Error after 5 tries"]


def test_a_hang_and_a_lost_run_are_posted(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    h = Hook()
    try:
        monkeypatch.setenv("DDPDASH_TEST_FAULT", "stall:1:15")
        monkeypatch.setenv(alerts.WEBHOOK_ENV, h.url)  # the environment's webhook, for runs without their own
        run_id = launch(engine, tiny(max_steps=10_000, sync_check_every=0, hang_after_s=5), CPU_MACHINE)
        wait_for(lambda: "hung" in h.events(), 90)
        hung = next(b for b in h.bodies if b["event"] == "hung")
        assert "rank 1 is in time.sleep" in hung["message"] and "Flight Recorder: rank 1 never joined" in hung["text"]
        stop(engine, run_id)
        # A run whose supervisor died is lost: reconciliation, in whatever process notices, posts it.
        with Session(engine) as s, s.begin():
            lost_id = create_run(s, key="lost-one", name="gone", config_json=RunConfig().to_json(), world_size=2,
                                 host=socket.gethostname())
            update_run(s, lost_id, status=RunStatus.RUNNING, supervisor_pid=2**22 + 7, run_dir="/nowhere")
        assert lost_id in reconcile(engine)
        wait_for(lambda: "lost" in h.events(), 30)
    finally:
        h.server.shutdown()


def test_a_bad_webhook_is_refused_before_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    from ddpdash.trainer.config import ConfigInvalid

    with pytest.raises(ConfigInvalid, match="webhook must be an http:// or https:// URL"):
        prepare(tiny(webhook="ftp://example.org/x"), CPU_MACHINE)
    monkeypatch.setenv(alerts.WEBHOOK_ENV, "not a url")
    with pytest.raises(LaunchError, match="DDPDASH_WEBHOOK_URL must be one URL"):
        prepare(tiny(), CPU_MACHINE)


def test_an_alert_body_reads_as_a_chat_message() -> None:
    body = alerts.Alert(EventKind.FAILED, 7, "mlp", "rank(s) [1] failed", rank=1, at=1.0).body()
    assert body["text"] == 'ddpdash run #7 "mlp" failed: rank(s) [1] failed'
    assert {body["event"], body["kind"], body["run_id"], body["rank"]} == {"failed", 7, 1}
    assert json.loads(json.dumps(body)) == body
