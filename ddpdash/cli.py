"""The `ddpdash` command line (the `ddpdash` console script): thin over process control and the queries.

    ddpdash launch --num-procs 2 --recipe mlp --max-steps 200 --wait
    ddpdash launch --script train.py --num-procs 2 -- --epochs 3 --lr 0.1
    ddpdash launch --recipe path/to/model.py:build --param width=128 --num-procs 2
    ddpdash check --recipe table --data train.csv --target price        # the check alone: nothing is launched
    ddpdash sweep --grid num_procs=1,2 --grid batch_size=32,64 --seeds 2 --max-steps 200
    ddpdash queue [--cancel RUN | --front RUN] | stop --sweep NAME
    ddpdash runs | show RUN | stop RUN | logs RUN [--rank N] [--follow] | export RUN --format csv|json
    ddpdash ui [--port 8501] [--address 127.0.0.1]

Every run flag of `launch` is derived from RunConfig's fields.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.orm import Session

from ddpdash.db.migrate import StoreError, open_store
from ddpdash.db.queries import EXPORT_FORMATS, events, export_points, rank_states
from ddpdash.db.runs import RunNotFound, get_run, list_runs
from ddpdash.db.vocab import Metric, RunStatus
from ddpdash.trainer.config import (
    RENAMED_KEYS,
    ConfigError,
    ConfigInvalid,
    RunConfig,
    detect_machine,
    field_choices,
    field_kind,
    read_settings,
    settable_fields,
)
from ddpdash.trainer.control import LaunchError, StopError

EXIT_BAD_INPUT = 2


class CliError(Exception):
    """One clear line for the user, and a non-zero exit."""


# ---- flags derived from RunConfig ----------------------------------------------------------------
def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated GPU indices like 0,1 — got {text!r}") from None


def add_config_flags(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("run settings (override --config; defaults in brackets)")
    default = RunConfig()
    for f in flag_fields():
        flags = ["--" + f.name.replace("_", "-"), *(f"--{old}" for old, new in RENAMED_KEYS.items() if new == f.name),
                 *(f"--{alias}" for alias in f.metadata.get("flag_aliases", ()))]
        kind = field_kind(f)
        help_text = f"{f.metadata['help']} [{getattr(default, f.name)!r}]".replace("%", "%%")
        if kind == "bool":
            group.add_argument(*flags, dest=f.name, action=argparse.BooleanOptionalAction, default=None,
                               help=help_text)
        elif kind == "choice":
            group.add_argument(*flags, dest=f.name, choices=field_choices(f), default=None, help=help_text)
        elif kind == "int_list":
            group.add_argument(*flags, dest=f.name, type=_int_list, default=None, help=help_text, metavar="I,J")
        else:
            typ = {"int": int, "float": float, "str": str}[kind]
            group.add_argument(*flags, dest=f.name, type=typ, default=None, help=help_text)


def flag_fields() -> list[Any]:
    """The settings that are flags: all a user sets, but lists (a script's own arguments follow `--`;
    parameters are `--param key=value`, repeated)."""
    return [f for f in settable_fields() if field_kind(f) != "str_list"]


def config_from_args(args: argparse.Namespace) -> RunConfig:
    base = read_settings(Path(args.config)) if args.config else {}
    overrides = {f.name: getattr(args, f.name) for f in flag_fields() if getattr(args, f.name) is not None}
    if args.script_args:
        overrides["script_args"] = list(args.script_args)
    if args.param:
        overrides["params"] = list(args.param)
    if getattr(args, "sbatch_option", None):
        overrides["sbatch_options"] = list(args.sbatch_option)
    return RunConfig.from_dict({**base, **overrides})


# ---- commands -------------------------------------------------------------------------------------
def cmd_launch(engine: Engine, args: argparse.Namespace) -> int:
    from ddpdash.trainer.control import launch

    cfg = config_from_args(args)
    run_id = launch(engine, cfg, detect_machine())
    print(run_id, flush=True)
    if not args.wait:
        return 0
    return wait_with_progress(engine, run_id)


def cmd_check(args: argparse.Namespace) -> int:
    """Validate the settings and take one batch through the recipe, in a child process; print what it found."""
    from ddpdash.trainer.config import check
    from ddpdash.trainer.control import check_recipe

    cfg = check(config_from_args(args), detect_machine())
    if cfg.uses_script:
        raise CliError("check is for recipes: a script is checked when it is launched (its file and folder)")
    result = check_recipe(cfg)
    if result.failures:
        raise ConfigInvalid([ConfigError(f.field, f.message, f.detail) for f in result.failures])
    assert result.report is not None
    for label, value in result.report.lines():
        print(f"{label + ':':<10} {value}")
    return 0


RECONCILE_EVERY_S = 5.0  # while waiting or following: a dead supervisor is noticed within seconds


class Reconciler:
    """Calls trainer.control.reconcile at most every RECONCILE_EVERY_S."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.last = time.monotonic()

    def tick(self) -> None:
        if time.monotonic() - self.last >= RECONCILE_EVERY_S:
            from ddpdash.trainer.control import reconcile

            reconcile(self.engine)
            self.last = time.monotonic()


