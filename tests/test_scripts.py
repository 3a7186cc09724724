"""Your own torchrun script: the `ddpdash` API (log, should_stop, event, init) in real ranks, launched
from the CLI and started by hand, and every way a script misbehaves (2 tiny gloo ranks)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from ddpdash.db.queries import events, metric_series, rank_states
from ddpdash.db.runs import get_run, list_runs
from ddpdash.db.vocab import EventKind, RunStatus
from ddpdash.trainer.config import ConfigInvalid, RunConfig, check_script
from ddpdash.trainer.control import alive, launch, stop
from tests.conftest import CPU_MACHINE, ROOT, wait_final, wait_for

pytestmark = pytest.mark.slow
EXAMPLE = ROOT / "examples" / "seed_script.py"

# A tiny DDP loop a test's script wraps: `BODY` runs each step with `step`, `rank` and `loss` defined.
TEMPLATE = '''
import os, signal, sys, time
import torch, torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
import ddpdash

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(64, 4), torch.randn(64, 1)
{setup}
for step in range(1, {steps} + 1):
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
{body}
del model, opt, loss
import gc; gc.collect()  # release DDP before tearing the group down: gloo can abort at exit otherwise (NOTES)
dist.destroy_process_group()
'''


def script(folder: Path, body: str, steps: int = 20, setup: str = "", name: str = "train.py") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(TEMPLATE.format(steps=steps, setup=setup, body=textwrap.indent(textwrap.dedent(body), "    ")))
    return path


LOG_LOSS = 'ddpdash.log({"loss": loss.item()}, step=step, samples=64)\n'


def by_hand(path: Path, db_url: str, *args: str, env: dict[str, str] | None = None,
            cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "DDPDASH_DB_URL": db_url, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(path), *args], env=full, cwd=cwd or path.parent, capture_output=True, text=True,
                          timeout=180)


def steps_of(engine: Engine, run_id: int, metric: str = "loss") -> dict[int, list[int]]:
    with Session(engine) as s:
        frame = metric_series(s, run_id, metric, max_points=100_000)
    return {int(r): sorted(g["step"].tolist()) for r, g in frame.groupby("rank")}


def only_run(engine: Engine):  # type: ignore[no-untyped-def]
    with Session(engine) as s:
        [run] = list_runs(s)
    return run


# ---- the example, both ways -------------------------------------------------------------------------
def test_the_example_script_launched_from_the_cli(engine: Engine, home: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "DDPDASH_DB_URL"}
    out = subprocess.run([sys.executable, "-m", "ddpdash.cli", "launch", "--script", str(EXAMPLE), "--num-procs", "2",
                          "--wait", "--", "--epochs", "2"], env={**env, "DDPDASH_HOME": str(home)}, cwd=ROOT,
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    run = only_run(engine)
    assert run.status == RunStatus.SUCCEEDED and run.name == "seed_script"
    assert run.config["script"] == str(EXAMPLE) and run.config["script_args"] == ["--epochs", "2"]
    assert len(run.config["code_sha256"]) == 64
    per_rank = steps_of(engine, run.id)
    assert per_rank == {0: list(range(1, 65)), 1: list(range(1, 65))}  # 2048 samples / 2 ranks / 32, twice
    with Session(engine) as s:
        loss = metric_series(s, run.id, "loss", max_points=100_000)
        assert not metric_series(s, run.id, "samples_per_s").empty
    for _, series in loss.groupby("rank"):
        assert series["value"].iloc[-5:].mean() < series["value"].iloc[:5].mean() / 10  # it learns


def test_the_example_script_started_by_hand(engine: Engine, db_url: str) -> None:
    out = by_hand(EXAMPLE, db_url, "--epochs", "2")
    assert out.returncode == 0, out.stderr[-2000:]
    run = only_run(engine)
    assert run.status == RunStatus.SUCCEEDED and run.name == "seed_script"
    assert steps_of(engine, run.id) == {0: list(range(1, 65)), 1: list(range(1, 65))}


# ---- what scripts do --------------------------------------------------------------------------------
def test_a_rank_that_raises_is_named_with_its_traceback(engine: Engine, tmp_path: Path) -> None:
    path = script(tmp_path / "fails",
                  LOG_LOSS + 'if rank == 1 and step == 5:\n    raise ValueError("bad batch on rank 1")\n')
    run = wait_final(engine, launch(engine, RunConfig(script=str(path), num_procs=2), CPU_MACHINE), 120)
    assert run.status == RunStatus.FAILED and run.failed_ranks == (1,), (run.failed_ranks, run.error)
    assert "ValueError: bad batch on rank 1" in run.error and "train.py" in run.error  # the user's own traceback


def test_a_script_that_ignores_sigterm_is_killed_after_the_grace_and_leaves_nothing(engine: Engine,
                                                                                   tmp_path: Path) -> None:
    path = script(tmp_path / "stubborn", LOG_LOSS + "time.sleep(0.05)\n", steps=100_000,
                  setup="signal.signal(signal.SIGTERM, signal.SIG_IGN)")
    run_id = launch(engine, RunConfig(script=str(path), num_procs=2), CPU_MACHINE)
    wait_for(lambda: len(steps_of(engine, run_id)) == 2, 90)
    started = time.monotonic()
    assert stop(engine, run_id) == RunStatus.STOPPED
    assert time.monotonic() - started <= 10
    with Session(engine) as s:
        run = get_run(s, run_id)
    wait_for(lambda: not any(alive(p) for p in (run.supervisor_pid, run.torchrun_pid, *run.worker_pids)), 5)


def test_should_stop_turns_the_stop_button_into_a_clean_exit(engine: Engine, tmp_path: Path) -> None:
    path = script(tmp_path / "polite", LOG_LOSS + "time.sleep(0.02)\nif ddpdash.should_stop():\n    break\n",
                  steps=100_000)
    run_id = launch(engine, RunConfig(script=str(path), num_procs=2), CPU_MACHINE)
    wait_for(lambda: len(steps_of(engine, run_id)) == 2, 90)
    assert stop(engine, run_id) == RunStatus.STOPPED
    with Session(engine) as s:
        assert set(rank_states(s, run_id)["status"]) == {"stopped"}  # each rank said so itself


def test_a_rank_whose_peer_left_first_during_a_stop_is_stopped_not_failed(engine: Engine, tmp_path: Path) -> None:
    # Ranks see the SIGTERM a step apart at times: here rank 1 always takes one more step, so its
    # all-reduce breaks on the peer that left. That is the stop, not a failure.
    body = LOG_LOSS + ("time.sleep(0.02)\nif ddpdash.should_stop():\n    if rank == 1 and not late:\n"
                       "        late = True\n        continue\n    break\n")
    path = script(tmp_path / "late", body, steps=100_000, setup="late = False")
    run_id = launch(engine, RunConfig(script=str(path), num_procs=2), CPU_MACHINE)
    wait_for(lambda: len(steps_of(engine, run_id)) == 2, 90)
    assert stop(engine, run_id) == RunStatus.STOPPED
    with Session(engine) as s:
        assert set(rank_states(s, run_id)["status"]) == {"stopped"}
    assert EventKind.RANK_FAILED not in events_kinds(engine, run_id)


def test_ranks_may_log_different_keys(engine: Engine, db_url: str, tmp_path: Path) -> None:
    path = script(tmp_path / "keys", 'ddpdash.log({"loss": loss.item()} if rank == 0 else {"acc": 0.5}, step=step)\n')
    assert by_hand(path, db_url).returncode == 0
    run = only_run(engine)
    assert steps_of(engine, run.id, "loss") == {0: list(range(1, 21))}
    assert steps_of(engine, run.id, "acc") == {1: list(range(1, 21))}


def test_a_script_that_never_logs_still_gets_status_logs_and_the_three_lines(engine: Engine, tmp_path: Path) -> None:
    path = tmp_path / "quiet" / "plain.py"
    path.parent.mkdir()
    path.write_text(TEMPLATE.replace("import ddpdash\n", "").format(steps=5, setup="", body="    pass\n")
                    + "print('trained without ddpdash', flush=True)\n")
    run = wait_final(engine, launch(engine, RunConfig(script=str(path), num_procs=2), CPU_MACHINE), 120)
    assert run.status == RunStatus.SUCCEEDED
    from ddpdash.trainer.rundir import RunDir

    log = RunDir(Path(run.run_dir)).rank_log(0, "stdout")
    assert log is not None and "trained without ddpdash" in log.read_text()
    from tests.test_dashboard_app import open_page

    at = open_page(run=str(run.id))
    assert any("logged no metrics" in i.value for i in at.info)
    assert any("ddpdash.log(" in c.value for c in at.code)


def test_modules_named_like_ddpdashs_packages_in_the_script_folder_shadow_nothing(engine: Engine, db_url: str,
                                                                                 tmp_path: Path) -> None:
    folder = tmp_path / "decoys"
    path = script(folder, LOG_LOSS)
    for name in ("trainer.py", "db.py", "dashboard.py"):
        (folder / name).write_text("raise RuntimeError('the user module was imported instead of ddpdash')\n")
    out = by_hand(path, db_url)
    assert out.returncode == 0, out.stderr[-2000:]
    assert steps_of(engine, only_run(engine).id) == {0: list(range(1, 21)), 1: list(range(1, 21))}


def test_non_finite_and_non_numeric_values_are_dropped_with_a_warning(engine: Engine, db_url: str,
                                                                      tmp_path: Path) -> None:
    path = script(tmp_path / "odd", 'ddpdash.log({"loss": float("nan"), "acc": 0.5, "note": "x", "inf": 1e999}, '
                                    'step=step)\n')
    out = by_hand(path, db_url)
    assert out.returncode == 0, out.stderr[-2000:]
    run = only_run(engine)
    assert steps_of(engine, run.id, "acc") == {0: list(range(1, 21)), 1: list(range(1, 21))}
    assert steps_of(engine, run.id, "loss") == {} and steps_of(engine, run.id, "note") == {}
    assert "'loss' is nan: dropped" in out.stderr and "'note' is not a number (str): dropped" in out.stderr


def test_ddpdash_disabled_makes_every_call_a_no_op(engine: Engine, db_url: str, tmp_path: Path) -> None:
    path = script(tmp_path / "off", LOG_LOSS + 'ddpdash.event("note", "hi")\nassert not ddpdash.should_stop()\n'
                  'assert not ddpdash.init().enabled\n')
    out = by_hand(path, db_url, env={"DDPDASH_DISABLED": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    with Session(engine) as s:
        assert list_runs(s) == []


def test_init_returns_the_forms_settings(engine: Engine, tmp_path: Path) -> None:
    path = script(tmp_path / "settings", 'if step == 1:\n    s = ddpdash.init()\n'
                  '    ddpdash.event("note", f"{s.batch_size} {s.effective_lr:g} {s.world_size} {s.run_id} "\n'
                  '                  f"{os.environ[\'DDPDASH_BATCH_SIZE\']} {sorted(s.params.items())}")\n' + LOG_LOSS)
    params = ("width=128", "use_bn=true", "tag=baseline", "dropout=0.1")
    run_id = launch(engine, RunConfig(script=str(path), num_procs=2, batch_size=48, lr=0.1, params=params),
                    CPU_MACHINE)
    assert wait_final(engine, run_id, 120).status == RunStatus.SUCCEEDED
    with Session(engine) as s:
        notes = events(s, run_id)
    typed = [("dropout", 0.1), ("tag", "baseline"), ("use_bn", True), ("width", 128)]
    assert set(notes[notes["kind"] == "note"]["message"]) == {f"48 0.2 2 {run_id} 48 {typed}"}


def test_parameters_round_trip_through_the_cli_and_refuse_a_bad_one() -> None:
    from ddpdash.cli import build_parser, config_from_args
    from ddpdash.trainer.commands import cli_command

    args = build_parser().parse_args(["launch", "--script", str(EXAMPLE), "--param", "width=128", "--param",
                                      "lr_decay=0.5", "--", "--epochs", "3"])
    cfg = config_from_args(args)
    assert cfg.params == ("width=128", "lr_decay=0.5") and cfg.parameters == {"width": 128, "lr_decay": 0.5}
    assert cfg.script_args == ("--epochs", "3")
    again = config_from_args(build_parser().parse_args(cli_command(cfg)[1:]))  # "Same run from a terminal"
    assert again == cfg
    from ddpdash.trainer.config import validate

    [error] = [e for e in validate(RunConfig(params=("no equals sign",)), CPU_MACHINE) if e.field == "params"]
    assert "key=value" in error.message


# ---- refused before launch ---------------------------------------------------------------------------
def test_a_script_that_is_not_there_is_refused_before_anything_is_written(engine: Engine, home: Path,
                                                                          tmp_path: Path) -> None:
    for cfg, field, message in [
        (RunConfig(script=str(tmp_path / "missing.py")), "script", "is not a file"),
        (RunConfig(script=str(EXAMPLE), workdir=str(tmp_path / "nowhere")), "workdir", "is not a folder"),
        (RunConfig(module="no_such_module_here", workdir=str(tmp_path)), "module", "cannot be found"),
    ]:
        [error] = check_script(cfg)
        assert error.field == field and message in error.message
        with pytest.raises(ConfigInvalid, match=message):
            launch(engine, cfg, CPU_MACHINE)
    with pytest.raises(ConfigInvalid, match="NUL"):
        RunConfig.from_dict({"script": str(EXAMPLE), "script_args": ["a\x00b"]})
    with Session(engine) as s:
        assert list_runs(s) == []
    assert not (home / "runs").exists()


def test_a_module_is_found_from_the_working_folder(engine: Engine, tmp_path: Path) -> None:
    package = tmp_path / "proj" / "mypkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    script(package, LOG_LOSS, name="train.py")
    run_id = launch(engine, RunConfig(module="mypkg.train", workdir=str(tmp_path / "proj"), num_procs=2), CPU_MACHINE)
    run = wait_final(engine, run_id, 120)
    assert run.status == RunStatus.SUCCEEDED, run.error
    assert steps_of(engine, run_id) == {0: list(range(1, 21)), 1: list(range(1, 21))}
    assert EventKind.FAILED not in events_kinds(engine, run_id)


def events_kinds(engine: Engine, run_id: int) -> list[str]:
    with Session(engine) as s:
        return events(s, run_id)["kind"].tolist()
