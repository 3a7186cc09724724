"""Why a rank hangs: every rank's stack read with py-spy (and through faulthandler where py-spy cannot
attach), a verdict in plain words, and the Flight Recorder's finding (torch's analyser over every rank's
dump), on demand (`ddpdash stacks`, the Live page's button) and by the supervisor itself once per hang — on
a real 2-rank gloo run whose rank 1 stalls at step 20."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from ddpdash.db.queries import events, rank_states
from ddpdash.db.vocab import EventKind
from ddpdash.trainer import control
from ddpdash.trainer.control import launch
from ddpdash.trainer.stacks import Frame, RankStack, capture_run, parse_faulthandler, parse_py_spy, verdict
from tests.conftest import CPU_MACHINE, tiny, wait_for

HANG_AFTER_S = 8
WAITING_RANK_0 = "rank 0 waits in all_reduce (DDP backward, train.py:"
NEVER_JOINED = "rank 1 never joined collective #"
SLEEPING_RANK_1 = "rank 1 is in time.sleep (train.py:"


def stalled_run(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setenv("DDPDASH_TEST_FAULT", "stall:1:20")
    run_id = launch(engine, tiny(max_steps=10_000, sync_check_every=0, hang_after_s=HANG_AFTER_S), CPU_MACHINE)
    # Rank 1 stops after step 20's update, before logging it; rank 0 logs 20 and waits in step 21's backward.
    wait_for(lambda: _steps(engine, run_id) == {0: 20, 1: 19}, 90)
    time.sleep(1.0)
    return run_id


def _steps(engine: Engine, run_id: int) -> dict[int, int]:
    with Session(engine) as s:
        states = rank_states(s, run_id)
    return {int(r.rank): int(r.step) for r in states.itertuples(index=False)}


def test_the_verdict_groups_ranks_by_what_they_do() -> None:
    waiting = (Frame("c10d::Reducer::finalize_backward", "libtorch_cpu.so", 0, native=True),
               Frame("_engine_run_backward", "/x/torch/autograd/graph.py", 979),
               Frame("train_step", "/w/trainer/train.py", 342))
    sleeping = (Frame("time_sleep", "libpython3.11.so.1.0", 0, native=True),
                Frame("apply_faults", "/w/trainer/train.py", 414))
    stacks = [RankStack(r, 100 + r, "py-spy", sleeping if r == 1 else waiting) for r in range(4)]
    assert verdict(stacks) == ("ranks 0, 2, 3 wait in all_reduce (DDP backward, train.py:342); "
                               "rank 1 is in time.sleep (train.py:414)")
    assert verdict([RankStack(0, 1, "py-spy", error="ptrace: Operation not permitted")]) == \
        "rank 0 could not be read (ptrace: Operation not permitted)"


def test_faulthandlers_dump_is_read_innermost_first() -> None:
    dump = ('Thread 0x00007f1 (most recent call first):\n'
            '  File "/usr/lib/python3.11/threading.py", line 331 in wait\n\n'
            'Current thread 0x00007f2 (most recent call first):\n'
            '  File "/w/trainer/train.py", line 414 in apply_faults\n'
            '  File "/w/trainer/train.py", line 311 in train\n')
    assert parse_faulthandler(dump) == (Frame("apply_faults", "/w/trainer/train.py", 414),
                                        Frame("train", "/w/trainer/train.py", 311))


def test_py_spy_reads_a_real_process() -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time\ndef nap():\n    time.sleep(60)\nnap()"])
    try:
        time.sleep(1.0)
        ok, out = control.py_spy_dump(sleeper.pid)
        assert ok, out
        frames = parse_py_spy(out, sleeper.pid)
        names = [f.name for f in frames]
        assert "time_sleep" in names and "nap" in names and names.index("time_sleep") < names.index("nap")
        assert json.loads(out)[0]["pid"] == sleeper.pid
    finally:
        sleeper.kill()
        sleeper.wait()


@pytest.mark.slow
def test_a_stalled_rank_is_named_on_demand_and_by_itself_once_per_hang(engine: Engine,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.test_dashboard_app import open_page, ran

    run_id = stalled_run(engine, monkeypatch)
    # Once the ranks are flagged hung (no step for hang_after_s), the supervisor reads the stacks and the
    # Flight Recorder by itself, once per hang; the Live page's next refreshes show that capture.
    wait_for(lambda: _stalled_for(engine, run_id) > HANG_AFTER_S, 60, every=0.5)
    wait_for(lambda: len(_hung(engine, run_id)) == 1, 20, every=0.5)
    hung = _hung(engine, run_id)["message"].iloc[0]
    assert hung.startswith("ranks 0, 1 made no new step for ") and SLEEPING_RANK_1 in hung, hung
    assert f"Flight Recorder: {NEVER_JOINED}" in hung and "all_reduce (rank 0 waits in it)" in hung, hung
    at = open_page("views/live.py", run=str(run_id))
    for _ in range(2):
        ran(at.run())
        warnings = [w.value for w in at.warning]
        assert any(w.startswith(WAITING_RANK_0) and SLEEPING_RANK_1 in w for w in warnings), warnings
        assert any(i.value.startswith(f"Flight Recorder: {NEVER_JOINED}") for i in at.info), [i.value for i in at.info]
        assert any("no new step for" in str(v) for v in at.dataframe[0].value["flag"])
        assert len(_captures(engine, run_id)) == 1 and len(_hung(engine, run_id)) == 1
    # On demand, from the CLI: a new capture, the same verdict, each rank's frames with its own code marked.
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "ddpdash.cli", "--db-url", str(engine.url), "stacks", str(run_id)],
                         capture_output=True, text=True, timeout=60)
    took = time.monotonic() - started
    assert out.returncode == 0, out.stderr
    first, second = out.stdout.splitlines()[:2]
    assert first.startswith(WAITING_RANK_0) and SLEEPING_RANK_1 in first, out.stdout
    assert second.startswith(f"Flight Recorder: {NEVER_JOINED}"), out.stdout
    assert "-- rank 1 (pid" in out.stdout and "▶ apply_faults (train.py:" in out.stdout
    assert took < 30 and len(_captures(engine, run_id)) == 2


def _captures(engine: Engine, run_id: int):  # type: ignore[no-untyped-def]
    with Session(engine) as s:
        ev = events(s, run_id)
    return ev[ev["kind"] == EventKind.STACKS]


def _hung(engine: Engine, run_id: int):  # type: ignore[no-untyped-def]
    with Session(engine) as s:
        ev = events(s, run_id)
    return ev[ev["kind"] == EventKind.HUNG]


def _stalled_for(engine: Engine, run_id: int) -> float:
    """Seconds since the run's newest loss point."""
    from ddpdash.db.queries import metric_series

    with Session(engine) as s:
        loss = metric_series(s, run_id, "loss")
    return time.time() - float(loss["time"].max()) if len(loss) else 0.0


@pytest.mark.slow
def test_where_py_spy_cannot_attach_the_ranks_dump_their_own_threads(engine: Engine,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    run_id = stalled_run(engine, monkeypatch)
    monkeypatch.setattr(control, "py_spy_dump", lambda pid: (False, "Error: Operation not permitted (os error 1)"))
    found = capture_run(engine, run_id)
    assert [s.method for s in found.stacks] == ["faulthandler", "faulthandler"]
    assert all("py-spy could not attach (Error: Operation not permitted" in s.note for s in found.stacks)
    one = next(s for s in found.stacks if s.rank == 1)
    assert one.own_frame is not None and one.own_frame.name == "apply_faults"
    zero = next(s for s in found.stacks if s.rank == 0)
    assert "backward" in [f.name for f in zero.frames]
    assert "rank 1 is in apply_faults (train.py:" in found.verdict