def wait_with_progress(engine: Engine, run_id: int, out: Any = None) -> int:
    out = out or sys.stderr
    reconciler = Reconciler(engine)
    while True:
        reconciler.tick()
        with Session(engine) as s:
            run = get_run(s, run_id)
            states = rank_states(s, run_id)
            loss = _last_value(s, run_id, Metric.LOSS)
            speed = _last_value(s, run_id, Metric.SAMPLES_PER_S, reduce="sum")
        done = int(states["step"].min()) if len(states) else 0
        total = run.total_steps or 0
        frac = done / total if total else 0.0
        bar = "#" * int(frac * 30)
        line = f"\rrun {run_id} [{bar:<30}] {done}/{total or '?'} steps  {run.status}"
        if loss is not None:
            line += f"  loss {loss:.4g}"
        if speed is not None:
            line += f"  {speed:,.0f} samples/s"
        out.write(line.ljust(100))
        out.flush()
        if run.status in RunStatus.FINAL:
            out.write("\n")
            if run.status != RunStatus.SUCCEEDED:
                first_line = run.error.strip().splitlines()[0] if run.error.strip() else ""
                out.write(f"run {run_id} {run.status}" + (f": {first_line}" if first_line else "") + "\n")
            return 0 if run.status == RunStatus.SUCCEEDED else 1
        time.sleep(0.5)


def _last_value(s: Session, run_id: int, name: str, reduce: str = "mean") -> float | None:
    from ddpdash.db.queries import metric_series

    df = metric_series(s, run_id, name, max_points=50)
    if df.empty:
        return None
    last = df.sort_values("step").groupby("rank").tail(1)["value"]
    return float(last.sum() if reduce == "sum" else last.mean())


def cmd_runs(engine: Engine, args: argparse.Namespace) -> int:
    with Session(engine) as s:
        runs = list_runs(s, limit=args.limit)
    if not runs:
        print("no runs yet: start one with `ddpdash launch` or `ddpdash ui`")
        return 0
    print(f"{'id':>5}  {'status':<10} {'ranks':>5}  {'model':<12} {'started':<19}  name")
    for r in runs:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.started_at or r.created_at))
        print(f"{r.id:>5}  {r.status:<10} {r.world_size:>5}  {_what(r):<12} {started:<19}  {r.name}")
    return 0


def _what(run: Any) -> str:
    from ddpdash.dashboard.history import run_config

    cfg = run_config(run)
    return cfg.what if cfg else str(run.config.get("model", "?"))


