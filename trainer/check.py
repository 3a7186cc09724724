"""The check before launch: import the recipe, call its build(params) and take one batch through forward,
loss and backward on the CPU — in a short-lived child process (started by control.check_recipe, with a
time limit), never in the dashboard's or CLI's own process: a recipe is user code.

    python -m ddpdash.trainer.check --config CONFIG.json --report REPORT.json

The report (what the form and `ddpdash check` show) or the failures (each naming the setting to fix,
with the user's own traceback when their code raised) are written as JSON to REPORT.json.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

CHECK_MODULE = "ddpdash.trainer.check"
PACKAGE_ROOT = Path(__file__).resolve().parents[1]  # ddpdash's own frames are left out of a user's traceback


@dataclass(frozen=True)
class RecipeReport:
    """What one batch through the recipe showed, for the chosen world size and batch."""

    what: str
    about: str  # the recipe's own line (Recipe.about): the task a table recipe inferred, the classes found, …
    code_file: str  # the file build() is in ("" for a built-in recipe)
    parameters: int
    parameter_bytes: int
    train_size: int
    val_size: int | None
    batch: str  # its shapes and dtypes
    output: str
    loss: float
    metrics: dict[str, float]
    world_size: int
    shard_size: int  # samples per rank per epoch (DistributedSampler, drop_last)
    steps_per_epoch: int
    tokens_per_sample: int
    build_s: float  # import and build(): the user's own time
    batch_s: float  # the batch through forward, loss and backward

    def lines(self) -> list[tuple[str, str]]:
        val = "none" if self.val_size is None else f"{self.val_size:,}"
        rows = [
            ("Recipe", self.what + (f" ({self.code_file})" if self.code_file else "")),
            *([("About", self.about)] if self.about else []),
            ("Model", f"{self.parameters:,} parameters, {_size(self.parameter_bytes)}"),
            ("Data", f"{self.train_size:,} train, {val} validation samples"),
            ("Per rank", f"{self.shard_size:,} samples per epoch over {self.world_size} rank(s): "
                         f"{self.steps_per_epoch:,} steps per epoch"),
            ("Batch", self.batch),
            ("Output", self.output),
            ("Loss", f"{self.loss:.4g}" + "".join(f", {k} {v:.4g}" for k, v in self.metrics.items())),
            ("Took", f"build {self.build_s:.2f} s, one batch {self.batch_s:.2f} s"),
        ]
        if self.tokens_per_sample:
            rows.insert(3, ("Tokens", f"{self.tokens_per_sample:,} per sample"))
        return rows


def _size(n: int) -> str:
    if n < 2**10:
        return f"{n} B"
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


@dataclass(frozen=True)
class CheckFailure:
    field: str
    message: str
    detail: str = ""


@dataclass
class CheckResult:
    report: RecipeReport | None = None
    failures: list[CheckFailure] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps({"report": asdict(self.report) if self.report else None,
                           "failures": [asdict(f) for f in self.failures]})

    @classmethod
    def from_json(cls, text: str) -> CheckResult:
        data = json.loads(text)
        report = RecipeReport(**data["report"]) if data.get("report") else None
        return cls(report, [CheckFailure(**f) for f in data.get("failures", [])])


def describe(value: Any) -> str:
    """A batch's (or an output's) structure: dtypes and shapes of its tensors."""
    import torch

    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}[{', '.join(map(str, value.shape))}]"
    if isinstance(value, tuple | list):
        return "(" + ", ".join(describe(v) for v in value) + ")"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k}: {describe(v)}" for k, v in value.items()) + "}"
    return type(value).__name__


def user_traceback(exc: BaseException) -> str:
    """The traceback without ddpdash's own frames: what the user reads is where their code failed."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith(str(PACKAGE_ROOT))]
    return "".join(traceback.format_list(frames) + traceback.format_exception_only(type(exc), exc))


