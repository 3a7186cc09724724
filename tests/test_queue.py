"""The run queue and sweeps: who starts when (plan), real runs through the queue (FIFO, cancel, move to the
front, nothing open), the lock under a race from several processes, sweeps validated whole, and the
group band and scaling study against hand-computed numbers."""

from __future__ import annotations

import itertools
import math
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from ddpdash.dashboard import history
from ddpdash.db.engine import make_engine
from ddpdash.db.queries import events
from ddpdash.db.runs import create_run, get_run, list_runs, update_run
from ddpdash.db.vocab import EventKind, RunStatus
from ddpdash.trainer.config import ConfigInvalid, RunConfig
from ddpdash.trainer.control import alive, launch, stop, stop_sweep
from ddpdash.trainer.queue import Need, admit, move_to_front, plan, waiting_states
from ddpdash.trainer.sweep import expand, launch_sweep, parse_axis
from tests.conftest import CPU_MACHINE, ROOT, tiny, wait_final, wait_for
from tests.seed import seed_run


def cpu(run_id: int, ranks: int) -> Need:
    return Need(run_id, frozenset(), ranks)


def gpu(run_id: int, *devices: int) -> Need:
    return Need(run_id, frozenset(devices), 0)


# ---- the plan -------------------------------------------------------------------------------------------
def test_a_gpu_serves_one_run_and_waiting_runs_keep_their_turn() -> None:
    p = plan(busy=[gpu(12, 1)], waiting=[gpu(20, 1), gpu(21, 0), gpu(22, 0, 1), gpu(23, 0)], slots=2)
    assert p.admit == (21,)  # GPU 0 was free; nothing ahead wanted it
    assert p.reasons[20] == "GPU 1 is used by run #12"
    assert p.reasons[22] == "GPU 0 is used by run #21; GPU 1 is used by run #12"  # 21 took GPU 0 just now
    assert p.reasons[23] == "GPU 0 is used by run #21"
    later = plan(busy=[gpu(12, 1)], waiting=[gpu(22, 0, 1), gpu(23, 0)], slots=2)
    assert later.admit == () and later.reasons[23] == "waits behind run #22 for GPU 0"  # 22 keeps its turn
    assert p.positions == {20: 1, 22: 2, 23: 3}


def test_cpu_slots_are_shared_first_in_first_out() -> None:
    p = plan(busy=[cpu(5, 1)], waiting=[cpu(6, 1), cpu(7, 2), cpu(8, 1)], slots=2)
    assert p.admit == (6,)
    assert p.reasons[7] == "needs 2 CPU slot(s); 2 of 2 are used by run(s) #5, #6"
    assert p.reasons[8] == "waits behind run #7 for CPU slots"  # a small run never overtakes a waiting one
    assert plan([], [cpu(1, 1), cpu(2, 1), cpu(3, 1)], slots=2).admit == (1, 2)


def test_a_run_larger_than_the_machine_starts_only_when_nothing_else_runs() -> None:
    waiting = plan(busy=[gpu(3, 0)], waiting=[cpu(4, 4)], slots=2)
    assert waiting.admit == () and "more than this machine's 2 slots: it starts when nothing else runs" in \
        waiting.reasons[4]
    alone = plan(busy=[], waiting=[cpu(4, 4), cpu(5, 1)], slots=2)
    assert alone.admit == (4,) and "used by run(s) #4" in alone.reasons[5]


