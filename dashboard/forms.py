"""The New-run form, derived from RunConfig's fields (no hand-kept list of settings).

Widget keys, defaults, sections, validation and the command previews all come from here, so the
page only lays widgets out."""

from __future__ import annotations

import functools
import shlex
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddpdash.trainer.check import CheckFailure, CheckResult, RecipeReport
from ddpdash.trainer.config import (
    BUILTIN_RECIPES,
    DEMO_RECIPES,
    ConfigInvalid,
    Machine,
    RunConfig,
    check_script,
    field_choices,
    field_kind,
    settable_fields,
    validate,
)
from ddpdash.trainer.memory import estimate

KEY_PREFIX = "cfg_"
SECTION_ORDER = ("Run", "Devices", "Cluster", "Your script", "Model", "Your data", "Training", "Advanced DDP",
                 "Diagnostics", "Storage")
# What a script brings itself: the form hides these when one is chosen.
MODEL_SECTION_FIELDS = {"recipe", "dataset", "width", "depth", "seq_len", "num_heads", "num_samples", "data", "target",
                        "task", "val_fraction", "image_size", "arch"}
# The recipe is picked from a list, with a text box for the user's own: two widgets, one setting.
OWN_RECIPE = "your own recipe…"
RECIPE_CHOICE_KEY = KEY_PREFIX + "recipe"
OWN_RECIPE_KEY = KEY_PREFIX + "recipe_own"
RECIPE_CHOICES = (*BUILTIN_RECIPES, OWN_RECIPE)
# The parameters are a key/value table (st.data_editor): its state holds edits to the rows it began with,
# under a key that changes whenever the form is filled anew (a data editor's state cannot be assigned).
PARAMS_ROWS_KEY = "_params_rows"
PARAMS_EDITOR_KEY = "_params_editor_key"
PARAM_COLUMNS = ("key", "value")
# The data recipes' own settings.
DATA_FIELDS = {"table": {"data", "target", "task", "val_fraction"},
               "images": {"data", "val_fraction", "image_size", "arch"}}

# Size presets per model: width/depth/sequence settings a user picks instead of typing them.
PRESETS: dict[str, dict[str, dict[str, int]]] = {
    "linear": {"seed example": {}},
    "mlp": {"tiny": {"width": 16, "depth": 1}, "small": {"width": 64, "depth": 2},
            "medium": {"width": 512, "depth": 4}, "large (GPU)": {"width": 4096, "depth": 8}},
    "cnn": {"tiny": {"width": 8, "depth": 1}, "small": {"width": 32, "depth": 2},
            "medium": {"width": 128, "depth": 4}, "large (GPU)": {"width": 512, "depth": 6}},
    "transformer": {"tiny": {"width": 32, "depth": 1, "num_heads": 2, "seq_len": 32},
                    "small": {"width": 128, "depth": 2, "num_heads": 4, "seq_len": 64},
                    "medium": {"width": 384, "depth": 6, "num_heads": 6, "seq_len": 256},
                    "large (GPU)": {"width": 1024, "depth": 12, "num_heads": 16, "seq_len": 1024}},
}
# Fields that only matter for some models; the form hides the others.
MODEL_FIELDS = {"linear": set(), "mlp": {"width", "depth"}, "cnn": {"width", "depth"},
                "transformer": {"width", "depth", "num_heads", "seq_len"},
                "table": {"width", "depth"}, "images": {"width", "depth"}}  # an MLP; the small CNN
SIZE_FIELDS = {"width", "depth", "num_heads", "seq_len", "num_samples"}


@dataclass(frozen=True)
class FieldSpec:
    name: str
    label: str
    kind: str  # bool | int | float | str | choice | int_list
    help: str
    section: str
    choices: tuple[str, ...]
    default: Any

    @property
    def key(self) -> str:
        return KEY_PREFIX + self.name


@functools.cache
def field_specs() -> tuple[FieldSpec, ...]:
    """The form's fields, in section order (static: built once per process)."""
    default = RunConfig()
    specs = [
        FieldSpec(f.name, f.name.replace("_", " ").capitalize(), field_kind(f), f.metadata["help"],
                  f.metadata["section"], field_choices(f), getattr(default, f.name))
        for f in settable_fields()
    ]
    return tuple(sorted(specs, key=lambda s: SECTION_ORDER.index(s.section)))


def sections() -> dict[str, list[FieldSpec]]:
    out: dict[str, list[FieldSpec]] = {s: [] for s in SECTION_ORDER}
    for spec in field_specs():
        out[spec.section].append(spec)
    return out