def cmd_show(engine: Engine, args: argparse.Namespace) -> int:
    from ddpdash.db.queries import metric_series
    from ddpdash.trainer.health import find_straggler

    with Session(engine) as s:
        run = get_run(s, args.run)
        states = rank_states(s, args.run)
        evs = events(s, args.run)
        step_times = metric_series(s, args.run, Metric.STEP_TIME)
    print(f"run {run.id}: {run.name}  [{run.status}]")
    print(f"  folder   {run.run_dir}")
    print(f"  ranks    {run.world_size}   steps {run.total_steps or '?'}")
    if run.job_line:
        print(f"  slurm    {run.job_line}")
    if run.world_size > 1 and not step_times.empty:
        straggler = find_straggler(step_times)  # the Live page's judgement, on the same newest steps
        print(f"  straggler {straggler.text() if straggler else 'none: no rank holds the others back'}")
    for line in _time_per_step(engine, args.run):
        print(line)
    if run.failed_ranks:
        print(f"  failed   rank(s) {list(run.failed_ranks)}")
    for row in states.itertuples(index=False):
        print(f"  rank {row.rank}: {row.status:<8} step {row.step:<7} {row.device} pid {row.pid} on {row.host}")
    for ev in evs.itertuples(index=False):
        stamp = time.strftime("%H:%M:%S", time.localtime(ev.time))
        rank = f" rank {int(ev.rank)}" if ev.rank == ev.rank and ev.rank is not None else ""
        print(f"  {stamp} {ev.kind}{rank}: {ev.message}")
    if run.error:
        print("  error:\n    " + run.error.strip().replace("\n", "\n    "))
    print("  config: " + json.dumps(run.config, sort_keys=True))
    return 0


def _time_per_step(engine: Engine, run_id: int) -> list[str]:
    """The Live page's "time per step" per rank, and its communication share, as lines."""
    from ddpdash.dashboard.livedata import SeriesCache, step_breakdown

    cache = SeriesCache(run_id)
    with Session(engine) as s:
        cache.refresh(s, (*Metric.PHASES, Metric.COMM_TIME, Metric.COMM_OVERLAP_TIME, Metric.COMM_SHARE))
    table = step_breakdown(cache)
    share = cache.get(Metric.COMM_SHARE)
    shares = share.groupby("rank")["value"].median() if not share.empty else {}
    lines = []
    for rank, phases in table.groupby("rank"):
        parts = ", ".join(f"{row.phase} {row.seconds * 1e3:.2f} ms" for row in phases.sort_values("order").itertuples())
        comm = f"; communication share {shares[rank]:.0%}" if rank in shares else ""
        lines.append(f"  time per step, rank {rank}: {parts}{comm}")
    return lines


def cmd_stop(engine: Engine, args: argparse.Namespace) -> int:
    from ddpdash.trainer.control import stop, stop_sweep

    if args.sweep:
        for run_id, status in stop_sweep(engine, args.sweep).items():
            print(f"run {run_id} {status}")
        return 0
    if args.run is None:
        raise CliError("name a RUN to stop, or --sweep NAME")
    status = stop(engine, args.run)
    print(f"run {args.run} {status}")
    return 0


def cmd_sweep(engine: Engine, args: argparse.Namespace) -> int:
    from ddpdash.trainer.sweep import launch_sweep, parse_axis

    axes = [parse_axis(text) for text in args.grid]
    name, ids = launch_sweep(engine, config_from_args(args), axes, args.seeds, detect_machine(), args.sweep_name)
    print(f"sweep {name}: {len(ids)} run(s) queued: {' '.join(map(str, ids))}", flush=True)
    if not args.wait:
        return 0
    return 0 if all(wait_with_progress(engine, run_id) == 0 for run_id in ids) else 1


def cmd_stacks(engine: Engine, args: argparse.Namespace) -> int:
    from ddpdash.trainer.stacks import capture_run

    found = capture_run(engine, args.run)
    print(found.verdict)
    if found.finding:
        print(f"Flight Recorder: {found.finding}")
    for stack in found.stacks:
        own = stack.own_frame
        print(f"\n-- rank {stack.rank} (pid {stack.pid}, {stack.method}{': ' + stack.note if stack.note else ''})")
        if stack.error:
            print(f"   {stack.error}")
        for frame in stack.frames:
            mark = "▶" if frame is own else " "
            print(f" {mark} {frame.name} ({frame.where})")
    return 0