# ---- real runs through the queue ---------------------------------------------------------------------------
@pytest.mark.slow
def test_fifo_cancel_and_front_with_real_runs(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DDPDASH_CPU_SLOTS", "2")
    first = launch(engine, tiny(name="first", max_steps=200), CPU_MACHINE)  # 2 ranks: the whole machine
    second, third, fourth = (launch(engine, tiny(name=n, max_steps=5), CPU_MACHINE) for n in ("b", "c", "d"))
    with Session(engine) as s:
        states = waiting_states(s)
    assert [states[i][0] for i in (second, third, fourth)] == [1, 2, 3]
    assert states[second][1] == f"needs 2 CPU slot(s); 2 of 2 are used by run(s) #{first}"
    assert move_to_front(engine, fourth)
    assert stop(engine, third) == RunStatus.CANCELLED  # Stop of a waiting run cancels it: nothing ran
    with Session(engine) as s:
        assert [k for k, _ in sorted(waiting_states(s).items(), key=lambda kv: kv[1][0])] == [fourth, second]
        assert get_run(s, third).status == RunStatus.CANCELLED and get_run(s, third).supervisor_pid is None
    runs = {i: wait_final(engine, i, timeout=240) for i in (first, second, fourth)}
    assert {r.status for r in runs.values()} == {RunStatus.SUCCEEDED}
    # The one moved to the front started before the one it overtook, and only after the first had ended.
    assert runs[first].ended_at <= runs[fourth].admitted_at <= runs[second].admitted_at
    with Session(engine) as s:
        kinds = events(s, second)["kind"].tolist()
    assert kinds[:2] == [EventKind.QUEUED, EventKind.ADMITTED]


@pytest.mark.slow
def test_queued_runs_start_by_themselves_with_nothing_open(home: Path, db_url: str) -> None:
    """The CLI queues three runs and exits; no dashboard, no CLI: each supervisor hands the machine on."""
    env = {**os.environ, "DDPDASH_HOME": str(home), "DDPDASH_CPU_SLOTS": "2"}
    out = subprocess.run([sys.executable, "-m", "ddpdash.cli", "sweep", "--grid", "max_steps=10,11,12",
                          "--num-procs", "2", "--width", "16", "--batch-size", "16", "--sweep-name", "alone"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("sweep alone: 3 run(s) queued")
    engine = make_engine(db_url)  # only reads: no reconcile, no dispatch from the test
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        with Session(engine) as s:
            runs = list_runs(s)
        if all(r.status in RunStatus.FINAL for r in runs):
            break
        time.sleep(0.5)
    assert [r.status for r in runs] == [RunStatus.SUCCEEDED] * 3
    ordered = sorted(runs, key=lambda r: r.id)
    for before, after in itertools.pairwise(ordered):
        assert before.ended_at <= after.admitted_at  # one at a time: 2 ranks each on 2 slots
    engine.dispose()


def _admit_in_a_process(db_url: str, rounds: int) -> list[int]:
    engine = make_engine(db_url)
    got = []
    for _ in range(rounds):
        got += admit(engine)
    engine.dispose()
    return got


def test_racing_processes_never_admit_two_runs_onto_one_gpu(engine: Engine, db_url: str) -> None:
    """Five processes decide at once over ten runs that all want GPU 0 or GPU 1: the lock lets exactly one
    run per GPU in. (The decision alone: no GPU here to start them on.)"""
    with Session(engine) as s, s.begin():
        ids = [create_run(s, key=f"race-{i}", name=f"race-{i}", world_size=1, admitted=False, run_dir="queued",
                          host=__import__("socket").gethostname(),
                          config_json=RunConfig(devices=(i % 2,)).to_json()) for i in range(10)]
    with multiprocessing.get_context("spawn").Pool(5) as pool:
        admitted = list(itertools.chain.from_iterable(pool.starmap(_admit_in_a_process, [(db_url, 20)] * 5)))
    assert sorted(admitted) == ids[:2]  # the first in line for each GPU, once
    with Session(engine) as s:
        assert [get_run(s, i).admitted_at is not None for i in ids] == [True, True] + [False] * 8
        for run_id in ids:  # leave nothing for the engine fixture to stop
            update_run(s, run_id, status=RunStatus.CANCELLED)
        s.commit()


@pytest.mark.slow
def test_six_runs_from_several_processes_onto_two_slots(home: Path, db_url: str) -> None:
    env = {**os.environ, "DDPDASH_HOME": str(home), "DDPDASH_CPU_SLOTS": "2"}
    argv = [sys.executable, "-m", "ddpdash.cli", "launch", "--num-procs", "1", "--width", "16", "--depth", "1",
            "--batch-size", "16", "--max-steps", "8", "--checkpoint-every", "0"]
    launchers = [subprocess.Popen([*argv, "--name", f"race-{i}"], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for i in range(6)]
    for p in launchers:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    engine = make_engine(db_url)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        with Session(engine) as s:
            runs = list_runs(s)
        if len(runs) == 6 and all(r.status in RunStatus.FINAL for r in runs):
            break
        time.sleep(0.5)
    assert [r.status for r in runs] == [RunStatus.SUCCEEDED] * 6, [(r.id, r.status, r.error[:200]) for r in runs]
    moments = sorted([(r.admitted_at, 1) for r in runs] + [(r.ended_at, -1) for r in runs])
    running = most = 0
    for _, change in moments:
        running += change
        most = max(most, running)
    assert most <= 2  # never more than the two slots' worth at once
    engine.dispose()


# ---- sweeps -------------------------------------------------------------------------------------------------
def test_a_grid_expands_over_settings_parameters_and_script_arguments() -> None:
    base = RunConfig(name="g", params=("width=8",), script_args=("--lr", "0.1"))
    axes = [parse_axis("num_procs=1,2"), parse_axis("param.width=16,32"), parse_axis("arg.--lr=0.2")]
    runs = expand(base, axes, seeds=2, sweep="s")
    assert len(runs) == 8
    first = runs[0].config
    assert (first.num_procs, first.parameters["width"], first.script_args, first.seed) == (1, 16, ("--lr", "0.2"), 0)
    assert runs[1].config.seed == 1
    assert runs[1].config.group == runs[0].config.group == "s num_procs=1 width=16 --lr=0.2"
    assert parse_axis("devices=0;0,1").values == ((0,), (0, 1))
    with pytest.raises(ConfigInvalid, match="batch_size must be a whole number"):
        parse_axis("batch_size=32,big")
    with pytest.raises(ConfigInvalid, match="seed is set by the sweep itself: use --seeds N"):
        parse_axis("seed=1,2")
    with pytest.raises(ConfigInvalid, match="nosuch is not a setting"):
        parse_axis("nosuch=1")


def test_one_bad_combination_is_named_and_nothing_is_queued(engine: Engine) -> None:
    with pytest.raises(ConfigInvalid) as caught:
        launch_sweep(engine, tiny(name="bad"), [parse_axis("num_procs=1,64"), parse_axis("batch_size=8,16")], 1,
                     CPU_MACHINE, "bad-sweep")
    [error] = caught.value.errors
    assert error.field == "num_procs" and "in run 3 of 4 (num_procs=64 batch_size=8)" in error.message
    with Session(engine) as s:
        assert list_runs(s) == []


@pytest.mark.slow
def test_a_two_by_two_sweep_of_real_runs_goes_through_the_queue(engine: Engine,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DDPDASH_CPU_SLOTS", "2")
    name, ids = launch_sweep(engine, tiny(name="grid", max_steps=12), [parse_axis("num_procs=1,2"),
                             parse_axis("batch_size=8,16")], 1, CPU_MACHINE, "two-by-two")
    assert len(ids) == 4
    runs = [wait_final(engine, i, timeout=300) for i in ids]
    assert [r.status for r in runs] == [RunStatus.SUCCEEDED] * 4
    assert {r.sweep for r in runs} == {"two-by-two"}
    assert [r.group_name for r in runs] == [f"two-by-two num_procs={n} batch_size={b}" for n in (1, 2) for b in (8, 16)]
    with Session(engine) as s:
        comp = history.load_sweep(s, name)
    study = history.scaling_study(comp)
    assert sorted(study["world_size"].tolist()) == [1, 1, 2, 2] and study["efficiency"].notna().all()
    table = history.sweep_table(comp)
    assert {"num_procs", "batch_size", "final_loss", "samples_per_s"} <= set(table.columns)
    frame = history.runs_frame(Session(engine))
    assert history.filter_runs(frame, history.RunFilter(sweep="two-by-two"))["id"].tolist() == ids[::-1]
    assert stop_sweep(engine, name) == {i: RunStatus.SUCCEEDED for i in ids}  # ended: stop changes nothing


@pytest.mark.slow
def test_stop_a_sweep_cancels_the_queued_and_stops_the_running(engine: Engine,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DDPDASH_CPU_SLOTS", "2")
    monkeypatch.setenv("DDPDASH_TEST_FAULT", "sleep:0:0.05")  # long enough to be running when stopped
    _, ids = launch_sweep(engine, tiny(name="long", max_steps=2000), [parse_axis("width=8,16,24")], 1, CPU_MACHINE,
                          "to-stop")
    wait_for(lambda: get_status(engine, ids[0]) == RunStatus.RUNNING, timeout=60)
    statuses = stop_sweep(engine, "to-stop")
    assert statuses == {ids[0]: RunStatus.STOPPED, ids[1]: RunStatus.CANCELLED, ids[2]: RunStatus.CANCELLED}
    with Session(engine) as s:
        run = get_run(s, ids[0])
    # The workers are gone before the status is written; the supervisor exits right after writing it.
    assert wait_for(lambda: not any(alive(p) for p in (run.supervisor_pid, run.torchrun_pid, *run.worker_pids)), 10)


def get_status(engine: Engine, run_id: int) -> str:
    with Session(engine) as s:
        return get_run(s, run_id).status


# ---- groups and the scaling study, on known numbers ----------------------------------------------------------
def _grouped(engine: Engine, cfg: RunConfig, group: str, sweep: str, **kw: object) -> int:
    run_id = seed_run(engine, cfg, **kw)  # type: ignore[arg-type]
    with Session(engine) as s, s.begin():
        update_run(s, run_id, group_name=group, sweep=sweep)
    return run_id


def test_a_groups_band_is_the_mean_and_spread_across_its_runs(engine: Engine) -> None:
    base = RunConfig(name="g", num_procs=1)
    ids = [_grouped(engine, base.replace(seed=i), "g width=64", "sw", steps=40, loss_scale=scale)
           for i, scale in enumerate((1.0, 2.0, 3.0))]
    with Session(engine) as s:
        comp = history.load_sweep(s, "sw")
    assert [r.id for r in comp.runs] == ids
    minmax = history.group_frame(comp, "step", "minmax").set_index("x")
    std = history.group_frame(comp, "step", "std").set_index("x")
    loss_at_10 = 2.0 * math.exp(-10 / 10) + 0.1  # seed_run's loss at step 10 of 40, rank 0, scale 1
    assert minmax.loc[10.0, "value"] == pytest.approx(2 * loss_at_10)  # mean of 1×, 2×, 3×
    assert minmax.loc[10.0, "lo"] == pytest.approx(loss_at_10)
    assert minmax.loc[10.0, "hi"] == pytest.approx(3 * loss_at_10)
    spread = loss_at_10 * math.sqrt(2 / 3)  # population std of 1, 2, 3 is sqrt(2/3)
    assert (std.loc[10.0, "lo"], std.loc[10.0, "hi"]) == (pytest.approx(2 * loss_at_10 - spread),
                                                          pytest.approx(2 * loss_at_10 + spread))
    assert set(minmax["runs"]) == {3} and set(minmax["series"]) == {"g width=64"}  # the sweep "sw" is not in it


def test_the_scaling_study_on_known_numbers(engine: Engine) -> None:
    base = RunConfig(name="scale", batch_size=32, lr=0.05)
    for world, per_rank in ((1, 1000.0), (2, 900.0), (4, 800.0)):
        for seed in (0, 1):
            _grouped(engine, base.replace(num_procs=world, seed=seed), f"scale num_procs={world}", "scaling",
                     steps=40, speed_per_rank=per_rank + 10 * seed)  # seeds differ a little: their mean counts
    with Session(engine) as s:
        study = history.scaling_study(history.load_sweep(s, "scaling"), target_loss=1.0).set_index("world_size")
    assert study.loc[1, "samples_per_s"] == pytest.approx(1005.0)
    assert study.loc[4, "samples_per_s"] == pytest.approx(4 * 805.0)
    assert study.loc[4, "ideal_samples_per_s"] == pytest.approx(4 * 1005.0)
    assert study.loc[2, "efficiency"] == pytest.approx(905.0 / 1005.0)
    assert study.loc[4, "efficiency"] == pytest.approx(805.0 / 1005.0)
    assert study.loc[4, "global_batch"] == 128 and study.loc[4, "effective_lr"] == pytest.approx(0.2)
    assert set(study["runs"]) == {2}
    # seed_run's loss, mean over ranks: 2·e^(-step/10) + 0.1 + 0.005·(ranks − 1), logged every 0.01 s. It
    # reaches 1.0 at step 8 with one rank (e^(-0.8) = 0.449 ≤ 0.45) and at step 9 with two (0.4475 needed).
    assert study.loc[1, "samples_to_target"] == 8 * 32 and study.loc[2, "samples_to_target"] == 9 * 64
    assert study.loc[1, "time_to_target_s"] == pytest.approx(0.08)


def test_the_readme_and_cli_know_the_queue_and_sweeps() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "ddpdash sweep --grid" in readme and "ddpdash queue" in readme


def test_the_forms_sweep_section_counts_the_runs_before_launch(engine: Engine) -> None:
    from tests.test_dashboard_app import open_page, ran

    at = open_page("views/new_run.py")
    ran(at.text_area(key="_sweep_grid").input("num_procs=1,2\nbatch_size=16,32").run())
    ran(at.number_input(key="_sweep_seeds").set_value(3).run())
    assert any(c.value.startswith("12 run(s): 2 num_procs × 2 batch_size × 3 seeds") for c in at.caption)
    ran(at.text_area(key="_sweep_grid").input("batch_size=16,huge").run())
    assert "batch_size must be a whole number, got 'huge'" in [e.value for e in at.error]
    with Session(engine) as s:
        assert list_runs(s) == []  # counting launches nothing


def test_compare_draws_one_line_per_group(engine: Engine) -> None:
    from tests.test_dashboard_app import chart_rows, open_page, ran

    base = RunConfig(name="c", num_procs=1)
    ids = [_grouped(engine, base.replace(seed=i % 2), f"lr={lr}", "", steps=30, loss_scale=scale)
           for i, (lr, scale) in enumerate([(0.1, 1.0), (0.1, 1.2), (0.2, 0.5), (0.2, 0.7)])]
    at = open_page("views/compare.py", runs=",".join(map(str, ids)))
    ran(at.radio[0].set_value("each group, band across runs").run())
    rows = chart_rows(at)[0]
    assert {r["series"] for r in rows} == {"lr=0.1", "lr=0.2"}
    at_10 = {r["series"]: r for r in rows if r["x"] == 10.0}
    assert at_10["lr=0.2"]["value"] == pytest.approx(0.6 * (2.0 * math.exp(-10 / 7.5) + 0.1))


def test_a_run_folder_that_cannot_be_written_fails_the_run_instead_of_queueing_it(engine: Engine,
                                                                                  home: Path) -> None:
    from ddpdash.trainer.control import LaunchError

    home.mkdir(parents=True, exist_ok=True)
    (home / "runs").write_text("a file where the runs' folder should be")
    with pytest.raises(LaunchError, match="could not write the run folder"):
        launch(engine, tiny(), CPU_MACHINE)
    with Session(engine) as s:
        [run] = list_runs(s)
    assert run.status == RunStatus.FAILED and "could not write the run folder" in run.error


def test_a_run_being_queued_is_not_admitted_before_its_folder_is_written(engine: Engine) -> None:
    """The race a sequence of launches found: a run ending elsewhere dispatched while a new run's row existed but
    its folder and environment were not yet written, and its supervisor could not start."""
    with Session(engine) as s, s.begin():
        half = create_run(s, key="half", name="half", world_size=1, admitted=False,
                          host=__import__("socket").gethostname(), config_json=RunConfig(num_procs=1).to_json())
    assert admit(engine) == []  # no folder recorded yet: not in line
    with Session(engine) as s:
        assert waiting_states(s) == {} and get_run(s, half).status == RunStatus.QUEUED
        from ddpdash.trainer.control import reconcile
    assert reconcile(engine, now=time.time() + 3600) == [half]  # a launcher that died half-way: lost, in time
    with Session(engine) as s:
        assert "never fully queued" in get_run(s, half).error