def widget_state(cfg: RunConfig) -> dict[str, Any]:
    """Session-state values that pre-fill the form with `cfg` (used for defaults and Clone)."""
    data = {f.name: cfg.to_dict()[f.name] for f in settable_fields()}
    state = {KEY_PREFIX + name: (list(v) if isinstance(v, list) else v) for name, v in data.items()}
    for spec in field_specs():  # lists of text are text areas: one entry per line
        if spec.kind == "str_list" and spec.name != "params":
            state[spec.key] = "\n".join(getattr(cfg, spec.name))
    del state[KEY_PREFIX + "params"]
    state[PARAMS_ROWS_KEY] = [list(parse_param_text(entry)) for entry in cfg.params]
    state[PARAMS_EDITOR_KEY] = f"_params_{uuid.uuid4().hex[:8]}"
    state[RECIPE_CHOICE_KEY] = cfg.recipe if cfg.recipe in BUILTIN_RECIPES else OWN_RECIPE
    state[OWN_RECIPE_KEY] = "" if cfg.recipe in BUILTIN_RECIPES else cfg.recipe
    return state


def parse_param_text(entry: str) -> tuple[str, str]:
    key, _, value = entry.partition("=")
    return key.strip(), value.strip()


def params_from_editor(rows: list[list[str]], edits: Any) -> list[str]:
    """`key=value` entries from the editor's first rows and its edits ({"edited_rows": {i: {column: value}},
    "added_rows": [{column: value}], "deleted_rows": [i]}); blank rows are dropped, a key without a value
    is kept (validation names it)."""
    edits = edits if isinstance(edits, dict) else {}
    table = [dict(zip(PARAM_COLUMNS, row, strict=False)) for row in rows]
    for index, change in (edits.get("edited_rows") or {}).items():
        if 0 <= int(index) < len(table):
            table[int(index)].update(change)
    deleted = {int(i) for i in edits.get("deleted_rows") or []}
    table = [row for i, row in enumerate(table) if i not in deleted] + list(edits.get("added_rows") or [])
    out = []
    for row in table:
        key, value = str(row.get("key") or "").strip(), str(row.get("value") or "").strip()
        if key or value:
            out.append(f"{key}={value}")
    return out


