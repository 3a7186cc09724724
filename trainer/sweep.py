"""Sweeps: a grid over any run settings — RunConfig's fields, the user's parameters (`param.width`) and a
script's own arguments (`arg.--lr`) — times a number of seeds, every run validated before any is queued.

    ddpdash sweep --grid num_procs=1,2,4 --grid batch_size=32,64 --seeds 3 --max-steps 200

Values are split on commas (on semicolons when a value holds commas: `devices=0;0,1`). Each run is named
`<name>-<its values>` and grouped by its grid point (seeds of one point share a group), so Compare's
group bands and the Sweep page's scaling study read them as such.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .config import ConfigError, ConfigInvalid, RunConfig, coerce_field, field_kind, settable_fields

if TYPE_CHECKING:
    from sqlalchemy import Engine

    from .config import Machine

PARAM_PREFIX = "param."
ARG_PREFIX = "arg."
MAX_RUNS = 1000


@dataclass(frozen=True)
class Axis:
    name: str  # a RunConfig field, param.KEY or arg.--flag
    values: tuple[Any, ...]

    def label(self, value: Any) -> str:
        shown = ",".join(map(str, value)) if isinstance(value, tuple) else str(value)
        return f"{self.name.removeprefix(PARAM_PREFIX).removeprefix(ARG_PREFIX)}={shown}"


def parse_axis(text: str) -> Axis:
    """`name=v1,v2,…` → an Axis with each value typed for its setting; ConfigInvalid (field "grid") names
    what is wrong."""
    name, sep, raw = text.partition("=")
    name = name.strip()
    if not sep or not name or not raw.strip():
        raise _bad(f"{text!r} must read setting=value1,value2 (e.g. batch_size=32,64)")
    pieces = [p.strip() for p in (raw.split(";") if ";" in raw else raw.split(","))]
    if any(p == "" for p in pieces):
        raise _bad(f"{name} has an empty value in {raw!r}")
    if name.startswith(PARAM_PREFIX):
        key = name.removeprefix(PARAM_PREFIX)
        if not key.isidentifier():
            raise _bad(f"{name}: a parameter's name must be an identifier, like param.width")
        return Axis(name, tuple(pieces))
    if name.startswith(ARG_PREFIX):
        if not name.removeprefix(ARG_PREFIX).startswith("-"):
            raise _bad(f"{name}: name the script's option, like arg.--lr")
        return Axis(name, tuple(pieces))
    fields = {f.name: f for f in settable_fields()}
    if name not in fields:
        raise _bad(f"{name} is not a setting; sweep a setting ({', '.join(sorted(fields))}), param.KEY or "
                   "arg.--option")
    if name in ("seed", "name", "group"):
        raise _bad(f"{name} is set by the sweep itself" + (": use --seeds N" if name == "seed" else ""))
    f = fields[name]
    try:
        return Axis(name, tuple(coerce_field(f, _typed(field_kind(f), p)) for p in pieces))
    except ValueError as exc:
        raise _bad(f"{name} {exc}") from exc


def _typed(kind: str, text: str) -> Any:
    """A value as the grid's text spells it, in the type its setting takes (coerce_field then checks it)."""
    try:
        if kind == "int":
            return int(text)
        if kind == "float":
            return float(text)
        if kind == "bool":
            return {"true": True, "false": False}[text.lower()]
        if kind == "int_list":
            return [int(x) for x in text.replace("+", ",").split(",") if x.strip()]
        if kind == "str_list":
            return text.split()
    except (ValueError, KeyError):
        return text  # coerce_field names the expected type
    return text


def _bad(message: str) -> ConfigInvalid:
    return ConfigInvalid([ConfigError("grid", message)])


def apply(cfg: RunConfig, axis: Axis, value: Any) -> RunConfig:
    if axis.name.startswith(PARAM_PREFIX):
        key = axis.name.removeprefix(PARAM_PREFIX)
        kept = [p for p in cfg.params if p.partition("=")[0].strip() != key]
        return cfg.replace(params=[*kept, f"{key}={value}"])
    if axis.name.startswith(ARG_PREFIX):
        option, args = axis.name.removeprefix(ARG_PREFIX), list(cfg.script_args)
        if option in args and args.index(option) + 1 < len(args):
            args[args.index(option) + 1] = str(value)
        else:
            args += [option, str(value)]
        return cfg.replace(script_args=args)
    return cfg.replace(**{axis.name: list(value) if isinstance(value, tuple) else value})


