"""The New-run form, derived from RunConfig's fields (no hand-kept list of settings).

Widget keys, defaults, sections, validation and the command previews all come from here, so the
page only lays widgets out."""

from __future__ import annotations

import functools
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddpdash.trainer.config import (
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
SECTION_ORDER = ("Run", "Devices", "Your script", "Model", "Training", "Advanced DDP")
MODEL_SECTION_FIELDS = {"model", "dataset", "width", "depth", "seq_len", "num_heads", "num_samples"}

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
                "transformer": {"width", "depth", "num_heads", "seq_len"}}
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
    state[KEY_PREFIX + "script_args"] = "\n".join(cfg.script_args)  # text areas: one entry per line
    state[KEY_PREFIX + "params"] = "\n".join(cfg.params)
    return state


def values_from_state(state: Any) -> dict[str, Any]:
    out = {}
    for spec in field_specs():
        if spec.key in state:
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


def visible(spec: FieldSpec, values: dict[str, Any]) -> bool:
    if spec.name in MODEL_SECTION_FIELDS and (values.get("script") or values.get("module")):
        return False  # the script brings its own model
    model = values.get("model", RunConfig.model)
    if spec.name in SIZE_FIELDS:
        if spec.name == "num_samples":
            return model == "linear" or values.get("dataset") == "regression"
        return spec.name in MODEL_FIELDS.get(model, set())
    if spec.name == "num_procs":
        return not values.get("devices")
    return True


def dataset_choices(model: str) -> tuple[str, ...]:
    from ddpdash.trainer.config import MODEL_DATASETS

    return ("auto", *MODEL_DATASETS[model])


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
        "Memory (estimate)": estimate(cfg).text(),
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
