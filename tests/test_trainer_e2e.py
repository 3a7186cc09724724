"""The trainer under real torchrun, two gloo ranks on CPU, against a SQLite file (slow: real processes)."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from ddpdash.db.migrate import open_store
from ddpdash.db.queries import events, metric_series, rank_states
from tests.conftest import run_in_dir, tiny, torchrun_by_hand

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> tuple[Engine, str, Path]:
    root = tmp_path_factory.mktemp("trainer")
    url = f"sqlite:///{root / 'ddpdash.db'}"
    return open_store(url), url, root


@pytest.fixture(scope="module")
def mlp_run(store: tuple[Engine, str, Path]) -> tuple[Engine, int, Path, str]:
    engine, url, root = store
    run_dir = root / "mlp"
    samples = root / "samples"
    result = torchrun_by_hand(tiny(max_steps=30), run_dir, url, extra_env={"DDPDASH_TEST_SAMPLE_LOG": str(samples)})
    assert result.returncode == 0, result.stderr[-3000:]
    return engine, run_in_dir(engine, run_dir).id, samples, result.stderr


def test_every_rank_writes_its_metrics(mlp_run) -> None:  # type: ignore[no-untyped-def]
    engine, run_id, _, _ = mlp_run
    with Session(engine) as s:
        for name in ("loss", "samples_per_s", "step_time", "data_time", "lr"):
            df = metric_series(s, run_id, name)
            assert df.groupby("rank")["step"].apply(list).to_dict() == {0: list(range(1, 31)), 1: list(range(1, 31))}
        states = rank_states(s, run_id)
    assert states["status"].tolist() == ["done", "done"] and states["step"].tolist() == [30, 30]


def test_validation_metrics_come_from_rank_zero(mlp_run) -> None:  # type: ignore[no-untyped-def]
    engine, run_id, _, _ = mlp_run
    with Session(engine) as s:
        acc = metric_series(s, run_id, "val_acc")
    assert acc["rank"].unique().tolist() == [0] and 0.0 <= acc["value"].iloc[-1] <= 1.0


def test_ranks_train_on_disjoint_shards(mlp_run) -> None:  # type: ignore[no-untyped-def]
    _, _, samples, _ = mlp_run
    seen = [set((samples / f"rank{r}.attempt0.txt").read_text().split()) for r in (0, 1)]
    assert len(seen[0]) == len(seen[1]) == 30 * 16
    assert not seen[0] & seen[1]


def test_sync_check_finds_replicas_identical(mlp_run) -> None:  # type: ignore[no-untyped-def]
    engine, run_id, _, _ = mlp_run
    with Session(engine) as s:
        kinds = events(s, run_id)["kind"].tolist()
    assert "desync" not in kinds and "started" in kinds


def test_log_lines_carry_the_rank(mlp_run) -> None:  # type: ignore[no-untyped-def]
    assert "rank1 INFO" in mlp_run[3] and "rank0 INFO" in mlp_run[3]


def test_perturbed_replica_is_reported_as_desync(store) -> None:  # type: ignore[no-untyped-def]
    engine, url, root = store
    run_dir = root / "perturb"
    result = torchrun_by_hand(tiny(max_steps=20, sync_check_every=5), run_dir, url,
                              extra_env={"DDPDASH_TEST_FAULT": "perturb:1:7"})
    assert result.returncode == 0, result.stderr[-3000:]
    with Session(engine) as s:
        ev = events(s, run_in_dir(engine, run_dir).id)
    desync = ev[ev["kind"] == "desync"]
    assert len(desync) >= 1 and "step 10" in desync.iloc[0]["message"] and "[1]" in desync.iloc[0]["message"]


def test_loss_falls_on_the_regression_task(store) -> None:  # type: ignore[no-untyped-def]
    engine, url, root = store
    run_dir = root / "linear"
    result = torchrun_by_hand(tiny(recipe="linear", max_steps=60, lr=0.05), run_dir, url)
    assert result.returncode == 0, result.stderr[-3000:]
    with Session(engine) as s:
        loss = metric_series(s, run_in_dir(engine, run_dir).id, "loss")
    for _, per_rank in loss.groupby("rank"):
        assert per_rank["value"].iloc[-5:].mean() < 0.2 * per_rank["value"].iloc[:5].mean()


@pytest.mark.parametrize(
    "changes",
    [
        {"recipe": "cnn", "width": 8, "max_steps": 6},
        {"recipe": "transformer", "width": 32, "depth": 1, "num_heads": 2, "seq_len": 32, "max_steps": 4},
        {"recipe": "mlp", "amp": "bf16", "max_steps": 6},
        {"recipe": "mlp", "grad_accum_steps": 2, "static_graph": True, "comm_hook": "fp16", "max_steps": 6},
        {"recipe": "mlp", "comm_hook": "powersgd", "gradient_as_bucket_view": True, "max_steps": 6},
    ],
    ids=["cnn", "transformer", "bf16", "accum-static-fp16hook", "powersgd"],
)
def test_models_and_ddp_options_train_on_both_ranks(store, changes) -> None:  # type: ignore[no-untyped-def]
    engine, url, root = store
    run_dir = root / "-".join(f"{k}{v}" for k, v in changes.items())
    result = torchrun_by_hand(tiny(sync_check_every=2, **changes), run_dir, url)
    assert result.returncode == 0, result.stderr[-3000:]
    run = run_in_dir(engine, run_dir)
    with Session(engine) as s:
        loss = metric_series(s, run.id, "loss")
        kinds = events(s, run.id)["kind"].tolist()
        tokens = metric_series(s, run.id, "tokens_per_s")
    assert sorted(loss["rank"].unique()) == [0, 1]
    assert loss.groupby("rank")["step"].max().tolist() == [changes["max_steps"]] * 2
    assert "desync" not in kinds and run.status == "succeeded"
    assert (not tokens.empty) == (changes["recipe"] == "transformer")


def test_a_second_run_in_the_same_folder_does_not_adopt_the_first_runs_checkpoint(store) -> None:  # type: ignore[no-untyped-def]
    """A checkpoint is resumed only by the run that wrote it (a restarted attempt): a new torchrun by
    hand on the same folder is a new run, and trains from step 1."""
    engine, url, root = store
    run_dir = root / "again"
    first = torchrun_by_hand(tiny(max_steps=20, checkpoint_every=10), run_dir, url)
    assert first.returncode == 0, first.stderr[-3000:]
    first_id = run_in_dir(engine, run_dir).id
    second = torchrun_by_hand(tiny(max_steps=35, checkpoint_every=10), run_dir, url)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "was written by another run" in second.stderr
    with Session(engine) as s:
        from ddpdash.db.runs import list_runs

        second_id = next(r.id for r in list_runs(s) if r.run_dir == str(run_dir.resolve()) and r.id != first_id)
        loss = metric_series(s, second_id, "loss")
        ev = events(s, second_id)
    assert loss.groupby("rank")["step"].apply(list).to_dict() == {0: list(range(1, 36)), 1: list(range(1, 36))}
    assert "restart" not in ev["kind"].tolist()


def test_single_plain_process_without_torchrun(store) -> None:  # type: ignore[no-untyped-def]
    import subprocess
    import sys

    engine, url, root = store
    run_dir = root / "plain"
    run_dir.mkdir()
    (run_dir / "config.json").write_text(tiny(max_steps=5).to_json())
    result = subprocess.run([sys.executable, "-m", "ddpdash.trainer", "--config", str(run_dir / "config.json")],
                            env={**__import__("os").environ, "DDPDASH_DB_URL": url}, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    run = run_in_dir(engine, run_dir)
    assert run.status == "succeeded" and run.world_size == 1


def test_repeated_short_runs_always_exit_zero(store) -> None:  # type: ignore[no-untyped-def]
    _, url, root = store
    codes = []
    for i in range(5):
        result = torchrun_by_hand(tiny(max_steps=3, sync_check_every=0), root / f"repeat{i}", url)
        codes.append((result.returncode, result.stderr[-500:] if result.returncode else ""))
    assert [c for c, _ in codes] == [0] * 5, codes


def test_two_nodes_register_one_run_with_every_rank(store) -> None:  # type: ignore[no-untyped-def]
    """What the README's multi-node recipe does, with two 'nodes' on this machine (c10d rendezvous)."""
    import os
    import socket
    import subprocess
    import sys

    engine, url, root = store
    run_dir = root / "two-nodes"
    run_dir.mkdir()
    (run_dir / "config.json").write_text(tiny(max_steps=10, num_procs=1).to_json())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two-node-job",
            "-m", "ddpdash.trainer", "--config", str(run_dir / "config.json")]
    env = {**os.environ, "DDPDASH_DB_URL": url, "OMP_NUM_THREADS": "1"}
    nodes = [subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outputs = [n.communicate(timeout=180) for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], [o[1][-2000:] for o in outputs]
    run = run_in_dir(engine, run_dir)
    with Session(engine) as s:
        loss = metric_series(s, run.id, "loss")
    assert run.world_size == 2 and run.status == "succeeded"
    assert loss.groupby("rank")["step"].max().to_dict() == {0: 10, 1: 10}
