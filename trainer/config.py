"""RunConfig: the single source of truth for a run.

The dashboard form, the CLI flags, validation, the stored JSON and the torchrun argv are all
derived from the dataclass below; each field's metadata carries its help text, choices and the
form section it belongs to. This module imports nothing heavy (no torch) so the CLI and UI stay fast.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from .mpi import NO_MPI_IN_TORCH

Backend = Literal["auto", "nccl", "gloo", "mpi"]
Amp = Literal["off", "bf16", "fp16"]
Optimizer = Literal["sgd", "adam", "adamw"]
Task = Literal["auto", "classification", "regression"]
Dataset = Literal["auto", "regression", "digits", "text"]
CommHook = Literal["none", "fp16", "bf16", "powersgd"]
Launcher = Literal["local", "slurm"]

# The data each model trains on; "auto" picks the first.
MODEL_DATASETS: dict[str, tuple[str, ...]] = {
    "linear": ("regression",),
    "mlp": ("digits", "regression"),
    "cnn": ("digits",),
    "transformer": ("text",),
}
# Recipes ddpdash brings: the demo models on data that ships with Python and scikit-learn, and the two
# for a user's data without code. Anything else is the user's own, named `path/to/file.py:build` or
# `package.module:build`.
DEMO_RECIPES = tuple(MODEL_DATASETS)
DATA_RECIPES = ("table", "images")
BUILTIN_RECIPES = (*DEMO_RECIPES, *DATA_RECIPES)
# Keys that earlier versions stored under another name: their runs still open, clone and compare.
RENAMED_KEYS = {"model": "recipe", "script_sha256": "code_sha256"}
MAX_PROCS_PER_CORE = 4
MAX_STEPS = 2**31 - 1  # steps are 32-bit integers in the store (PostgreSQL INTEGER)


def _f(default: Any, help: str, section: str = "Training", **extra: Any) -> Any:
    return field(default=default, metadata={"help": help, "section": section, **extra})


@dataclass(frozen=True)
class RunConfig:
    name: str = _f("ddp-run", "A name to find the run by.", "Run")
    group: str = _f("", "A group to find and compare runs by (a sweep gives each of its grid points one).", "Run")
    devices: tuple[int, ...] = _f(
        (), "CUDA device indices, one rank each (empty: CPU processes).", "Devices", list=True
    )
    num_procs: int = _f(2, "Number of CPU processes (ranks); set from devices when GPUs are chosen.", "Devices",
                        min=1, max=1024)
    backend: Backend = _f("auto", "Process-group backend; auto = nccl with CUDA devices, else gloo; mpi where torch "
                             "was built with it (ranks started by mpirun).", "Devices")
    launcher: Launcher = _f("local", "Where the ranks run: local (this machine) or slurm (a job on your Slurm cluster, "
                                     "submitted with sbatch).", "Cluster")
    nodes: int = _f(1, "Slurm: nodes, each running num_procs ranks (world size = nodes × num_procs); more than one "
                       "needs a PostgreSQL store every node reaches and a run folder they share.", "Cluster",
                    min=1, max=1024)
    partition: str = _f("", "Slurm: the partition (empty: the cluster's default).", "Cluster")
    time_limit: str = _f("", "Slurm: the job's time limit, e.g. 00:30:00 or 1-12:00:00 (empty: the partition's).",
                         "Cluster", flag_aliases=("time",))
    account: str = _f("", "Slurm: the account to charge (empty: yours by default).", "Cluster")
    qos: str = _f("", "Slurm: the quality of service (empty: the default).", "Cluster")
    sbatch_options: tuple[str, ...] = _f((), "Slurm: more sbatch options, one --key=value per line (e.g. "
                                             "--constraint=a100); never a shell string.", "Cluster", list=True)
    recipe: str = _f("mlp", "What to train: a demo (linear: the seed example, mlp/cnn: digits, transformer: a text "
                            "LM), your data (table, images), or your own recipe as path/to/file.py:build or "
                            "package.module:build.", "Model")
    dataset: Dataset = _f("auto", "Data set; auto picks the model's own.", "Model")
    width: int = _f(64, "Hidden width (mlp units, cnn channels, transformer d_model).", "Model", min=1,
                    max=65_536)
    depth: int = _f(2, "Number of hidden layers / transformer blocks.", "Model", min=1, max=256)
    seq_len: int = _f(64, "Transformer context length in tokens.", "Model", min=2, max=4096)
    num_heads: int = _f(4, "Transformer attention heads (must divide width).", "Model", min=1, max=256)
    num_samples: int = _f(4096, "Synthetic regression samples.", "Model", min=16, max=100_000_000)
    params: tuple[str, ...] = _f((), "Your parameters, key=value, one per line: build(params) of your recipe, or "
                                     "ddpdash.init().params in your script; typed by value (int, float, "
                                     "true/false, else text).", "Model", list=True)
    data: str = _f("", "Your data: a CSV or Parquet file (table), or a folder with one sub-folder per class "
                       "(images).", "Your data")
    target: str = _f("", "The table's column to predict.", "Your data")
    task: Task = _f("auto", "classification or regression; auto: classes when the target is text or a few "
                            "whole numbers.", "Your data")
    val_fraction: float = _f(0.2, "Share of your data held out for validation (split by the seed, the same on "
                                  "every rank).", "Your data", min=0.0, max=0.9)
    image_size: int = _f(32, "Images are resized to this many pixels square.", "Your data", min=8, max=1024)
    arch: str = _f("cnn", "Image model: cnn (small, sized by width and depth) or a torchvision architecture "
                          "by name (resnet18, …; needs torchvision), trained from scratch.", "Your data")
    batch_size: int = _f(32, "Batch size per rank (global batch = batch × ranks × accumulation).", min=1,
                        max=1_048_576)
    amp: Amp = _f("off", "Mixed precision: bf16 (CPU or recent GPU) or fp16 with GradScaler (CUDA).")
    optimizer: Optimizer = _f("sgd", "Optimizer.")
    lr: float = _f(0.05, "Base learning rate (per single-rank batch).", min=0.0, max=1e4)
    scale_lr: bool = _f(True, "Linear scaling rule: effective lr = lr × world size.")
    warmup_steps: int = _f(0, "Linear lr warm-up steps (helps large scaled lrs).", min=0, max=MAX_STEPS)
    num_epochs: int = _f(0, "Epochs to train (0: bounded by max_steps alone).", min=0, max=1_000_000)
    max_steps: int = _f(200, "Optimizer steps to train (0: bounded by num_epochs alone).", min=0, max=MAX_STEPS)
    seed: int = _f(0, "Random seed (same on every rank, so replicas start identical).", min=0, max=2**32 - 1)
    num_workers: int = _f(0, "DataLoader worker processes per rank.", min=0, max=64)
    grad_accum_steps: int = _f(1, "Micro-batches per optimizer step (no_sync between).", "Advanced DDP", min=1,
                              max=4096)
    bucket_cap_mb: float = _f(25.0, "DDP gradient bucket size in MB.", "Advanced DDP", min=0.0, max=10_240.0)
    find_unused_parameters: bool = _f(False, "Let DDP look for parameters unused in forward.", "Advanced DDP")
    gradient_as_bucket_view: bool = _f(False, "Gradients as views into DDP buckets (saves memory).", "Advanced DDP")
    static_graph: bool = _f(False, "Tell DDP the graph never changes between steps.", "Advanced DDP")
    comm_hook: CommHook = _f("none", "Gradient communication hook (bf16 needs nccl).", "Advanced DDP")
    log_every: int = _f(1, "Log metrics every N steps.", "Advanced DDP", min=1, max=MAX_STEPS)
    checkpoint_every: int = _f(50, "Save a checkpoint every N steps (0: never).", "Advanced DDP", min=0,
                              max=MAX_STEPS)
    sync_check_every: int = _f(50, "Compare parameter checksums across ranks every N steps (0: never).",
                               "Advanced DDP", min=0, max=MAX_STEPS)
    max_restarts: int = _f(0, "Times torchrun restarts the group after a rank fails.", "Advanced DDP", min=0, max=10)
    pg_timeout_s: int = _f(120, "Process-group timeout in seconds (a hang fails after this).", "Advanced DDP",
                           min=10, max=86_400)
    hang_after_s: int = _f(60, "A rank without a new step for this long (and for ten of its usual intervals "
                               "between steps) is flagged hung: its stacks are read and an alert sent.",
                           "Diagnostics", min=5, max=86_400)
    webhook: str = _f("", "A URL that gets a JSON POST when the run succeeds, fails, is lost or hangs, and on a "
                          "desync, a non-finite loss or a straggler (Slack and Mattermost show its text as is); "
                          "empty: DDPDASH_WEBHOOK_URL, if set.", "Diagnostics")
    keep_raw_steps: int = _f(0, "Keep raw points for the newest N steps only (0: all). Older steps live on as "
                                "rollups (each bucket's min, max and mean): a long run's database stops "
                                "growing. Applied as the run trains and by `ddpdash compact`.", "Storage",
                             min=0, max=MAX_STEPS)
    memory_check: bool = _f(True, "Refuse a run whose memory estimate exceeds what this machine (or GPU) has free.",
                            "Advanced DDP")
    script: str = _f("", "Your own torchrun script (a .py file) instead of a built-in model; it logs with "
                         "ddpdash.log().", "Your script")
    module: str = _f("", "…or your module, run as python -m MODULE (e.g. mypkg.train).", "Your script")
    script_args: tuple[str, ...] = _f((), "Your script's arguments, one per line (never a shell string).",
                                      "Your script", list=True)
    workdir: str = _f("", "Your project folder: the ranks' working directory, first on their import path "
                          "(default: the script's or recipe's folder, or here for a module).", "Your script")
    code_sha256: str = _f("", "Your script's or recipe's file content hash, recorded at launch: runs of "
                              "different code tell apart.", "Your script", derived=True)
    code_file: str = _f("", "The file your recipe's build() is in, found at launch.", "Your script", derived=True)

    def __post_init__(self) -> None:
        # Devices decide the world size when GPUs are chosen: one source, no second count to agree.
        if self.devices and self.num_procs != len(self.devices):
            object.__setattr__(self, "num_procs", len(self.devices))

    # ---- derived values -------------------------------------------------------------------
    @property
    def ranks_per_node(self) -> int:
        return len(self.devices) if self.devices else self.num_procs

    @property
    def world_size(self) -> int:
        return self.ranks_per_node * self.nodes

    @property
    def on_slurm(self) -> bool:
        return self.launcher == "slurm"

    @property
    def uses_cuda(self) -> bool:
        """GPUs: chosen by index here, or on Slurm asked of the cluster with the nccl backend (one per rank)."""
        return bool(self.devices) or (self.on_slurm and self.backend == "nccl")

    @property
    def uses_script(self) -> bool:
        return bool(self.script or self.module)

    @property
    def uses_own_recipe(self) -> bool:
        return not self.uses_script and self.recipe not in BUILTIN_RECIPES

    @property
    def uses_demo(self) -> bool:
        """A demo recipe: built-in model and data, nothing of the user's to check before launch."""
        return not self.uses_script and self.recipe in DEMO_RECIPES

    @property
    def what(self) -> str:
        """What the run trains, in a word: the demo, the user's data or recipe, or their script or module."""
        if self.module:
            return f"-m {self.module}"
        if self.script:
            return Path(self.script).name
        if self.recipe in DATA_RECIPES:
            return f"{self.recipe} ({Path(self.data).name})"
        if self.uses_own_recipe:
            where, _, function = self.recipe.rpartition(":")
            return f"{Path(where).name if where.endswith('.py') else where}:{function}"
        return self.recipe

    @property
    def provenance(self) -> str:
        """What the run trains and from which code: the recipe or script, its file and content hash."""
        file = self.code_file or self.script
        parts = [self.what, *([file] if file and file not in self.what else []),
                 *([f"sha256 {self.code_sha256[:12]}"] if self.code_sha256 else [])]
        return " · ".join(parts)

    @property
    def resolved_backend(self) -> str:
        if self.backend == "auto":
            return "nccl" if self.uses_cuda else "gloo"
        return self.backend

    @property
    def resolved_dataset(self) -> str:
        datasets = MODEL_DATASETS.get(self.recipe, ("",))
        return datasets[0] if self.dataset == "auto" else self.dataset

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.world_size * self.grad_accum_steps

    @property
    def effective_lr(self) -> float:
        return self.lr * self.world_size if self.scale_lr else self.lr

    # ---- serialisation --------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["devices"] = list(self.devices)
        out["script_args"] = list(self.script_args)
        out["params"] = list(self.params)
        return out

    @property
    def parameters(self) -> dict[str, bool | int | float | str]:
        """The user's parameters, each typed by its value."""
        return dict(parse_param(entry) for entry in self.params)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: Any) -> RunConfig:
        """Build from plain data, checking every field's type; raises ConfigInvalid naming each field."""
        if not isinstance(data, dict):
            raise ConfigInvalid([ConfigError("config", f"must be a JSON object, got {type(data).__name__}")])
        errors: list[ConfigError] = []
        known = {f.name: f for f in dataclasses.fields(cls)}
        data = {RENAMED_KEYS.get(k, k): v for k, v in data.items()
                if not (k in RENAMED_KEYS and RENAMED_KEYS[k] in data)}  # an old key beside its new one: the new
        for key in data:
            if key not in known:
                errors.append(ConfigError("config", f"has an unknown setting {key!r}; known: {', '.join(known)}"))
        values: dict[str, Any] = {}
        for name, f in known.items():
            if name in data:
                try:
                    values[name] = coerce_field(f, data[name])
                except ValueError as exc:
                    errors.append(ConfigError(name, str(exc)))
        if errors:
            raise ConfigInvalid(errors)
        return cls(**values)

    @classmethod
    def from_json(cls, text: str) -> RunConfig:
        return cls.from_dict(parse_settings(text))

    @classmethod
    def from_file(cls, path: Path) -> RunConfig:
        return cls.from_dict(read_settings(path))

    def replace(self, **changes: Any) -> RunConfig:
        return RunConfig.from_dict({**self.to_dict(), **changes})