@dataclass(frozen=True)
class SweepRun:
    config: RunConfig
    label: str  # its grid point's values, e.g. "num_procs=2 batch_size=64"


def expand(base: RunConfig, axes: list[Axis], seeds: int = 1, sweep: str = "") -> list[SweepRun]:
    """Every combination of the axes' values, each with `seeds` seeds (base.seed, base.seed + 1, …)."""
    names = [a.name for a in axes]
    if len(set(names)) != len(names):
        raise _bad(f"names a setting twice: {', '.join(n for n in names if names.count(n) > 1)}")
    if seeds < 1:
        raise _bad(f"--seeds must be at least 1, got {seeds}")
    points = list(itertools.product(*(a.values for a in axes)))
    if len(points) * seeds > MAX_RUNS:
        raise _bad(f"makes {len(points) * seeds:,} runs; at most {MAX_RUNS:,} in one sweep")
    runs = []
    for point in points:
        cfg = base
        for axis, value in zip(axes, point, strict=True):
            cfg = apply(cfg, axis, value)
        label = " ".join(a.label(v) for a, v in zip(axes, point, strict=True)) or "base"
        for i in range(seeds):
            seed = base.seed + i
            suffix = f" seed={seed}" if seeds > 1 else ""
            runs.append(SweepRun(cfg.replace(seed=seed, name=f"{base.name} {label}{suffix}"[:200],
                                             group=f"{sweep} {label}".strip()[:200]), label + suffix))
    return runs


def describe(base: RunConfig, axes: list[Axis], seeds: int) -> str:
    """What the grid makes, in a line: the form shows it before anything is launched."""
    points = 1
    for a in axes:
        points *= len(a.values)
    sizes = " × ".join(f"{len(a.values)} {a.name}" for a in axes) or "1 point"
    return f"{points * seeds} run(s): {sizes}" + (f" × {seeds} seeds" if seeds > 1 else "")


# Runs that differ only in these share one check before launch (seeds of a grid point, above all).
CHECK_SHARED_BY = ("name", "group", "seed")
RESOLVED = ("recipe", "workdir", "data", "code_file", "code_sha256", "script")


def prepare_all(runs: list[SweepRun], machine: Machine) -> list[RunConfig]:
    """Every run's config as it will be stored, or ConfigInvalid naming the first bad combination: nothing is
    queued unless all pass. A recipe is checked once per grid point (the check takes seconds), not per seed."""
    from .config import validate
    from .control import prepare

    prepared: dict[tuple[Any, ...], RunConfig] = {}
    out = []
    for i, run in enumerate(runs, start=1):
        where = f"run {i} of {len(runs)} ({run.label})"
        errors = validate(run.config, machine)
        if errors:
            raise ConfigInvalid([dataclasses.replace(e, message=f"{e.message} — in {where}") for e in errors])
        identity = tuple(sorted((k, str(v)) for k, v in run.config.to_dict().items() if k not in CHECK_SHARED_BY))
        try:
            if identity not in prepared:
                prepared[identity] = prepare(run.config, machine)
        except ConfigInvalid as exc:
            raise ConfigInvalid([dataclasses.replace(e, message=f"{e.message} — in {where}")
                                 for e in exc.errors]) from exc
        done = prepared[identity]
        cfg = run.config.replace(**{f: getattr(done, f) for f in RESOLVED})
        out.append(cfg)
    return out


def new_sweep_name() -> str:
    return time.strftime("sweep-%Y%m%d-%H%M%S")


def launch_sweep(engine: Engine, base: RunConfig, axes: list[Axis], seeds: int, machine: Machine,
                 name: str = "") -> tuple[str, list[int]]:
    """Validate every run of the grid, then queue them all (in grid order); returns the sweep's name and ids."""
    from .control import enqueue

    name = name.strip() or new_sweep_name()
    if len(name) > 100 or not name.isprintable():
        raise _bad("the sweep's name must be at most 100 printable characters")
    configs = prepare_all(expand(base, axes, seeds, name), machine)
    return name, [enqueue(engine, cfg, sweep=name) for cfg in configs]