def cmd_profile(engine: Engine, args: argparse.Namespace) -> int:
    from pathlib import Path

    from ddpdash.trainer.profiling import ask_profile, wait_for_profiles
    from ddpdash.trainer.rundir import RunDir

    with Session(engine) as s:
        run = get_run(s, args.run)
    if not run.is_active or not run.run_dir:
        raise CliError(f"run {args.run} is {run.status}: only a running run can be profiled")
    run_dir = RunDir(Path(run.run_dir))
    try:
        request = ask_profile(run_dir, args.steps)
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    print(f"every rank of run {run.id} profiles its next {args.steps} step(s)…", flush=True)

    def running() -> bool:
        with Session(engine) as s:
            return get_run(s, args.run).is_active

    profiles = wait_for_profiles(run_dir, request, run.world_size, args.timeout, running)
    for prof in profiles:
        print(f"\n-- rank {prof.rank}: steps {prof.steps[0]}–{prof.steps[1]}, trace {prof.trace}")
        for op in prof.ops[:10]:
            print(f"   {op['self_ms']:>9.2f} ms {op['share']:>6.1%} {op['calls']:>7}×  {op['name']}")
    missing = sorted(set(range(run.world_size)) - {p.rank for p in profiles})
    if missing:
        print(f"\nno profile from rank(s) {missing} (the run ended, or a rank does not step: a script that does not "
              "log through ddpdash is not profiled)")
        return 1
    print("\nthe traces open in https://ui.perfetto.dev or chrome://tracing")
    return 0


def cmd_queue(engine: Engine, args: argparse.Namespace) -> int:
    from ddpdash.trainer.queue import cancel, move_to_front, waiting_states

    if args.cancel is not None:
        print(f"run {args.cancel} " + ("cancelled" if cancel(engine, args.cancel) else "is not waiting in the queue"))
        return 0
    if args.front is not None:
        moved = move_to_front(engine, args.front)
        print(f"run {args.front} " + ("is first in line" if moved else "is not waiting in the queue"))
        return 0
    with Session(engine) as s:
        waiting = waiting_states(s)
        names = {r.id: r.name for r in list_runs(s, statuses=(RunStatus.QUEUED,))}
    if not waiting:
        print("the queue is empty: nothing waits for this machine")
    for run_id, (position, reason) in sorted(waiting.items(), key=lambda kv: kv[1][0]):
        print(f"{position:>3}. run {run_id} {names.get(run_id, '')}: {reason}")
    return 0


def cmd_logs(engine: Engine, args: argparse.Namespace) -> int:
    from ddpdash.trainer.rundir import RunDir

    with Session(engine) as s:
        run = get_run(s, args.run)
    if not 0 <= args.rank < run.world_size:
        raise CliError(f"--rank must be between 0 and {run.world_size - 1} for run {run.id}")
    path = RunDir(Path(run.run_dir)).rank_log(args.rank, args.stream)
    if path is None:
        raise CliError(f"run {run.id} has no {args.stream} log for rank {args.rank} yet")
    reconciler = Reconciler(engine)
    with open(path, encoding="utf-8", errors="replace") as f:
        sys.stdout.write(f.read())
        while args.follow:
            reconciler.tick()
            chunk = f.read()
            if chunk:
                sys.stdout.write(chunk)
                sys.stdout.flush()
                continue
            with Session(engine) as s:
                if get_run(s, run.id).status in RunStatus.FINAL:
                    break
            time.sleep(0.5)
    return 0


def cmd_compact(engine: Engine, args: argparse.Namespace) -> int:
    from ddpdash.db.retention import compact_run
    from ddpdash.trainer.config import ConfigInvalid, RunConfig

    if min(args.keep_steps or 0, args.keep_days or 0) < 0:
        raise CliError("--keep-steps and --keep-days must not be negative")
    with Session(engine) as s:
        ids = args.run or [r.id for r in list_runs(s)]
        runs = [get_run(s, i) for i in ids]
    own = args.keep_steps is None and args.keep_days is None  # each run's own keep_raw_steps
    for run in runs:
        keep_steps, keep_days = args.keep_steps, args.keep_days
        if own:
            try:
                keep_steps = RunConfig.from_dict(run.config).keep_raw_steps or None
            except ConfigInvalid:
                keep_steps = None
            if keep_steps is None:
                print(f"run {run.id}: keeps every raw point (its keep_raw_steps is 0)")
                continue
        with Session(engine) as s, s.begin():
            print(compact_run(s, run.id, keep_steps=keep_steps, keep_days=keep_days).text())
    if args.vacuum and engine.dialect.name == "sqlite":
        with engine.connect() as conn:
            conn.exec_driver_sql("VACUUM")  # SQLite reuses freed pages; VACUUM gives them back to the disk
        print("database file shrunk (VACUUM)")
    return 0


