"""Slurm as a launch target, against a real Slurm cluster started on this host (tests/slurm_cluster.py: two
slurmd "nodes"), and the pure parts: the job script, Slurm's states in ddpdash's words, what may be handed
to sbatch, and the network-file-system guard."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from ddpdash.cli import main
from ddpdash.db.migrate import open_store
from ddpdash.db.queries import metric_series
from ddpdash.db.runs import events_of_kind, get_run, list_runs
from ddpdash.db.vocab import EventKind, RunStatus
from ddpdash.trainer import slurm
from ddpdash.trainer.config import ConfigInvalid, RunConfig
from ddpdash.trainer.control import cancel_slurm_job, launch, reconcile, stop
from ddpdash.trainer.rundir import RunDir
from ddpdash.trainer.supervisor.node import SlurmNode
from tests import slurm_cluster
from tests.conftest import CPU_MACHINE, tiny, wait_final, wait_for
from tests.pg import postgres_server


@pytest.fixture(scope="module")
def cluster() -> Iterator[dict[str, str]]:
    why = slurm_cluster.available()
    if why:
        if os.environ.get("CI"):
            pytest.fail(f"{why}: .ci/run installs slurm-wlm and munge")
        pytest.skip(f"{why}; CI installs it and runs these tests")
    was_running = slurm_cluster.running()
    env = slurm_cluster.start()
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    yield env
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    if not was_running:
        slurm_cluster.stop()  # only what these tests started


@pytest.fixture
def slurm_engine(cluster: dict[str, str], engine: Engine) -> Engine:
    return engine


def on_slurm(**changes: object) -> RunConfig:
    return tiny(launcher="slurm", partition=slurm_cluster.PARTITION, **changes)  # type: ignore[arg-type]


def ddpdash_processes(run_dir: str) -> list[psutil.Process]:
    """Every process of this run still alive anywhere on this host (all the cluster's nodes are here)."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if run_dir in " ".join(p.info["cmdline"] or []) or p.environ().get("DDPDASH_RUN_DIR") == run_dir:
                found.append(p)
        except psutil.Error:
            continue
    return found


def job_gone_or_final(job_id: str) -> bool:
    out = subprocess.run(["squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T"], capture_output=True, text=True)
    state = out.stdout.strip()
    return not state or state in slurm.FINAL_STATES


# ---- real jobs -------------------------------------------------------------------------------------------
def test_one_node_two_ranks_with_sqlite(slurm_engine: Engine) -> None:
    run_id = launch(slurm_engine, on_slurm(num_procs=2), CPU_MACHINE)
    run = wait_final(slurm_engine, run_id, timeout=120)
    assert run.status == RunStatus.SUCCEEDED, run.error
    assert run.host == slurm.HOST and run.job_id.isdecimal()
    with Session(slurm_engine) as s:
        losses = metric_series(s, run_id, "loss")
    assert sorted(losses["rank"].unique()) == [0, 1]
    folder = RunDir(Path(run.run_dir))
    script = folder.job_script.read_text()
    assert "#SBATCH --nodes=1" in script and "#SBATCH --cpus-per-task=2" in script and "--slurm" in script
    assert folder.slurm_output_of(run.job_id).exists()
    assert folder.rank_log(1) is not None and "node0-rank0" in str(folder.rank_log(1))
    wait_for(lambda: not ddpdash_processes(run.run_dir), timeout=15)


def test_two_nodes_one_rank_each_write_one_run_in_postgres(cluster: dict[str, str], home: Path) -> None:
    with postgres_server() as url:
        engine = open_store(url)
        try:
            run_id = launch(engine, on_slurm(nodes=2, num_procs=1, max_steps=40), CPU_MACHINE)
            # Live: both nodes' ranks appear in the one run while it trains.
            wait_for(lambda: _ranks_logging(engine, run_id) == [0, 1], timeout=90)
            run = wait_final(engine, run_id, timeout=120)
            assert run.status == RunStatus.SUCCEEDED, run.error
            assert run.world_size == 2
            folder = RunDir(Path(run.run_dir))
            assert "node1-rank1" in str(folder.rank_log(1))  # rank 1's log is the second node's
            with Session(engine) as s:
                launched = [e.message for e in events_of_kind(s, run_id, EventKind.LAUNCHED)]
            assert sorted(m.split(":")[0] for m in launched) == ["node 0 (" + os.uname().nodename + ")",
                                                                 "node 1 (" + os.uname().nodename + ")"]
            wait_for(lambda: job_gone_or_final(run.job_id), timeout=30)  # both nodes' supervisors are done
            assert not ddpdash_processes(run.run_dir)
        finally:
            engine.dispose()


def test_a_rank_failing_on_the_second_node_is_named_not_its_peer_on_the_first(
        cluster: dict[str, str], home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DDPDASH_TEST_FAULT", "raise:1:5")  # rank 1 is node 1's; rank 0 only loses its peer
    with postgres_server() as url:
        engine = open_store(url)
        try:
            run_id = launch(engine, on_slurm(nodes=2, num_procs=1), CPU_MACHINE)
            run = wait_final(engine, run_id, timeout=120)
            assert run.status == RunStatus.FAILED
            assert run.failed_ranks == (1,), run.error
            assert run.error.startswith("rank 1:") and "Traceback" in run.error, run.error
            wait_for(lambda: job_gone_or_final(run.job_id), timeout=30)
        finally:
            engine.dispose()


def _ranks_logging(engine: Engine, run_id: int) -> list[int]:
    with Session(engine) as s:
        losses = metric_series(s, run_id, "loss")
    return sorted(int(r) for r in losses["rank"].unique()) if not losses.empty else []


def test_a_job_waits_with_slurms_reason_and_stopping_it_cancels_it_at_once(slurm_engine: Engine,
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    cpus = os.cpu_count() or 1
    blocker = subprocess.run(["sbatch", "--parsable", "--nodes=2", "--ntasks-per-node=1", f"--cpus-per-task={cpus}",
                              "--output=/dev/null", "--wrap", "sleep 300"], capture_output=True, text=True, check=True)
    blocker_id = blocker.stdout.strip().split(";")[0]
    try:
        wait_for(lambda: _state(blocker_id) == "RUNNING", timeout=30)
        run_id = launch(slurm_engine, on_slurm(), CPU_MACHINE)

        def reason() -> str:  # Slurm gives one once its scheduler has looked at the job
            reconcile(slurm_engine)
            with Session(slurm_engine) as s:
                state = get_run(s, run_id).job_state
            return state if state.startswith("PENDING (") else ""

        assert wait_for(reason, timeout=15) in ("PENDING (Resources)", "PENDING (Priority)")
        with Session(slurm_engine) as s:
            run = get_run(s, run_id)
        assert run.status == RunStatus.QUEUED
        from tests.test_dashboard_app import open_page

        live = open_page("views/live.py", run=str(run_id))  # the job, its state and reason, its script
        assert any(c.value.startswith(f"Slurm job {run.job_id} · PENDING (") for c in live.caption)
        assert any(c.value.startswith("#!/bin/bash") and "#SBATCH --nodes=1" in c.value for c in live.code)
        listing = open_page("views/runs.py").dataframe[0].value  # the Runs page and `ddpdash show` say it too
        assert listing.set_index("id").at[run_id, "slurm"] == run.job_line
        assert main(["--db-url", str(slurm_engine.url), "show", str(run_id)]) == 0
        assert f"slurm    Slurm job {run.job_id} · PENDING (" in capsys.readouterr().out
        started = time.monotonic()
        assert stop(slurm_engine, run_id) == RunStatus.CANCELLED
        assert time.monotonic() - started < 5  # a pending job is cancelled at once, no grace
        wait_for(lambda: job_gone_or_final(run.job_id), timeout=15)
        assert not ddpdash_processes(run.run_dir)
    finally:
        subprocess.run(["scancel", blocker_id], check=False)


def _state(job_id: str) -> str:
    return subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True).stdout.strip()


def test_stop_of_a_running_job_leaves_no_process_on_any_node(slurm_engine: Engine) -> None:
    run_id = launch(slurm_engine, on_slurm(max_steps=1_000_000), CPU_MACHINE)
    wait_for(lambda: _ranks_logging(slurm_engine, run_id) == [0, 1], timeout=90)
    with Session(slurm_engine) as s:
        run = get_run(s, run_id)
    assert ddpdash_processes(run.run_dir)  # the supervisor, torchrun and the ranks run
    assert stop(slurm_engine, run_id) == RunStatus.STOPPED
    with Session(slurm_engine) as s:
        stopped = [e.message for e in events_of_kind(s, run_id, EventKind.STOPPED)]
    assert stopped, "the stop was not recorded"
    wait_for(lambda: not ddpdash_processes(run.run_dir), timeout=20)
    wait_for(lambda: job_gone_or_final(run.job_id), timeout=20)


def test_a_failing_rank_is_named_with_its_traceback(slurm_engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DDPDASH_TEST_FAULT", "raise:1:5")  # reaches the job through sbatch's environment
    run_id = launch(slurm_engine, on_slurm(), CPU_MACHINE)
    run = wait_final(slurm_engine, run_id, timeout=120)
    assert run.status == RunStatus.FAILED
    assert run.failed_ranks == (1,), run.error
    assert "rank 1:" in run.error and "Traceback" in run.error and "RuntimeError" in run.error


def test_a_node_refuses_a_sqlite_store_on_a_network_file_system_and_the_run_says_so(
        slurm_engine: Engine, home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mounts = tmp_path / "mounts"  # what the node would read where DDPDASH_HOME is an NFS mount
    mounts.write_text(f"/dev/sda1 / ext4 rw 0 0\nfiler:/export {home} nfs4 rw 0 0\n")
    monkeypatch.setenv("DDPDASH_TEST_MOUNTS", str(mounts))
    run_id = launch(slurm_engine, on_slurm(), CPU_MACHINE)
    with Session(slurm_engine) as s:
        job_id = get_run(s, run_id).job_id
    wait_for(lambda: job_gone_or_final(job_id), timeout=30)
    reconcile(slurm_engine)
    with Session(slurm_engine) as s:
        run = get_run(s, run_id)
    assert run.status == RunStatus.FAILED
    assert "network file system (nfs4)" in run.error and "PostgreSQL" in run.error, run.error
    with Session(slurm_engine) as s:
        assert metric_series(s, run_id, "loss").empty  # nothing was trained, nothing written by the node


def test_a_stop_that_races_the_jobs_end_is_not_an_error(cluster: dict[str, str]) -> None:
    done = subprocess.run(["sbatch", "--parsable", "--output=/dev/null", "--wrap", "true"], capture_output=True,
                          text=True, check=True).stdout.strip().split(";")[0]
    wait_for(lambda: job_gone_or_final(done), timeout=30)
    cancel_slurm_job(done, "TERM")  # scancel says "Invalid job id specified" and fails: nothing was left
    cancel_slurm_job(done)


def test_a_job_slurm_no_longer_knows_is_lost_not_running(slurm_engine: Engine) -> None:
    """Whether or not a dashboard was open: the next reader of the runs reconciles them with Slurm."""
    from ddpdash.db.runs import update_run

    run_id = launch(slurm_engine, on_slurm(max_steps=1_000_000), CPU_MACHINE)
    with Session(slurm_engine) as s:
        real_job = get_run(s, run_id).job_id
    subprocess.run(["scancel", real_job], check=True)  # by hand, behind ddpdash's back
    wait_for(lambda: job_gone_or_final(real_job), timeout=20)
    reconcile(slurm_engine)
    with Session(slurm_engine) as s:
        run = get_run(s, run_id)
    assert run.status in (RunStatus.STOPPED, RunStatus.CANCELLED), run.status  # CANCELLED in Slurm: stopped
    other = launch(slurm_engine, on_slurm(max_steps=1_000_000), CPU_MACHINE)
    with Session(slurm_engine) as s, s.begin():
        job = get_run(s, other).job_id
        update_run(s, other, job_id="987654")  # a job Slurm never had (or long forgot)
    subprocess.run(["scancel", job], check=True)
    reconcile(slurm_engine)
    with Session(slurm_engine) as s:
        lost = get_run(s, other)
    assert lost.status == RunStatus.LOST and "Slurm job 987654 is gone" in lost.error


def test_a_multi_node_launch_on_sqlite_is_refused_before_anything_is_written(engine: Engine) -> None:
    with pytest.raises(ConfigInvalid) as refused:
        launch(engine, tiny(launcher="slurm", nodes=2, num_procs=1), CPU_MACHINE)
    assert "nodes" in refused.value.by_field()
    assert "PostgreSQL" in str(refused.value) and "SQLite" in str(refused.value)
    with Session(engine) as s:
        assert list_runs(s) == []


# ---- pure parts -----------------------------------------------------------------------------------------
def test_the_job_script_runs_one_supervisor_per_node_with_the_settings_as_sbatch_options(tmp_path: Path) -> None:
    cfg = tiny(launcher="slurm", nodes=2, num_procs=4, partition="gpu", time_limit="01:30:00", account="ml",
               qos="high", sbatch_options=("--constraint=a100", "--exclusive"), backend="nccl")
    script = slurm.job_script(cfg, 7, RunDir(tmp_path / "run dir"), python="/opt/venv/bin/python")
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash"
    for option in ("--job-name=ddpdash-7", "--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=4",
                   "--partition=gpu", "--time=01:30:00", "--account=ml", "--qos=high", "--constraint=a100",
                   "--exclusive"):
        assert any(line.startswith("#SBATCH ") and option in line for line in lines), option
    assert f"'--output={tmp_path}/run dir/slurm-%j.out'" in script  # quoted: the folder has a space
    srun = next(line for line in lines if line.startswith("exec srun"))
    assert "--ntasks-per-node=1" in srun and "-m ddpdash.trainer.supervisor" in srun and srun.endswith("--slurm")
    assert cfg.world_size == 8 and cfg.uses_cuda


def test_what_may_be_handed_to_sbatch() -> None:
    assert slurm.option_problem("--constraint=a100") is None
    assert slurm.option_problem("--exclusive") is None
    assert "one --key=value" in (slurm.option_problem("--mem=4G; rm -rf /") or "")
    assert "one --key=value" in (slurm.option_problem("-N 2") or "")
    assert "set by ddpdash" in (slurm.option_problem("--nodes=3") or "")
    assert slurm.time_limit_problem("30") is None and slurm.time_limit_problem("1-12:00:00") is None
    assert slurm.time_limit_problem("half an hour")
    errors = RunConfig(launcher="slurm", partition="a b", sbatch_options=("--wrap=x",))
    from ddpdash.trainer.config import validate

    found = {e.field for e in validate(errors, CPU_MACHINE)}
    assert {"partition", "sbatch_options"} <= found
    local = {e.field: e.message for e in validate(RunConfig(nodes=2), CPU_MACHINE)}
    assert "launcher to slurm" in local["nodes"]


def test_slurms_states_in_ddpdash_words() -> None:
    expected = {"COMPLETED": RunStatus.SUCCEEDED, "CANCELLED": RunStatus.STOPPED, "FAILED": RunStatus.FAILED,
                "NODE_FAIL": RunStatus.FAILED, "OUT_OF_MEMORY": RunStatus.FAILED, "BOOT_FAIL": RunStatus.FAILED,
                "DEADLINE": RunStatus.FAILED, "TIMEOUT": RunStatus.FAILED}
    for state, status in expected.items():
        outcome = slurm.job_outcome(slurm.Job("5", state))
        assert outcome is not None and outcome[0] == status, state
    timeout = slurm.job_outcome(slurm.Job("5", "TIMEOUT"))
    assert timeout is not None and timeout[1].startswith("time limit reached")
    assert slurm.job_outcome(slurm.Job("5", "PENDING", "Resources")) is None
    jobs = slurm.parse_squeue("12|PENDING|Priority|(null)\n13|RUNNING|None|node[1-2]\n")
    assert jobs["12"].describe == "PENDING (Priority)" and jobs["13"].describe == "RUNNING on node[1-2]"
    shown = slurm.parse_scontrol_job("JobId=14 JobName=x JobState=TIMEOUT Reason=TimeLimit NodeList=node1 "
                                     "ExitCode=0:15")
    assert shown == slurm.Job("14", "TIMEOUT", "TimeLimit", "node1")


def test_a_node_refuses_a_sqlite_store_on_a_network_file_system(tmp_path: Path) -> None:
    from ddpdash.trainer.supervisor.node import store_refusal

    mounts = tmp_path / "mounts"
    mounts.write_text("/dev/sda1 / ext4 rw 0 0\nserver:/home /home nfs4 rw 0 0\n"
                      "mds@tcp:/lustre /scratch lustre rw 0 0\n")
    refused = store_refusal("sqlite:////home/me/ddpdash.db", mounts)
    assert refused is not None and "network file system (nfs4)" in refused and "PostgreSQL" in refused
    assert store_refusal("sqlite:////scratch/x.db", mounts) is not None
    assert store_refusal("sqlite:////var/tmp/ddpdash.db", mounts) is None
    assert store_refusal("postgresql://u@db/ddpdash", mounts) is None


def test_a_node_reads_its_place_in_the_job_from_slurm() -> None:
    cfg = tiny(launcher="slurm", nodes=2, num_procs=4)
    node = SlurmNode.from_env(cfg, {"SLURM_NODEID": "1", "SLURM_NNODES": "2", "SLURM_JOB_ID": "123",
                                    "SLURM_LAUNCH_NODE_IPADDR": "10.0.0.5"})
    assert node.first_rank == 4
    assert node.rendezvous == ["--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.5",
                               "--master-port", str(slurm.master_port("123"))]


# ---- the form and the CLI -------------------------------------------------------------------------------
def test_the_form_offers_slurm_with_the_clusters_partitions_and_previews_the_job_script(
        cluster: dict[str, str], engine: Engine) -> None:
    from tests.test_dashboard_app import errors, open_page, ran

    at = open_page("views/new_run.py")
    assert at.selectbox(key="cfg_launcher").options == ["local", "slurm"]
    assert not [s for s in at.selectbox if s.key == "cfg_partition"]  # Slurm's settings only once chosen
    ran(at.selectbox(key="cfg_launcher").select("slurm").run())
    assert at.selectbox(key="cfg_partition").options == ["the cluster's default", slurm_cluster.PARTITION]
    ran(at.text_input(key="cfg_time_limit").set_value("half an hour").run())
    assert any("Time limit must be a Slurm time" in e for e in errors(at))
    ran(at.text_input(key="cfg_time_limit").set_value("00:05:00").run())
    script = next(c.value for c in at.code if c.value.startswith("#!/bin/bash"))
    assert "#SBATCH --time=00:05:00" in script and "exec srun --ntasks-per-node=1" in script


def test_the_form_keeps_to_this_machine_without_sbatch(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    from ddpdash.dashboard import state
    from tests.test_dashboard_app import open_page

    monkeypatch.setenv("PATH", "/nonexistent")
    state.slurm_target.clear()
    try:
        at = open_page("views/new_run.py")
        assert not [s for s in at.selectbox if s.key == "cfg_launcher"]
        assert any("no Slurm cluster to submit to" in c.value for c in at.caption)
    finally:
        state.slurm_target.clear()


def test_the_cli_takes_the_slurm_settings() -> None:
    from ddpdash.cli import build_parser, config_from_args

    args = build_parser().parse_args(["launch", "--launcher", "slurm", "--nodes", "2", "--num-procs", "1",
                                      "--partition", "debug", "--time", "00:10:00", "--sbatch-option=--exclusive"])
    cfg = config_from_args(args)
    assert (cfg.launcher, cfg.nodes, cfg.ranks_per_node, cfg.partition, cfg.time_limit) == \
        ("slurm", 2, 1, "debug", "00:10:00")
    assert cfg.world_size == 2 and cfg.sbatch_options == ("--exclusive",)
    from ddpdash.trainer.commands import cli_command

    assert "--sbatch-option=--exclusive" in cli_command(cfg) and "--time-limit" in cli_command(cfg)