MAX_CONFIG_BYTES = 1 << 20  # a run's settings are a few hundred bytes; anything near this is not a config


def read_settings(path: Path) -> dict[str, Any]:
    """A JSON file of settings, read safely: at most MAX_CONFIG_BYTES (so /dev/zero cannot exhaust memory),
    UTF-8, one JSON object. ConfigInvalid (field "config") names what is wrong."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigInvalid([ConfigError("config", f"file {path} cannot be read: {exc.strerror}")]) from exc
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigInvalid([ConfigError("config", f"file {path} is larger than {MAX_CONFIG_BYTES >> 20} MiB")])
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigInvalid([ConfigError("config", f"file {path} is not UTF-8 text (byte {exc.start})")]) from exc
    return parse_settings(text, f"file {path}")


def parse_settings(text: str, where: str = "text") -> dict[str, Any]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigInvalid([ConfigError("config", f"{where} is not valid JSON: {exc}")]) from exc
    except RecursionError as exc:
        raise ConfigInvalid([ConfigError("config", f"{where} is nested too deeply to be a config")]) from exc
    if not isinstance(data, dict):
        raise ConfigInvalid([ConfigError("config", f"{where} must hold a JSON object of settings, "
                                                   f"got {type(data).__name__}")])
    return data


# ---- field introspection (the form and the CLI are generated from this) ---------------------
def config_fields() -> list[dataclasses.Field[Any]]:
    return list(dataclasses.fields(RunConfig))


def settable_fields() -> list[dataclasses.Field[Any]]:
    """The fields a user sets (form, CLI flags); derived ones (a script's hash) are recorded by the launch."""
    return [f for f in config_fields() if not f.metadata.get("derived")]


@functools.cache
def _hints() -> dict[str, Any]:
    return typing.get_type_hints(RunConfig)  # evaluates every annotation: once per process is enough


def field_kind(f: dataclasses.Field[Any]) -> str:
    """One of: bool, int, float, str, choice, int_list, str_list."""
    hint = _hints()[f.name]
    if get_origin(hint) is Literal:
        return "choice"
    if get_origin(hint) is tuple:
        return "str_list" if get_args(hint)[0] is str else "int_list"
    return {bool: "bool", int: "int", float: "float", str: "str"}[hint]


def field_choices(f: dataclasses.Field[Any]) -> tuple[str, ...]:
    hint = _hints()[f.name]
    return tuple(get_args(hint)) if get_origin(hint) is Literal else ()


def coerce_field(f: dataclasses.Field[Any], value: Any) -> Any:
    """Check (and gently convert) one raw value for a field; ValueError says what was expected."""
    kind = field_kind(f)
    if kind == "bool":
        if isinstance(value, bool):
            return value
        raise ValueError(f"must be true or false, got {value!r}")
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ValueError(f"must be a whole number, got {value!r}")
        return value
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"must be a number, got {value!r}")
        return float(value)
    if kind == "str":
        if not isinstance(value, str):
            raise ValueError(f"must be text, got {value!r}")
        return value
    if kind == "choice":
        choices = field_choices(f)
        if value not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}; got {value!r}")
        return value
    if kind == "str_list":
        if not isinstance(value, list | tuple) or any(not isinstance(v, str) for v in value):
            raise ValueError(f"must be a list of text arguments, got {value!r}")
        if any("\x00" in v for v in value):
            raise ValueError("must not contain NUL bytes")
        return tuple(value)
    if kind == "int_list":
        if not isinstance(value, list | tuple) or any(
            isinstance(v, bool) or not isinstance(v, int) for v in value
        ):
            raise ValueError(f"must be a list of whole numbers, got {value!r}")
        return tuple(value)
    raise AssertionError(kind)  # pragma: no cover