def cmd_export(engine: Engine, args: argparse.Namespace) -> int:
    with Session(engine) as s:
        get_run(s, args.run)
        text = export_points(s, args.run, args.format)
    if args.output:
        write_new_file(Path(args.output), text, overwrite=args.force)
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def write_new_file(path: Path, text: str, *, overwrite: bool) -> None:
    """Write `path` whole or not at all: into a temporary file beside it, then renamed over it, so a full
    disk leaves no half-written export (and an existing file is untouched unless `overwrite`)."""
    if path.is_dir():
        raise CliError(f"--output {path} is a folder: name a file in it")
    if path.exists() and not overwrite:
        raise CliError(f"--output {path} exists: pass --force to replace it")
    if not path.parent.is_dir():
        raise CliError(f"--output {path}: the folder {path.parent} does not exist")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise CliError(f"could not write --output {path}: {exc.strerror}") from exc


def cmd_ui(args: argparse.Namespace) -> int:
    from ddpdash.dashboard.serve import serve

    return serve(port=args.port, address=args.address)


# ---- parser -----------------------------------------------------------------------------------
def port_number(text: str) -> int:
    if not text.strip().isdecimal() or not 1 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number from 1 to 65535 (--port or PORT), got {text!r}")
    return int(text)



def add_run_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="a JSON file of run settings; flags override it")
    add_config_flags(p)
    p.add_argument("--param", action="append", metavar="KEY=VALUE",
                   help="a parameter of yours (repeatable): build(params) of your recipe, or ddpdash.init().params "
                        "in your script; typed by value")
    p.add_argument("--sbatch-option", action="append", metavar="--KEY=VALUE", dest="sbatch_option",
                   help="one more sbatch option for a Slurm launch (repeatable), e.g. --sbatch-option=--exclusive")
    p.add_argument("script_args", nargs="*", metavar="-- SCRIPT_ARG",
                   help="your script's own arguments, after -- (with --script or --module)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ddpdash", description="Configure, launch, watch and compare DDP runs.")
    p.add_argument("--db-url", help="SQLAlchemy URL (default: $DDPDASH_DB_URL or $DDPDASH_HOME/ddpdash.db)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    launch = sub.add_parser("launch", help="start a run (prints its id)")
    launch.add_argument("--wait", action="store_true", help="show progress and exit with the run's outcome")
    add_run_flags(launch)
    add_run_flags(sub.add_parser("check", help="check a recipe: build it and take one batch through it (launches "
                                               "nothing)"))

    runs = sub.add_parser("runs", help="list runs")
    runs.add_argument("--limit", type=int, default=50)
    sub.add_parser("show", help="a run's status, ranks, events and config").add_argument("run", type=int,
                                                                                         metavar="RUN")
    stop = sub.add_parser("stop", help="stop a run (a queued one is cancelled), or every run of a sweep")
    stop.add_argument("run", type=int, metavar="RUN", nargs="?")
    stop.add_argument("--sweep", help="stop every run of this sweep, queued or running")
    sweep = sub.add_parser("sweep", help="queue a grid of runs: --grid setting=v1,v2 (repeatable), --seeds N")
    sweep.add_argument("--grid", action="append", default=[], metavar="SETTING=V1,V2",
                       help="a setting and its values (param.KEY for your parameters, arg.--option for your "
                            "script's); values split on commas, or on semicolons when one holds a comma")
    sweep.add_argument("--seeds", type=int, default=1, help="runs per grid point, seeds seed, seed+1, … [1]")
    sweep.add_argument("--sweep-name", default="", help="the sweep's name [sweep-DATE-TIME]")
    sweep.add_argument("--wait", action="store_true", help="wait until every run has ended; exit 0 if all succeeded")
    add_run_flags(sweep)
    sub.add_parser("stacks", help="every live rank's stack now (py-spy), with a verdict: who waits for whom"
                   ).add_argument("run", type=int, metavar="RUN")
    profile = sub.add_parser("profile", help="profile the next N steps of every rank (torch.profiler); waits, then "
                                             "prints each rank's top operators and where its trace is")
    profile.add_argument("run", type=int, metavar="RUN")
    profile.add_argument("--steps", type=int, default=5, help="steps to profile [5]")
    profile.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for every rank [300]")
    queue = sub.add_parser("queue", help="the runs waiting for this machine: position and what each waits for")
    queue.add_argument("--cancel", type=int, metavar="RUN", help="take a waiting run out of the queue")
    queue.add_argument("--front", type=int, metavar="RUN", help="move a waiting run to the front")
    logs = sub.add_parser("logs", help="a rank's log")
    logs.add_argument("run", type=int, metavar="RUN")
    logs.add_argument("--rank", type=int, default=0)
    logs.add_argument("--stream", choices=("stderr", "stdout"), default="stderr")
    logs.add_argument("--follow", "-f", action="store_true", help="keep printing until the run ends")
    export = sub.add_parser("export", help="a run's metric points as CSV or JSON (rank, step, metric, value, time)")
    export.add_argument("run", type=int, metavar="RUN")
    export.add_argument("--format", choices=EXPORT_FORMATS, default="csv")
    export.add_argument("--output", "-o", help="write to this file instead of standard output")
    export.add_argument("--force", action="store_true", help="replace --output if it exists")
    compact = sub.add_parser("compact", help="remove old raw points of long runs, keeping their rollups (min, max, "
                                             "mean per bucket): by each run's keep_raw_steps, or the flags")
    compact.add_argument("run", type=int, metavar="RUN", nargs="*", help="runs to compact [every run]")
    compact.add_argument("--keep-steps", type=int, help="keep the raw points of the newest N steps")
    compact.add_argument("--keep-days", type=float, help="keep the raw points of the last D days")
    compact.add_argument("--vacuum", action="store_true", help="SQLite: give the freed space back to the disk")
    ui = sub.add_parser("ui", help="start the dashboard")
    # A string default goes through `type` too: a bad PORT is refused like a bad --port.
    ui.add_argument("--port", type=port_number, default=os.environ.get("PORT", "8501"), help="[$PORT or 8501]")
    ui.add_argument("--address", default=os.environ.get("DDPDASH_ADDRESS", "127.0.0.1"))
    return p


COMMANDS = {"launch": cmd_launch, "runs": cmd_runs, "show": cmd_show, "stop": cmd_stop, "logs": cmd_logs,
            "export": cmd_export, "sweep": cmd_sweep, "queue": cmd_queue, "stacks": cmd_stacks,
            "profile": cmd_profile, "compact": cmd_compact}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "ui":
            return cmd_ui(args)
        if args.command == "check":
            return cmd_check(args)
        engine = open_store(args.db_url)
        from ddpdash.trainer.control import reconcile

        reconcile(engine)
        return COMMANDS[args.command](engine, args)
    except ConfigInvalid as exc:
        for e in exc.errors:
            print(f"ddpdash: error: {e}", file=sys.stderr)
            if e.detail:
                print("  " + e.detail.rstrip().replace("\n", "\n  "), file=sys.stderr)
        return EXIT_BAD_INPUT
    except (CliError, RunNotFound, StoreError) as exc:
        print(f"ddpdash: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except (LaunchError, StopError) as exc:
        print(f"ddpdash: error: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # The reader went away (`ddpdash show 3 | head`): nothing more to say, and nothing to flush at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except OSError as exc:  # DDPDASH_HOME unusable, a full disk, ...
        where = f" ({exc.filename})" if exc.filename else ""
        print(f"ddpdash: error: {exc.strerror or exc}{where}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
