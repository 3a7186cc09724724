"""ddpdash installs under one namespace: built as a wheel and installed without the source checkout,
it runs from a folder whose own `trainer.py`, `db.py` and `dashboard/` would shadow top-level names."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from sqlalchemy.orm import Session

from ddpdash.db.migrate import open_store
from ddpdash.db.queries import rank_states
from ddpdash.db.runs import list_runs
from ddpdash.db.vocab import RunStatus
from tests.conftest import ROOT, tiny

DECOYS = {"trainer.py": "trainer", "db.py": "db", "dashboard/__init__.py": "dashboard"}


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtualenv holding ddpdash's wheel (no editable link to this checkout); its other
    dependencies are this environment's, reused through a .pth file rather than installed again."""
    work = tmp_path_factory.mktemp("wheel")
    # A copy of the checkout: a build in place would reuse build/lib, where a deleted module lingers.
    source = work / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", ".hypothesis", "test-artifacts"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(work / "dist"), str(source)], check=True, capture_output=True, timeout=120)
    [wheel] = (work / "dist").glob("ddpdash-*.whl")
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    # Appended after the venv's own site-packages: the wheel's ddpdash is found first. Only a site dir's
    # .pth files run, so this environment's editable-install hook stays inactive there.
    Path(site, "reuse-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)],
                   check=True, capture_output=True, timeout=120)
    return venv


@pytest.fixture
def decoy_folder(tmp_path: Path) -> Path:
    """A user's project folder with modules named like ddpdash's packages, each failing loudly if imported."""
    folder = tmp_path / "project"
    for name, module in DECOYS.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"raise RuntimeError('the user\\'s own {module} was imported instead of ddpdash\\'s')\n")
    return folder


def clean_env(home: Path, db_url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return {**env, "DDPDASH_HOME": str(home), "DDPDASH_DB_URL": db_url, "OMP_NUM_THREADS": "1"}


@pytest.mark.slow
def test_the_wheel_imports_its_own_modules_not_the_working_folders(installed: Path, decoy_folder: Path) -> None:
    code = ("import ddpdash.trainer.train, ddpdash.db.store, ddpdash.dashboard.forms, ddpdash.cli\n"
            "print(ddpdash.__file__)")
    out = subprocess.run([str(installed / "bin" / "python"), "-c", code], cwd=decoy_folder, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()).is_relative_to(installed)  # the wheel's copy, not this checkout


@pytest.mark.slow
def test_a_cli_launch_and_a_hand_started_torchrun_work_beside_decoys(
    installed: Path, decoy_folder: Path, home: Path, db_url: str
) -> None:
    env = clean_env(home, db_url)
    launched = subprocess.run(
        [str(installed / "bin" / "ddpdash"), "launch", "--num-procs", "2", "--recipe", "mlp", "--width", "16",
         "--depth", "1", "--batch-size", "16", "--max-steps", "20", "--name", "from-the-wheel", "--wait"],
        cwd=decoy_folder, env=env, capture_output=True, text=True, timeout=180)
    assert launched.returncode == 0, launched.stderr
    run_dir = decoy_folder / "by-hand"
    run_dir.mkdir()
    (run_dir / "config.json").write_text(tiny(name="by-hand", max_steps=20).to_json())
    by_hand = subprocess.run(
        [str(installed / "bin" / "python"), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "ddpdash.trainer", "--config", "by-hand/config.json"],
        cwd=decoy_folder, env=env, capture_output=True, text=True, timeout=180)
    assert by_hand.returncode == 0, by_hand.stderr[-3000:]
    engine = open_store(db_url)
    with Session(engine) as s:
        runs = {r.name: r for r in list_runs(s)}
        assert set(runs) == {"from-the-wheel", "by-hand"}
        for run in runs.values():
            assert run.status == RunStatus.SUCCEEDED, (run.name, run.error)
            states = rank_states(s, run.id)
            assert states["rank"].tolist() == [0, 1] and states["step"].tolist() == [20, 20]
    engine.dispose()