def values_from_state(state: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for spec in field_specs():
        if spec.name == "recipe" and RECIPE_CHOICE_KEY in state:
            choice = state[RECIPE_CHOICE_KEY]
            out["recipe"] = str(state.get(OWN_RECIPE_KEY, "")).strip() if choice == OWN_RECIPE else choice
        elif spec.name == "params" and PARAMS_ROWS_KEY in state:
            out["params"] = params_from_editor(state[PARAMS_ROWS_KEY], state.get(state.get(PARAMS_EDITOR_KEY, "")))
        elif spec.key in state:
            value = state[spec.key]
            if spec.kind == "int" and isinstance(value, float) and value.is_integer():
                value = int(value)
            if spec.kind == "str_list" and isinstance(value, str):
                value = [line for line in value.splitlines() if line.strip()]
            out[spec.name] = value
    return out


@dataclass(frozen=True)
class FormResult:
    config: RunConfig | None
    errors: dict[str, list[str]]
    details: dict[str, list[str]] = field(default_factory=dict)  # the user's traceback under a message

    @property
    def ok(self) -> bool:
        return self.config is not None and not self.errors


def check_form(values: dict[str, Any], machine: Machine) -> FormResult:
    """Every problem with the form's values, keyed by field, before anything is launched."""
    try:
        cfg = RunConfig.from_dict(values)
    except ConfigInvalid as exc:
        return FormResult(None, exc.by_field())
    errors: dict[str, list[str]] = {}
    # A module is looked up (in a child process) at Launch, not at every keystroke.
    for e in [*validate(cfg, machine), *check_script(cfg, find_module=False)]:
        errors.setdefault(e.field, []).append(e.message)
    return FormResult(cfg, errors)


@dataclass(frozen=True)
class SweepPlan:
    axes: list[Any]  # trainer.sweep.Axis
    seeds: int
    description: str  # "6 run(s): 3 num_procs × 2 batch_size", or what is wrong with the grid
    ok: bool


def sweep_plan(cfg: RunConfig, grid_text: str, seeds: int) -> SweepPlan:
    """The form's Sweep section: one `setting=v1,v2` per line, and seeds; how many runs that makes (before
    anything is launched), or the one line that says what is wrong."""
    from ddpdash.trainer.sweep import describe, expand, parse_axis

    try:
        axes = [parse_axis(line) for line in grid_text.splitlines() if line.strip()]
        runs = expand(cfg, axes, seeds)
    except ConfigInvalid as exc:
        return SweepPlan([], seeds, str(exc.errors[0].message), False)
    return SweepPlan(axes, seeds, describe(cfg, axes, seeds) + f" — first: {runs[0].config.name}", True)


def needs_check(cfg: RunConfig) -> bool:
    """A recipe of the user's, or the user's data: checked in a child process before launch."""
    return not cfg.uses_demo and not cfg.uses_script


def failed_check(cfg: RunConfig, exc: ConfigInvalid) -> tuple[str, CheckResult]:
    """What a refused launch found, kept like a check's result so it shows next to the fields."""
    return cfg.to_json(), CheckResult(failures=[CheckFailure(e.field, e.message, e.detail) for e in exc.errors])


def check_report(cfg: RunConfig, stored: tuple[str, CheckResult] | None) -> RecipeReport | None:
    if stored is None or stored[0] != cfg.to_json():
        return None
    return stored[1].report


def check_failed(cfg: RunConfig, stored: tuple[str, CheckResult] | None) -> bool:
    return stored is not None and stored[0] == cfg.to_json() and bool(stored[1].failures)


def with_check(result: FormResult, stored: tuple[str, CheckResult] | None) -> FormResult:
    """The form's own findings, plus those of the last check when it checked this very config (a change to
    any setting makes it stale: it is not shown)."""
    if result.config is None or stored is None or stored[0] != result.config.to_json():
        return result
    errors = {k: list(v) for k, v in result.errors.items()}
    details: dict[str, list[str]] = {}
    for failure in stored[1].failures:
        errors.setdefault(failure.field, []).append(failure.message)
        if failure.detail:
            details.setdefault(failure.field, []).append(failure.detail)
    return FormResult(result.config, errors, details)


def visible(spec: FieldSpec, values: dict[str, Any]) -> bool:
    if spec.name in MODEL_SECTION_FIELDS and (values.get("script") or values.get("module")):
        return False  # the script brings its own model
    model = values.get("recipe", RunConfig.recipe)
    if spec.section == "Your data":
        return spec.name in DATA_FIELDS.get(model, set())
    if spec.name == "dataset":
        return model in DEMO_RECIPES and len(dataset_choices(model)) > 2
    if spec.name == "workdir":
        return model not in BUILTIN_RECIPES or bool(values.get("script") or values.get("module"))
    if spec.name in SIZE_FIELDS:
        if spec.name == "num_samples":
            return model == "linear" or values.get("dataset") == "regression"
        return spec.name in MODEL_FIELDS.get(model, set())
    if spec.name == "num_procs":
        return not values.get("devices")
    if spec.section == "Cluster" and spec.name != "launcher":
        return values.get("launcher") == "slurm"
    return True


def dataset_choices(model: str) -> tuple[str, ...]:
    from ddpdash.trainer.config import MODEL_DATASETS

    return ("auto", *MODEL_DATASETS.get(model, ()))


def amp_choices(machine: Machine, uses_cuda: bool) -> tuple[str, ...]:
    """Only what the chosen devices support: fp16 needs CUDA; bf16 on GPUs needs hardware support."""
    if uses_cuda:
        return ("off", "bf16", "fp16") if machine.bf16_gpu else ("off", "fp16")
    return ("off", "bf16")


def backend_label(backend: str, machine: Machine) -> str:
    if backend == "auto":
        return f"auto ({'nccl' if machine.has_cuda else 'gloo'} here)"
    if backend == "nccl" and not (machine.has_cuda and machine.nccl):
        return "nccl (unavailable: no CUDA)"
    if backend == "mpi" and machine.mpi_unavailable:
        return f"mpi (unavailable: {machine.mpi_unavailable})"
    return backend


def gpu_label(index: int, machine: Machine) -> str:
    name, mem = machine.gpus[index]
    return f"cuda:{index} · {name} · {mem:g} GiB"


def preset_names(model: str) -> list[str]:
    return list(PRESETS.get(model, {}))


def apply_preset(model: str, preset: str) -> dict[str, Any]:
    """Session-state updates for a size preset."""
    return {KEY_PREFIX + k: v for k, v in PRESETS.get(model, {}).get(preset, {}).items()}


def summary(cfg: RunConfig) -> dict[str, str]:
    """What the user should see next to the inputs: world size, global batch, effective lr."""
    lr_rule = f"{cfg.lr:g} × {cfg.world_size} ranks" if cfg.scale_lr else "no scaling"
    return {
        "World size": str(cfg.world_size),
        "Global batch": (f"{cfg.global_batch} = {cfg.batch_size} × {cfg.world_size} ranks"
                         f" × {cfg.grad_accum_steps} accum"),
        "Effective lr": f"{cfg.effective_lr:g} ({lr_rule})",
        "Backend": cfg.resolved_backend,
        "Memory (estimate)": estimate(cfg).text() if cfg.uses_demo else "your model's: Check shows its size",
    }


def command_previews(cfg: RunConfig) -> tuple[str, str]:
    """The equivalent `ddpdash launch` command and the torchrun command the launcher will run."""
    from ddpdash.trainer.commands import cli_command, torchrun_argv
    from ddpdash.trainer.rundir import RunDir

    run_dir = RunDir(Path("$DDPDASH_HOME/runs/run-NNNNN"))
    torchrun = torchrun_argv(cfg, run_dir, 0, python="python")
    torchrun[torchrun.index("--rdzv-id") + 1] = "ddpdash-run-NNNNN"
    torchrun[-1] = "NNNNN"
    return shlex.join(cli_command(cfg)), shlex.join(torchrun)


def job_script_preview(cfg: RunConfig) -> str:
    """The Slurm job script a launch of `cfg` submits, with the run's id and folder yet to be given."""
    from ddpdash.trainer.rundir import RunDir
    from ddpdash.trainer.slurm import job_script

    return job_script(cfg, "NNNNN", RunDir(Path("$DDPDASH_HOME/runs/run-NNNNN")), python="python")
