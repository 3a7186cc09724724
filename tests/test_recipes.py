"""Your own model and data: recipes (build(params) -> ddpdash.Recipe), the table and image-folder recipes, the
check before launch (a child process), the examples, and the form and CLI around them — real 2-rank gloo
runs, data each test makes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from ddpdash.dashboard import forms
from ddpdash.dashboard.history import config_diff
from ddpdash.db.queries import events, metric_series
from ddpdash.db.runs import create_run, get_run, list_runs
from ddpdash.db.vocab import EventKind, RunStatus
from ddpdash.trainer.config import ConfigInvalid, RunConfig, validate
from ddpdash.trainer.control import check_recipe, launch
from tests.conftest import CPU_MACHINE, ROOT, wait_final

EXAMPLES = ROOT / "examples"
SHAPES = EXAMPLES / "shapes_project"

# A recipe a test writes: BUILD is the body of build(params), with torch, F, nn, TensorDataset and ddpdash
# imported; `regression(n)` makes a small linear-regression data set.
RECIPE = '''
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset
import ddpdash
{top}

def regression(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return TensorDataset(x, x @ torch.arange(1.0, 7.0).unsqueeze(1) / 6 + 0.05 * torch.randn(n, 1, generator=g))


def build(params):
{build}
'''
GOOD_BUILD = '''return ddpdash.Recipe(model=nn.Sequential(nn.Linear(6, params.get("width", 16)), nn.ReLU(),
                                           nn.Linear(params.get("width", 16), 1)),
                      train=regression(512), val=regression(128, 1), loss=lambda out, b: F.mse_loss(out, b[1]))'''


def recipe_file(folder: Path, build: str = GOOD_BUILD, top: str = "", name: str = "recipe.py") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(RECIPE.format(top=top, build=textwrap.indent(textwrap.dedent(build), "    ")))
    return path


def small(recipe: str, **changes: object) -> RunConfig:
    base = {"name": "recipe-test", "recipe": recipe, "num_procs": 2, "batch_size": 16, "max_steps": 20,
            "log_every": 1, "checkpoint_every": 0, "sync_check_every": 10, "width": 16, "depth": 1}
    return RunConfig.from_dict({**base, **changes})


def failure(cfg: RunConfig, timeout_s: float | None = None) -> tuple[str, str, str]:
    result = check_recipe(cfg, timeout_s)
    assert result.report is None and len(result.failures) >= 1, result
    f = result.failures[0]
    return f.field, f.message, f.detail


def losses_fall(engine: Engine, run_id: int, metric: str = "loss") -> dict[int, tuple[float, float]]:
    """Per rank: the mean of the first and of the last quarter of its loss points; each must fall."""
    with Session(engine) as s:
        frame = metric_series(s, run_id, metric, max_points=100_000)
    out = {}
    for rank, points in frame.sort_values("step").groupby("rank"):
        values = points["value"].to_numpy()
        quarter = max(len(values) // 4, 1)
        out[int(rank)] = (float(values[:quarter].mean()), float(values[-quarter:].mean()))
    assert set(out) == {0, 1}, out
    for rank, (first, last) in out.items():
        assert last < first, (rank, first, last)
    return out


def house_table(path: Path, rows: int = 400, classes: bool = False) -> Path:
    rng = np.random.default_rng(3)
    area = rng.uniform(30, 200, rows)
    rooms = rng.integers(1, 7, rows)
    price = 2000 * area + 5000 * rooms + rng.normal(0, 5000, rows)
    frame = pd.DataFrame({"area": area, "rooms": rooms, "price": price})
    if classes:
        frame["size"] = np.where(area > 140, "large", np.where(area > 80, "medium", "small"))
        frame = frame.drop(columns=["price"])
    if path.suffix == ".parquet":
        frame.to_parquet(path)
    else:
        frame.to_csv(path, index=False)
    return path


def shapes(root: Path, per_class: int = 24) -> Path:
    sys.path.insert(0, str(SHAPES))
    try:
        from make_shapes import make_shapes
    finally:
        sys.path.remove(str(SHAPES))
    return make_shapes(root, per_class, size=16)


# ---- config ------------------------------------------------------------------------------------------
def test_recipe_names_are_validated_before_anything_runs() -> None:
    def errors(**kw: object) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for e in validate(RunConfig.from_dict(kw), CPU_MACHINE):
            out.setdefault(e.field, []).append(e.message)
        return out

    assert "path/to/file.py:build" in errors(recipe="my model")["recipe"][0]
    assert errors(recipe="model.py:build") == {} and errors(recipe="pkg.models:make") == {}
    assert "must name your data" in errors(recipe="table", target="y")["data"][0]
    assert "column to predict" in errors(recipe="table", data="t.csv")["target"][0]
    assert "your script brings its own model" in errors(recipe="m.py:build", script="train.py")["recipe"][0]
    assert "not by mlp" in errors(data="t.csv")["data"][0]


def test_configs_stored_before_recipes_still_open_clone_and_compare(engine: Engine) -> None:
    old = {"name": "old", "model": "cnn", "width": 8, "script_sha256": "ab" * 32}
    cfg = RunConfig.from_dict(old)
    assert cfg.recipe == "cnn" and cfg.code_sha256 == "ab" * 32 and cfg.what == "cnn"
    clone = RunConfig.from_dict(forms.values_from_state(forms.widget_state(cfg)))
    assert clone == cfg.replace(code_sha256="")  # the form carries what a user sets; the launch records the hash
    with Session(engine) as s, s.begin():
        new = RunConfig(name="old", recipe="mlp", width=8).to_dict()
        ids = [create_run(s, key=f"k{i}", name="old", config_json=json.dumps(c), world_size=2)
               for i, c in enumerate([old, new])]
    with Session(engine) as s:
        diff = config_diff([get_run(s, i) for i in ids]).set_index("setting")
    assert diff.index.tolist() == ["code_sha256", "recipe"]  # the old "model" is the new "recipe"
    assert diff.loc["recipe"].tolist() == ["cnn", "mlp"]


# ---- the check: every failure named, with the user's traceback ------------------------------------------
def test_check_reports_what_one_batch_showed(tmp_path: Path) -> None:
    path = recipe_file(tmp_path / "proj")
    result = check_recipe(small(f"{path}:build", params=("width=8",), batch_size=32))
    assert not result.failures, result.failures
    report = result.report
    assert report is not None and report.code_file == str(path)
    assert report.parameters == 6 * 8 + 8 + 8 + 1  # width=8 reached build()
    assert (report.train_size, report.val_size, report.shard_size, report.steps_per_epoch) == (512, 128, 256, 8)
    assert report.batch == "(float32[32, 6], float32[32, 1])" and report.output == "float32[32, 1]"
    assert dict(report.lines())["Per rank"].startswith("256 samples per epoch over 2 rank(s): 8 steps")


@pytest.mark.parametrize(("build", "field", "words"), [
    ("return {'model': 1}", "recipe", "build() returned dict, not a ddpdash.Recipe"),
    ("return ddpdash.Recipe(model=nn.Linear(6, 1), train=regression(0), loss=lambda o, b: o.sum())", "recipe",
     "Recipe.train is empty"),
    ("return ddpdash.Recipe(model=nn.Linear(6, 1), train=regression(30), loss=lambda o, b: o.sum())", "batch_size",
     "fewer than one step's 16"),
    ("return ddpdash.Recipe(model=nn.Linear(6, 1), train=regression(64), loss=lambda o, b: (o - b[1]) ** 2)",
     "recipe", "not a scalar tensor"),
    ("return ddpdash.Recipe(model='net', train=regression(64), loss=lambda o, b: o.sum())", "recipe",
     "not a torch.nn.Module"),
])
def test_a_bad_recipe_is_refused_with_the_reason(tmp_path: Path, build: str, field: str, words: str) -> None:
    got_field, message, _ = failure(small(f"{recipe_file(tmp_path, build)}:build"))
    assert (got_field, words in message) == (field, True), message


def test_a_recipe_that_raises_shows_the_users_own_traceback(tmp_path: Path) -> None:
    path = recipe_file(tmp_path, build="width = params['wdith']\nreturn None")
    field, message, detail = failure(small(f"{path}:build"))
    assert field == "recipe" and "KeyError" in message and "'wdith'" in message
    assert str(path) in detail and "width = params['wdith']" in detail  # the user's file and line
    assert "ddpdash/trainer" not in detail and "trainer/recipes.py" not in detail  # not our frames
    path = recipe_file(tmp_path, build=GOOD_BUILD.replace("nn.Linear(6,", "nn.Linear(5,"), name="shapes.py")
    field, message, detail = failure(small(f"{path}:build"))
    assert "forward raised RuntimeError" in message and "mat1 and mat2" in message


def test_missing_files_and_functions_are_named(tmp_path: Path) -> None:
    path = recipe_file(tmp_path)
    assert failure(small(f"{tmp_path}/nope.py:build"))[:2] == ("recipe", f"{tmp_path}/nope.py is not a file")
    field, message, _ = failure(small(f"{path}:make"))
    assert field == "recipe" and "recipe.py has no 'make'; it has build, regression" in message
    field, message, _ = failure(small("nosuchpkg.models:build", workdir=str(tmp_path)))
    assert message == f"module nosuchpkg.models cannot be found from {tmp_path}"


def test_a_slow_recipe_times_out_and_its_process_is_gone(tmp_path: Path) -> None:
    marker = tmp_path / "pid"
    path = recipe_file(tmp_path, top=f"import os, time\nopen({str(marker)!r}, 'w').write(str(os.getpid()))\n"
                                      "time.sleep(600)")
    field, message, _ = failure(small(f"{path}:build"), timeout_s=4)
    assert field == "recipe" and "timed out after 4 s" in message
    pid = int(marker.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_bad_tables_and_image_folders_are_refused(tmp_path: Path) -> None:
    table = house_table(tmp_path / "houses.csv")
    assert failure(small("table", data=str(table), target="cost"))[:2] == (
        "target", "'cost' is not a column of houses.csv; its columns: area, rooms, price")
    frame = pd.read_csv(table)
    frame["city"] = "Oslo"
    frame.to_csv(tmp_path / "cities.csv", index=False)
    field, message, _ = failure(small("table", data=str(tmp_path / "cities.csv"), target="price"))
    assert field == "data" and "feature column 'city'" in message and "not numeric" in message
    field, message, _ = failure(small("table", data=str(tmp_path / "missing.csv"), target="price"))
    assert field == "data" and "is not a file" in message
    (tmp_path / "empty").mkdir()
    field, message, _ = failure(small("images", data=str(tmp_path / "empty")))
    assert field == "data" and "has no classes" in message
    field, message, _ = failure(small("images", data=str(shapes(tmp_path / "shapes")), arch="resnet18"))
    assert field == "arch" and "torchvision" in message


def test_a_failed_check_launches_nothing_and_writes_nothing(engine: Engine, home: Path, tmp_path: Path) -> None:
    path = recipe_file(tmp_path, build="return 42")
    with pytest.raises(ConfigInvalid) as caught:
        launch(engine, small(f"{path}:build"), CPU_MACHINE)
    assert caught.value.by_field() == {"recipe": ["build() returned int, not a ddpdash.Recipe"]}
    with Session(engine) as s:
        assert list_runs(s) == []
    assert not (home / "runs").exists() or not any((home / "runs").iterdir())


def test_the_cli_checks_and_refuses_with_one_line_and_the_traceback(home: Path, tmp_path: Path) -> None:
    env = {**os.environ, "DDPDASH_HOME": str(home)}
    good = subprocess.run([sys.executable, "-m", "ddpdash.cli", "check", "--recipe",
                           f"{EXAMPLES / 'linear_recipe.py'}:build", "--param", "samples=512"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert good.returncode == 0, good.stderr
    assert "Data:      512 train, 128 validation samples" in good.stdout and "Model:     11 parameters" in good.stdout
    bad = recipe_file(tmp_path, build="raise ValueError('no data here')")
    out = subprocess.run([sys.executable, "-m", "ddpdash.cli", "launch", "--recipe", f"{bad}:build"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stdout == ""
    first, *rest = out.stderr.splitlines()
    assert first == "ddpdash: error: recipe recipe.py:build raised ValueError: no data here"
    assert any(str(bad) in line for line in rest)


# ---- real runs ------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_user_recipe_with_parameters_round_trips_and_trains(engine: Engine, home: Path, tmp_path: Path) -> None:
    path = recipe_file(tmp_path / "proj", build=GOOD_BUILD.replace(
        "loss=lambda out, b: F.mse_loss(out, b[1]))",
        "loss=lambda out, b: F.mse_loss(out, b[1]),\n"
        "                      metrics=lambda out, b: {'mae': (out - b[1]).abs().mean(),\n"
        "                                              'tag': params['tag'] == 'x'})"))
    env = {**os.environ, "DDPDASH_HOME": str(home)}
    out = subprocess.run([sys.executable, "-m", "ddpdash.cli", "launch", "--recipe", "proj/recipe.py:build",
                          "--param", "width=24", "--param", "tag=x", "--num-procs", "2", "--max-steps", "40",
                          "--batch-size", "16", "--wait"], env=env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    with Session(engine) as s:
        [run] = list_runs(s)
    cfg = RunConfig.from_dict(run.config)
    assert cfg.params == ("width=24", "tag=x") and cfg.parameters == {"width": 24, "tag": "x"}
    assert cfg.recipe == f"{path}:build" and cfg.workdir == str(path.parent) and cfg.code_file == str(path)
    assert len(cfg.code_sha256) == 64 and run.name == "recipe" and cfg.what == "recipe.py:build"
    losses_fall(engine, run.id)
    with Session(engine) as s:
        mae = metric_series(s, run.id, "mae", max_points=1000)
        tag = metric_series(s, run.id, "tag", max_points=1000)
        val = metric_series(s, run.id, "val_mae", max_points=1000)
    assert set(mae["rank"]) == {0, 1} and set(tag["value"]) == {1.0}  # per rank
    assert val["step"].tolist() == [16, 32, 40]  # after each epoch of 512 / 2 ranks / 16, and at the end
    # Clone (the form filled from the stored config) and Compare's diff carry the parameters.
    state = forms.widget_state(cfg)
    assert state[forms.PARAMS_ROWS_KEY] == [["width", "24"], ["tag", "x"]]
    assert state[forms.RECIPE_CHOICE_KEY] == forms.OWN_RECIPE and state[forms.OWN_RECIPE_KEY] == cfg.recipe
    edited = {**state, state[forms.PARAMS_EDITOR_KEY]: {"edited_rows": {0: {"value": "32"}}, "added_rows": [],
                                                         "deleted_rows": []}}
    clone = RunConfig.from_dict(forms.values_from_state(edited))
    assert clone.params == ("width=32", "tag=x") and clone.recipe == cfg.recipe
    with Session(engine) as s, s.begin():
        clone_id = create_run(s, key="clone", name="clone", config_json=clone.to_json(), world_size=2)
    with Session(engine) as s:
        diff = config_diff([get_run(s, run.id), get_run(s, clone_id)]).set_index("setting")
    assert diff.loc["params"].tolist() == ['["width=24", "tag=x"]', '["width=32", "tag=x"]']


@pytest.mark.slow
def test_the_examples_train_for_real(engine: Engine, tmp_path: Path) -> None:
    linear = launch(engine, small(f"{EXAMPLES / 'linear_recipe.py'}:build", max_steps=40, lr=0.02), CPU_MACHINE)
    images = shapes(tmp_path / "shapes")
    # The project's own model.py and utils.py (names many projects use) are the ones its recipe imports.
    cnn = launch(engine, small(f"{SHAPES / 'recipe.py'}:build", params=(f"data={images}", "size=16"),
                               max_steps=30, batch_size=8, lr=0.05), CPU_MACHINE)
    houses = launch(engine, small("table", data=str(EXAMPLES / "houses.csv"), target="price", max_steps=40,
                                  width=32), CPU_MACHINE)
    for run_id in (linear, cnn, houses):
        run = wait_final(engine, run_id, timeout=240)
        assert run.status == RunStatus.SUCCEEDED, run.error
        losses_fall(engine, run_id)
    with Session(engine) as s:
        assert get_run(s, cnn).config["workdir"] == str(SHAPES)


@pytest.mark.slow
def test_tables_train_as_classification_and_regression(engine: Engine, tmp_path: Path) -> None:
    regression = small("table", data=str(house_table(tmp_path / "houses.parquet")), target="price", max_steps=30,
                       width=32)
    classes = small("table", data=str(house_table(tmp_path / "sizes.csv", classes=True)), target="size",
                    max_steps=40, width=32, lr=0.1)
    check = check_recipe(classes).report
    assert check is not None and check.about.startswith("classification of 'size' into 3 classes (large, medium")
    reg_check = check_recipe(regression).report
    assert reg_check is not None and reg_check.about.startswith("regression of 'price'")
    ids = [launch(engine, cfg, CPU_MACHINE) for cfg in (regression, classes)]
    for run_id in ids:
        assert wait_final(engine, run_id, timeout=240).status == RunStatus.SUCCEEDED
        losses_fall(engine, run_id)
    with Session(engine) as s:
        acc = metric_series(s, ids[1], "acc", max_points=1000)
        val_acc = metric_series(s, ids[1], "val_acc", max_points=1000)
    assert set(acc["rank"]) == {0, 1} and not val_acc.empty


@pytest.mark.slow
def test_an_image_folder_trains(engine: Engine, tmp_path: Path) -> None:
    cfg = small("images", data=str(shapes(tmp_path / "photos")), image_size=16, batch_size=8, max_steps=30, width=8)
    run = wait_final(engine, launch(engine, cfg, CPU_MACHINE), timeout=240)
    assert run.status == RunStatus.SUCCEEDED, run.error
    losses_fall(engine, run.id)
    assert RunConfig.from_dict(run.config).what == "images (photos)"


@pytest.mark.slow
def test_a_user_model_resumes_from_its_checkpoint_after_a_failure(engine: Engine, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DDPDASH_TEST_FAULT", "raise-once:1:15")
    path = recipe_file(tmp_path / "proj")
    run_id = launch(engine, small(f"{path}:build", max_steps=30, checkpoint_every=10, max_restarts=1), CPU_MACHINE)
    run = wait_final(engine, run_id, timeout=240)
    assert run.status == RunStatus.SUCCEEDED, run.error
    with Session(engine) as s:
        loss = metric_series(s, run_id, "loss", max_points=1000)
        ev = events(s, run_id)
    for _, per_rank in loss.groupby("rank"):
        assert per_rank["step"].tolist() == list(range(1, 31))
    restarts = ev[ev["kind"] == EventKind.RESTART]
    assert len(restarts) == 1 and "step 10" in restarts.iloc[0]["message"]


@pytest.mark.slow
def test_a_failing_user_model_names_the_rank_and_the_users_line(engine: Engine, tmp_path: Path) -> None:
    # Passes the check (one batch on the CPU), then fails on rank 1 at its fifth step, in the user's forward.
    path = recipe_file(tmp_path / "proj", top=textwrap.dedent('''
        class Net(nn.Linear):
            calls = 0
            def forward(self, x):
                Net.calls += 1
                if Net.calls == 5 and int(__import__("os").environ.get("RANK", "0")) == 1:
                    raise FloatingPointError("exploded on purpose")
                return super().forward(x)
        '''), build="return ddpdash.Recipe(model=Net(6, 1), train=regression(512),\n"
                         "                      loss=lambda o, b: F.mse_loss(o, b[1]))")
    run = wait_final(engine, launch(engine, small(f"{path}:build"), CPU_MACHINE), timeout=240)
    assert run.status == RunStatus.FAILED and run.failed_ranks == (1,)
    assert "FloatingPointError: exploded on purpose" in run.error and f"{path}" in run.error


def test_the_form_checks_a_recipe_and_shows_what_it_found(tmp_path: Path) -> None:
    from tests.test_dashboard_app import open_page, ran

    good, bad = recipe_file(tmp_path, name="good.py"), recipe_file(tmp_path, build="return 7", name="bad.py")
    at = open_page("views/new_run.py")
    ran(at.selectbox(key=forms.RECIPE_CHOICE_KEY).select(forms.OWN_RECIPE).run())
    ran(at.text_input(key=forms.OWN_RECIPE_KEY).input(f"{good}:build").run())
    assert "Check" in [b.label for b in at.button]
    ran(next(b for b in at.button if b.label == "Check").click().run())
    assert any("checks out" in s.value for s in at.success)
    table = at.table[0].value
    assert "512 train, 128 validation samples" in json.dumps(table.to_dict())
    ran(at.text_input(key=forms.OWN_RECIPE_KEY).input(f"{bad}:build").run())
    ran(next(b for b in at.button if b.label == "Launch").click().run())
    messages = [e.value for e in at.error]
    assert "Recipe build() returned int, not a ddpdash.Recipe" in messages, messages  # next to the field
    assert any("Nothing was launched" in m for m in messages)


def test_clone_fills_the_form_with_the_recipe_and_its_parameters(engine: Engine, tmp_path: Path) -> None:
    from tests.conftest import make_run
    from tests.test_dashboard_app import open_page

    path = recipe_file(tmp_path / "proj")
    cfg = small(f"{path}:build", params=("width=24", "tag=x")).replace(code_file=str(path), code_sha256="c0de" * 16)
    run_id = make_run(engine, cfg)
    at = open_page("views/new_run.py", clone=str(run_id))
    assert at.selectbox(key=forms.RECIPE_CHOICE_KEY).value == forms.OWN_RECIPE
    assert at.text_input(key=forms.OWN_RECIPE_KEY).value == f"{path}:build"
    assert at.session_state[forms.PARAMS_ROWS_KEY] == [["width", "24"], ["tag", "x"]]
    clone = RunConfig.from_dict(forms.values_from_state(at.session_state))
    assert clone.params == cfg.params and clone.recipe == cfg.recipe and clone.name == "recipe-test-clone"
    assert f"{path}:build" in " ".join(c.value for c in at.code)  # the `ddpdash launch` preview carries it
    assert "--param width=24 --param tag=x" in " ".join(c.value for c in at.code)


@pytest.mark.slow
def test_a_user_recipe_takes_amp_accumulation_and_a_comm_hook(engine: Engine, tmp_path: Path) -> None:
    path = recipe_file(tmp_path / "proj")
    cfg = small(f"{path}:build", amp="bf16", grad_accum_steps=2, comm_hook="fp16", bucket_cap_mb=1.0, max_steps=12)
    run = wait_final(engine, launch(engine, cfg, CPU_MACHINE), timeout=240)
    assert run.status == RunStatus.SUCCEEDED, run.error
    with Session(engine) as s:
        samples = metric_series(s, run.id, "samples_per_s", max_points=1000)
        ev = events(s, run.id)
    assert set(samples["rank"]) == {0, 1} and EventKind.DESYNC not in ev["kind"].tolist()