def run_check(config_path: Path) -> CheckResult:
    from .config import RunConfig
    from .recipes import RecipeError, load_recipe

    cfg = RunConfig.from_file(config_path)
    started = time.perf_counter()
    try:
        import torch

        torch.manual_seed(cfg.seed)
        recipe = load_recipe(cfg)
    except RecipeError as exc:
        return CheckResult(failures=[CheckFailure(exc.field, str(exc))])
    except Exception as exc:
        return CheckResult(failures=[CheckFailure("recipe", f"{cfg.what} raised {type(exc).__name__}: {exc}",
                                                  user_traceback(exc))])
    return try_one_batch(cfg, recipe, time.perf_counter() - started, code_file_of(cfg))


def code_file_of(cfg: Any) -> str:
    """The file the user's build() is in (imported by now), or "" for a built-in recipe."""
    import sys

    from .recipes import recipe_path

    if not cfg.uses_own_recipe:
        return ""
    where = cfg.recipe.rpartition(":")[0]
    if where.endswith(".py"):
        return str(recipe_path(cfg))
    return str(Path(getattr(sys.modules[where], "__file__", "") or "").resolve()) if where in sys.modules else ""


def try_one_batch(cfg: Any, recipe: Any, build_s: float, code_file: str = "") -> CheckResult:
    import torch
    from torch.utils.data import DataLoader

    from .recipes import forward

    failures: list[CheckFailure] = []
    train_size = len(recipe.train)
    val_size = None if recipe.val is None else len(recipe.val)
    shard = train_size // cfg.world_size
    per_step = cfg.batch_size * cfg.grad_accum_steps
    if train_size == 0:
        return CheckResult(failures=[CheckFailure("recipe", "Recipe.train is empty: there is nothing to train on")])
    if shard < per_step:
        failures.append(CheckFailure(
            "batch_size", f"is too large for the train set: {train_size:,} samples over {cfg.world_size} rank(s) "
                          f"is {shard:,} per rank, fewer than one step's {per_step:,} (batch × accumulation); "
                          f"one global batch is {cfg.global_batch:,}"))
    if val_size == 0:
        failures.append(CheckFailure("recipe", "Recipe.val is empty: give it samples, or leave it None"))
    started = time.perf_counter()
    stage = "taking a batch from Recipe.train"
    try:
        loader = DataLoader(recipe.train, batch_size=min(cfg.batch_size, train_size), shuffle=False,
                            collate_fn=recipe.collate_fn)
        batch = next(iter(loader))
        stage = "forward"
        out = forward(recipe, recipe.model, batch)
        stage = "loss"
        loss = recipe.loss(out, batch)
        if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
            shape = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
            failures.append(CheckFailure("recipe", f"Recipe.loss returned {shape}, not a scalar tensor: reduce it "
                                                   "(e.g. .mean())"))
            return CheckResult(failures=failures)
        stage = "backward"
        loss.backward()
        stage = "metrics"
        metrics = {k: float(v) for k, v in (recipe.metrics(out, batch) if recipe.metrics else {}).items()}
    except Exception as exc:
        failures.append(CheckFailure("recipe", f"{stage} raised {type(exc).__name__}: {exc}", user_traceback(exc)))
        return CheckResult(failures=failures)
    if failures:
        return CheckResult(failures=failures)
    params = list(recipe.model.parameters())
    report = RecipeReport(
        what=cfg.what, about=str(recipe.about), code_file=code_file, parameters=sum(p.numel() for p in params),
        parameter_bytes=sum(p.numel() * p.element_size() for p in params), train_size=train_size,
        val_size=val_size, batch=describe(batch), output=describe(out), loss=float(loss.detach()), metrics=metrics,
        world_size=cfg.world_size, shard_size=shard, steps_per_epoch=shard // per_step,
        tokens_per_sample=recipe.tokens_per_sample, build_s=build_s, batch_s=time.perf_counter() - started,
    )
    return CheckResult(report)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m {CHECK_MODULE}", description=__doc__)
    p.add_argument("--config", required=True, type=Path)
    p.add_argument("--report", required=True, type=Path)
    args = p.parse_args(argv)
    result = run_check(args.config)
    args.report.write_text(result.to_json())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