# ---- validation ----------------------------------------------------------------------------
@dataclass(frozen=True)
class ConfigError:
    field: str
    message: str
    detail: str = ""  # the user's own traceback, when their code raised

    def __str__(self) -> str:
        return f"{self.field} {self.message}"


class ConfigInvalid(ValueError):
    """One or more settings are wrong; `errors` names each field and the fix."""

    def __init__(self, errors: list[ConfigError]) -> None:
        self.errors = errors
        super().__init__("; ".join(str(e) for e in errors))

    def by_field(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for e in self.errors:
            out.setdefault(e.field, []).append(e.message)
        return out


def webhook_problem(url: str) -> str | None:
    """Why `url` cannot be a webhook, or None: an http(s) URL with a host, at most 2,000 characters."""
    from urllib.parse import urlsplit

    if len(url) > 2000 or not url.isprintable() or any(c.isspace() for c in url):
        return "must be one URL of at most 2,000 characters, without spaces"
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        return f"is not a URL: {exc}"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"must be an http:// or https:// URL with a host, got {url!r}"
    return None


@dataclass(frozen=True)
class Machine:
    """What this machine offers; validation checks a config against it."""

    cpu_count: int
    gpus: tuple[tuple[str, float], ...] = ()  # (name, memory GiB) per CUDA index
    bf16_gpu: bool = False
    nccl: bool = False
    mpi_unavailable: str | None = NO_MPI_IN_TORCH  # why the mpi backend cannot run here; None where it can
    memory_free_bytes: int = 0  # what the OS has available now; 0: unknown (no memory check)

    @property
    def has_cuda(self) -> bool:
        return bool(self.gpus)


def validate(cfg: RunConfig, machine: Machine) -> list[ConfigError]:
    errors: list[ConfigError] = []

    def err(name: str, message: str) -> None:
        errors.append(ConfigError(name, message))

    for f in config_fields():
        low, high = f.metadata.get("min"), f.metadata.get("max")
        value = getattr(cfg, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            err(f.name, f"must be a finite number, got {value}")
        elif low is not None and value < low:
            err(f.name, f"must be ≥ {low}, got {value}")
        elif high is not None and value > high:
            err(f.name, f"must be ≤ {high:,}, got {value:,}")
    if not cfg.name.strip():
        err("name", "must not be empty")
    elif len(cfg.name) > 200 or not cfg.name.isprintable():
        err("name", "must be at most 200 printable characters")
    if len(cfg.group) > 200 or not cfg.group.isprintable():
        err("group", "must be at most 200 printable characters")
    if cfg.webhook and (why := webhook_problem(cfg.webhook)):
        err("webhook", why)

    if cfg.on_slurm:
        errors += slurm_errors(cfg)
    elif cfg.nodes > 1:
        err("nodes", f"is {cfg.nodes}, but the local launcher runs on this one machine: set launcher to slurm for "
                     "more nodes")
    if cfg.on_slurm:
        pass  # the nodes are not this machine: their cores, GPUs and memory are Slurm's to check
    elif cfg.devices:
        if len(set(cfg.devices)) != len(cfg.devices):
            err("devices", f"lists a GPU twice: {list(cfg.devices)}")
        if not machine.has_cuda:
            err("devices", "names CUDA GPUs but this machine has none; leave devices empty and set num_procs")
        else:
            missing = [d for d in cfg.devices if d < 0 or d >= len(machine.gpus)]
            if missing:
                top_index = len(machine.gpus) - 1
                err("devices", f"GPU index {missing} does not exist; this machine has indices 0–{top_index}")
    else:
        top = machine.cpu_count * MAX_PROCS_PER_CORE
        if cfg.num_procs > top:
            err("num_procs", f"{cfg.num_procs} processes on {machine.cpu_count} cores would thrash; use at most {top}")

    if cfg.resolved_backend == "nccl" and not cfg.on_slurm:
        if not machine.has_cuda:
            err("backend", "nccl needs CUDA GPUs and this machine has none; use gloo (or auto)")
        elif not cfg.devices:
            err("backend", "nccl needs GPUs: choose devices, or use gloo for CPU processes")
        elif not machine.nccl:
            err("backend", "this PyTorch build has no NCCL; use gloo")

    if cfg.amp == "fp16" and not cfg.uses_cuda:
        err("amp", "fp16 on CPU is 20–30× slower than fp32; use bf16 on CPU (fp16 with GradScaler is for CUDA)")
    if cfg.amp == "bf16" and cfg.devices and machine.has_cuda and not machine.bf16_gpu:
        err("amp", "these GPUs do not support bf16; use fp16")

    if cfg.resolved_backend == "mpi":
        if machine.mpi_unavailable:
            err("backend", f"mpi is unavailable here: {machine.mpi_unavailable}")
        if cfg.devices:
            err("backend", "mpi runs CPU processes here; use nccl for GPUs")
        if cfg.max_restarts:
            err("max_restarts", "mpirun does not restart failed ranks: set it to 0 for the mpi backend")

    if cfg.comm_hook == "bf16" and cfg.resolved_backend != "nccl":
        err("comm_hook", "the bf16 compression hook needs CUDA and nccl; use fp16 or powersgd with gloo")

    if not cfg.uses_script:
        errors += recipe_errors(cfg)
    if cfg.recipe == "transformer" and cfg.width % max(cfg.num_heads, 1):
        err("num_heads", f"must divide width ({cfg.width}); {cfg.num_heads} does not")
    if cfg.num_epochs == 0 and cfg.max_steps == 0:
        err("max_steps", "and num_epochs are both 0: set at least one so the run can end")
    if cfg.lr <= 0 and math.isfinite(cfg.lr):
        err("lr", f"must be > 0, got {cfg.lr}")
    for entry in cfg.params:
        key, sep, _ = entry.partition("=")
        if not sep or not key.strip().isidentifier():
            err("params", f"must be key=value with a name for a key, got {entry!r}")
    if cfg.uses_script and cfg.recipe not in DEMO_RECIPES:
        err("recipe", f"and {'script' if cfg.script else 'module'} are both set: your script brings its own model; "
                      "clear one of them")
    if cfg.script and cfg.module:
        err("module", "and script are both set: choose one (a file, or a module run with -m)")
    if cfg.script_args and not cfg.uses_script:
        err("script_args", "are for your own script: set script (or module) too")
    if cfg.module and not all(part.isidentifier() for part in cfg.module.split(".")):
        err("module", f"must be a dotted module name like mypkg.train, got {cfg.module!r}")
    # The user's own model has no estimate before the check; a Slurm node's memory is not this machine's.
    if cfg.memory_check and not errors and cfg.uses_demo and not cfg.on_slurm:
        why = memory_problem(cfg, machine)
        if why:
            err("memory_check", f"refuses this run: it {why}. Make it smaller, or turn memory_check off "
                                "(--no-memory-check) to launch it anyway")
    return errors


def slurm_errors(cfg: RunConfig) -> list[ConfigError]:
    """What a Slurm launch's settings say of themselves (the cluster judges the rest when it is submitted)."""
    from .slurm import option_problem, time_limit_problem, word_problem

    errors: list[ConfigError] = []
    if cfg.devices:
        errors.append(ConfigError("devices", "are this machine's GPU indices; on Slurm choose the nccl backend and "
                                             "num_procs GPUs per node, and Slurm assigns them"))
    if cfg.resolved_backend == "mpi":
        errors.append(ConfigError("backend", "mpi is not offered on Slurm: use gloo, or nccl for GPUs"))
    for name in ("partition", "account", "qos"):
        why = word_problem(getattr(cfg, name))
        if why:
            errors.append(ConfigError(name, why))
    why = time_limit_problem(cfg.time_limit)
    if why:
        errors.append(ConfigError("time_limit", why))
    for option in cfg.sbatch_options:
        why = option_problem(option)
        if why:
            errors.append(ConfigError("sbatch_options", why))
    return errors


def recipe_errors(cfg: RunConfig) -> list[ConfigError]:
    """What the recipe's name and its data settings say of themselves; the check (trainer/check.py) then
    imports the recipe and takes a batch through it."""
    errors: list[ConfigError] = []
    if cfg.recipe not in BUILTIN_RECIPES and not is_recipe_spec(cfg.recipe):
        errors.append(ConfigError("recipe", f"must be one of {', '.join(BUILTIN_RECIPES)}, or yours as "
                                            f"path/to/file.py:build or package.module:build; got {cfg.recipe!r}"))
    if cfg.dataset != "auto" and cfg.dataset not in MODEL_DATASETS.get(cfg.recipe, ()):
        trains_on = " or ".join(MODEL_DATASETS.get(cfg.recipe, ("its own data",)))
        errors.append(ConfigError("dataset", f"is for the demo recipes: {cfg.recipe} trains on {trains_on}, not "
                                             f"{cfg.dataset} (leave it auto)"))
    if cfg.recipe in DATA_RECIPES and not cfg.data.strip():
        what = "a CSV or Parquet file" if cfg.recipe == "table" else "a folder with one sub-folder per class"
        errors.append(ConfigError("data", f"must name your data for the {cfg.recipe} recipe: {what}"))
    if cfg.recipe == "table" and not cfg.target.strip():
        errors.append(ConfigError("target", "must name the table's column to predict"))
    if cfg.data and cfg.recipe not in DATA_RECIPES:
        errors.append(ConfigError("data", f"is read by the table and images recipes, not by {cfg.recipe}: "
                                          "a recipe of yours loads its own data"))
    if cfg.recipe == "images" and not (cfg.arch == "cnn" or cfg.arch.isidentifier()):
        errors.append(ConfigError("arch", f"must be cnn or a torchvision model's name like resnet18, got {cfg.arch!r}"))
    return errors


def is_recipe_spec(text: str) -> bool:
    """`path/to/file.py:build` or `package.module:build`."""
    where, sep, function = text.rpartition(":")
    if not sep or not function.isidentifier() or not where.strip():
        return False
    return where.endswith(".py") or all(part.isidentifier() for part in where.split("."))


def memory_problem(cfg: RunConfig, machine: Machine) -> str | None:
    from .memory import estimate, fits

    gpu_bytes = min((machine.gpus[d][1] * 2**30 for d in cfg.devices if 0 <= d < len(machine.gpus)), default=None)
    return fits(estimate(cfg), machine.memory_free_bytes, gpu_bytes)


def check(cfg: RunConfig, machine: Machine) -> RunConfig:
    """Raise ConfigInvalid with every problem at once; return the config when it is sound."""
    errors = validate(cfg, machine)
    if errors:
        raise ConfigInvalid(errors)
    return cfg


def detect_machine() -> Machine:
    """CPU count and CUDA devices; imports torch lazily (≈1 s), so callers cache the result."""
    import torch

    cpu = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    gpus: list[tuple[str, float]] = []
    bf16 = False
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            gpus.append((props.name, round(props.total_memory / 2**30, 1)))
        bf16 = torch.cuda.is_bf16_supported()
    nccl = bool(torch.distributed.is_available() and torch.distributed.is_nccl_available())
    import psutil

    from . import mpi

    return Machine(cpu_count=cpu, gpus=tuple(gpus), bf16_gpu=bf16, nccl=nccl, mpi_unavailable=mpi.detect(),
                   memory_free_bytes=int(psutil.virtual_memory().available))




def parse_param(entry: str) -> tuple[str, bool | int | float | str]:
    """`key=value`, the value typed as it reads: true/false, a whole number, a number, else text."""
    key, _, raw = entry.partition("=")
    raw = raw.strip()
    value: bool | int | float | str
    if raw.lower() in ("true", "false"):
        value = raw.lower() == "true"
    else:
        try:
            value = int(raw)
        except ValueError:
            try:
                value = float(raw)
            except ValueError:
                value = raw
    return key.strip(), value


# ---- your own script: checks that look at the file system ---------------------------------------------
def script_workdir(cfg: RunConfig) -> Path:
    if cfg.workdir:
        return Path(cfg.workdir).expanduser()
    return Path(cfg.script).expanduser().resolve().parent if cfg.script else Path.cwd()


def script_file(cfg: RunConfig, find_module: bool = True) -> Path | None:
    """The file a script run runs: the script (relative to workdir when one is given, else to here), or
    the file `-m module` resolves to from workdir (looked up in a child process; None if not found, or
    when `find_module` is false)."""
    if cfg.script:
        path = Path(cfg.script).expanduser()
        if path.is_absolute():
            return path
        return script_workdir(cfg) / path if cfg.workdir else path.resolve()
    if cfg.module and find_module:
        origin = module_origin(cfg.module, script_workdir(cfg))
        return Path(origin) if origin else None
    return None


def module_not_found(cfg: RunConfig) -> ConfigError:
    return ConfigError("module", f"{cfg.module} cannot be found from {script_workdir(cfg)}")


def check_script(cfg: RunConfig, find_module: bool = True) -> list[ConfigError]:
    """Before a script run is launched: the file exists and can be read, the working directory exists,
    `-m module` can be found from it (looked up in a child process with a time limit: finding a
    package runs its __init__, which is user code). Each problem names its field."""
    errors: list[ConfigError] = []
    if not cfg.uses_script:
        return errors
    if cfg.workdir and not script_workdir(cfg).is_dir():
        errors.append(ConfigError("workdir", f"{cfg.workdir} is not a folder"))
    if cfg.script:
        path = script_file(cfg)
        assert path is not None
        if not path.is_file():
            errors.append(ConfigError("script", f"{cfg.script} is not a file"))
        elif not os.access(path, os.R_OK):
            errors.append(ConfigError("script", f"{cfg.script} cannot be read"))
    if cfg.module and find_module and not errors and script_file(cfg) is None:
        errors.append(module_not_found(cfg))
    return errors


def module_origin(module: str, workdir: Path, timeout_s: float = 30.0) -> str | None:
    """The file `python -m module` would run, from `workdir`, found in a child process; None if none."""
    import subprocess
    import sys

    probe = ("import importlib.util, sys\n"
             "spec = importlib.util.find_spec(sys.argv[1])\n"
             "print(spec.origin if spec and spec.origin else '')")
    try:
        out = subprocess.run([sys.executable, "-c", probe, module], cwd=workdir, capture_output=True, text=True,
                             timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired):
        return None
    origin = out.stdout.strip()
    return origin if out.returncode == 0 and origin else None
