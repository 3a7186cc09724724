"""Run history and comparison, computed without Streamlit: the runs table with filters, sort and
pages; overlaid curves on a chosen x-axis; scaling efficiency; config diffs; target-loss summaries."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
from sqlalchemy.orm import Session

from ddpdash.db.queries import count_runs, metric_series, run_conditions, run_ids_page, run_metric_summaries
from ddpdash.db.runs import RunInfo, get_run, list_runs
from ddpdash.db.vocab import Metric, RunStatus
from ddpdash.trainer.config import ConfigInvalid, RunConfig

RUN_COLUMNS = ["id", "name", "status", "slurm", "started", "duration_s", "world_size", "devices", "backend", "batch",
               "global_batch", "amp", "model", "code", "sweep", "group", "final_loss", "best_loss", "samples_per_s",
               "comm_share", "tags", "notes"]
SORTABLE = ["id", "name", "status", "started", "duration_s", "world_size", "model", "final_loss", "best_loss",
            "samples_per_s", "comm_share"]
X_AXES = {"step": "step", "samples": "samples seen", "time": "seconds since start"}
# Settings that say how many/which workers run, not what is trained: runs differing only here scale (the
# seed and the names do not change what is trained either: seeds of one setting are averaged).
SCALING_FIELDS = {"name", "num_procs", "devices", "backend", "seed", "group"}
MAX_COMPARE = 10
MAX_SWEEP_RUNS = 200  # the Sweep page reads this many of a sweep's runs
BANDS = {"minmax": "min–max across runs", "std": "± one standard deviation"}


@dataclass(frozen=True)
class RunFilter:
    statuses: tuple[str, ...] = ()
    models: tuple[str, ...] = ()
    backends: tuple[str, ...] = ()
    tag: str = ""
    text: str = ""
    sweep: str = ""


def run_config(run: RunInfo) -> RunConfig | None:
    """The run's stored settings as a RunConfig: derived values (world size, global batch, effective lr,
    backend) come from it, never recomputed here. None for a config this version cannot read."""
    try:
        return RunConfig.from_dict(run.config)
    except ConfigInvalid:
        return None


def runs_frame(s: Session) -> pd.DataFrame:
    """Every run as one row (thousands stay fast: one query for runs, one over the coarsest rollups)."""
    runs = list_runs(s)
    return _run_rows(runs, run_metric_summaries(s, [r.id for r in runs]).set_index("run_id"))


def _run_rows(runs: list[RunInfo], metrics: pd.DataFrame) -> pd.DataFrame:
    if not runs:
        return pd.DataFrame(columns=RUN_COLUMNS)
    rows = []
    for r in runs:
        cfg = run_config(r)
        rows.append({
            "id": r.id, "name": r.name, "status": r.status, "slurm": r.job_line,
            "started": pd.to_datetime(r.started_at or r.created_at, unit="s"),
            "duration_s": r.duration_s, "world_size": r.world_size,
            "devices": (",".join(f"cuda:{d}" for d in cfg.devices) or f"{r.world_size}× cpu") if cfg else None,
            "backend": cfg.resolved_backend if cfg else None, "batch": cfg.batch_size if cfg else None,
            "global_batch": cfg.global_batch if cfg else None, "amp": cfg.amp if cfg else None,
            "model": cfg.what if cfg else None, "code": cfg.code_sha256[:8] if cfg else None,  # tells code apart
            "sweep": r.sweep, "group": r.group_name,
            "final_loss": metrics.at[r.id, "final_loss"], "best_loss": metrics.at[r.id, "best_loss"],
            "samples_per_s": metrics.at[r.id, "samples_per_s"], "comm_share": metrics.at[r.id, "comm_share"],
            "tags": ", ".join(r.tags), "notes": r.notes,
        })
    return pd.DataFrame(rows, columns=RUN_COLUMNS)


def filter_runs(df: pd.DataFrame, f: RunFilter) -> pd.DataFrame:
    out = df
    if f.statuses:
        out = out[out["status"].isin(f.statuses)]
    if f.models:
        out = out[out["model"].isin(f.models)]
    if f.backends:
        out = out[out["backend"].isin(f.backends)]
    if f.sweep:
        out = out[out["sweep"] == f.sweep]
    if f.tag:
        out = out[out["tags"].map(lambda t: f.tag in [x.strip() for x in t.split(",")])]
    if f.text:
        needle = f.text.lower()
        out = out[out["name"].str.lower().str.contains(needle, regex=False)
                  | out["notes"].str.lower().str.contains(needle, regex=False)]
    return out


def sort_and_page(df: pd.DataFrame, sort_by: str = "id", descending: bool = True, page: int = 1,
                  page_size: int = 50) -> tuple[pd.DataFrame, int]:
    """One page of the sorted table and the number of pages."""
    if sort_by not in SORTABLE:
        raise ValueError(f"cannot sort by {sort_by!r}; choose one of {', '.join(SORTABLE)}")
    ordered = df.sort_values(sort_by, ascending=not descending, na_position="last", kind="stable")
    pages = max(1, -(-len(ordered) // page_size))
    page = min(max(page, 1), pages)
    return ordered.iloc[(page - 1) * page_size : page * page_size], pages


# ---- compare ---------------------------------------------------------------------------------
@dataclass
class Comparison:
    runs: list[RunInfo]
    loss: dict[int, pd.DataFrame] = field(default_factory=dict)  # the downsampled loss per run, for the overlay
    summaries: pd.DataFrame = field(default_factory=pd.DataFrame)  # run_metric_summaries, indexed by run id

    def summary(self, run_id: int, column: str) -> float | None:
        value = self.summaries.at[run_id, column] if run_id in self.summaries.index else None
        return None if value is None or pd.isna(value) else float(value)


# Points read for a comparison, over every run's every rank: 2,000 a line for a few, fewer for many (10 runs of
# 8 ranks: 500 each), so Compare costs the same whatever it is asked to show.
COMPARE_POINTS = 40_000
COMPARE_MIN_POINTS = 250


def load_comparison(s: Session, run_ids: list[int], budget: int = 2000) -> Comparison:
    runs = [get_run(s, i) for i in run_ids[:MAX_COMPARE]]
    comp = Comparison(runs, summaries=run_metric_summaries(s, [r.id for r in runs]).set_index("run_id"))
    lines = sum(r.world_size for r in runs) or 1
    per_rank = max(COMPARE_MIN_POINTS, min(budget, COMPARE_POINTS // lines))
    for r in runs:
        comp.loss[r.id] = metric_series(s, r.id, Metric.LOSS, max_points=per_rank)
    return comp


def run_label(run: RunInfo) -> str:
    return f"#{run.id} {run.name}"


def with_x(df: pd.DataFrame, run: RunInfo, x_axis: str) -> pd.DataFrame:
    """Adds column x: the step, samples seen (step × global batch) or seconds since the run started."""
    out = df.copy()
    if x_axis == "step":
        out["x"] = out["step"].astype(float)
    elif x_axis == "samples":
        batch = _global_batch(run)
        out["x"] = out["step"] * batch if batch else float("nan")
    elif x_axis == "time":
        start = run.started_at or (float(out["time"].min()) if len(out) else 0.0)
        out["x"] = out["time"] - start
    else:
        raise ValueError(f"x axis must be one of {', '.join(X_AXES)}")
    return out


def overlay_frame(comp: Comparison, x_axis: str = "step", per_rank: bool = False) -> pd.DataFrame:
    """Long frame [series, run_id, rank, x, value, lo, hi]: per run the mean over ranks with the band of
    min and max, or one line per rank."""
    frames = []
    for run in comp.runs:
        df = with_x(comp.loss[run.id], run, x_axis)
        if df.empty:
            continue
        if per_rank:
            part = df.assign(series=df["rank"].map(lambda k, r=run: f"{run_label(r)} · rank {int(k)}"),
                             lo=df["vmin"], hi=df["vmax"])
        else:
            part = mean_over_ranks(df).assign(series=run_label(run), rank=-1)
        frames.append(part.assign(run_id=run.id)[["series", "run_id", "rank", "x", "value", "lo", "hi"]])
    if not frames:
        return pd.DataFrame(columns=["series", "run_id", "rank", "x", "value", "lo", "hi"])
    return pd.concat(frames, ignore_index=True)


def mean_over_ranks(df: pd.DataFrame) -> pd.DataFrame:
    """Per step: x and value averaged over the ranks, lo the lowest vmin and hi the highest vmax [step, x,
    value, lo, hi]; a rank's NaN (a diverged loss) left out, as pandas would. In numpy: Compare runs it for
    every run on every draw."""
    steps, at = np.unique(df["step"].to_numpy(), return_inverse=True)
    value, x = df["value"].to_numpy(dtype=float), df["x"].to_numpy(dtype=float)
    known = ~np.isnan(value)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.bincount(at, weights=np.where(known, value, 0.0), minlength=len(steps)) / np.bincount(
            at, weights=known, minlength=len(steps))
    lo, hi = np.full(len(steps), np.nan), np.full(len(steps), np.nan)
    np.fmin.at(lo, at, df["vmin"].to_numpy(dtype=float))  # fmin/fmax: a NaN loses to any number
    np.fmax.at(hi, at, df["vmax"].to_numpy(dtype=float))
    return pd.DataFrame({"step": steps, "x": np.bincount(at, weights=x, minlength=len(steps)) / np.bincount(at),
                         "value": mean, "lo": lo, "hi": hi})


def _global_batch(run: RunInfo) -> int | None:
    cfg = run_config(run)
    return cfg.global_batch if cfg else None


def config_key(cfg: dict) -> str:
    return json.dumps({k: v for k, v in cfg.items() if k not in SCALING_FIELDS}, sort_keys=True)


def scaling_table(comp: Comparison) -> pd.DataFrame:
    """Scaling efficiency = throughput_N ÷ (N/b × throughput_b), with b the 1-process run of the same
    config or, failing that, the smallest world size of that config among the chosen runs."""
    rows = []
    for run in comp.runs:
        rows.append({"run": run_label(run), "run_id": run.id, "world_size": run.world_size,
                     "samples_per_s": comp.summary(run.id, "samples_per_s"), "group": config_key(run.config)})
    df = pd.DataFrame(rows)
    out = []
    for _, group in df.groupby("group", sort=False):
        if group["world_size"].nunique() < 2:
            continue
        base = group.sort_values("world_size").iloc[0]
        basis = ("the 1-process run" if base["world_size"] == 1 else
                 f"the smallest world size present ({base['world_size']}, no 1-process run of this config)")
        for row in group.itertuples(index=False):
            ideal = base["samples_per_s"] * row.world_size / base["world_size"] if base["samples_per_s"] else None
            out.append({"run": row.run, "world_size": row.world_size, "samples_per_s": row.samples_per_s,
                        "ideal_samples_per_s": ideal,
                        "efficiency": (row.samples_per_s / ideal) if ideal and row.samples_per_s else None,
                        "baseline": f"{base['run']}: {basis}"})
    return pd.DataFrame(out, columns=["run", "world_size", "samples_per_s", "ideal_samples_per_s", "efficiency",
                                      "baseline"])


# ---- groups and sweeps -------------------------------------------------------------------------------------
def group_of(run: RunInfo) -> str:
    """The run's group (a sweep's grid point, named without the sweep's name, or one set by hand); a run
    without one is its own group."""
    if not run.group_name:
        return run_label(run)
    return run.group_name.removeprefix(f"{run.sweep} ") if run.sweep else run.group_name


def group_frame(comp: Comparison, x_axis: str = "step", band: str = "minmax") -> pd.DataFrame:
    """Long frame [series, run_id, rank, x, value, lo, hi] with one series per group: at each step, the mean
    over the group's runs of each run's mean loss over its ranks, with the band `minmax` (the runs' lowest
    and highest) or `std` (± one standard deviation across the runs). Runs are aligned by step; x is the
    step, the samples seen, or the mean of the runs' seconds since start at that step."""
    if band not in BANDS:
        raise ValueError(f"band must be one of {', '.join(BANDS)}")
    per_run = []
    for run in comp.runs:
        df = with_x(comp.loss[run.id], run, x_axis)
        if df.empty:
            continue
        mean = df.groupby("step", as_index=False).agg(x=("x", "mean"), value=("value", "mean"))
        per_run.append(mean.assign(series=group_of(run)))
    columns = ["series", "run_id", "rank", "x", "value", "lo", "hi"]
    if not per_run:
        return pd.DataFrame(columns=columns)
    runs = pd.concat(per_run, ignore_index=True)
    out = runs.groupby(["series", "step"], as_index=False).agg(
        x=("x", "mean"), value=("value", "mean"), lo=("value", "min"), hi=("value", "max"),
        spread=("value", lambda v: float(v.std(ddof=0))), runs=("value", "size"))
    if band == "std":
        out["lo"], out["hi"] = out["value"] - out["spread"], out["value"] + out["spread"]
    return out.assign(run_id=-1, rank=-1)[[*columns, "runs"]]


def sweep_table(comp: Comparison, target_loss: float | None = None) -> pd.DataFrame:
    """A sweep's runs, settings → results: the settings that differ across them, then final loss, samples/s
    and time to the target loss."""
    summary = summary_table(comp, target_loss).drop(columns=["run"])
    diff = config_diff(comp.runs).set_index("setting").drop(index=["name", "group"], errors="ignore")
    settings = diff.T.reset_index(drop=True)
    ids = pd.DataFrame({"id": [r.id for r in comp.runs]})
    return pd.concat([ids, settings, summary], axis=1)


def scaling_study(comp: Comparison, target_loss: float | None = None) -> pd.DataFrame:
    """Per setting that scales (config minus the worker count, seed and names) and world size: samples/s
    (mean over seeds) against ideal linear scaling from the smallest world size, efficiency, time and
    samples to the target loss, and each point's global batch and effective lr (the linear scaling rule)."""
    summary = summary_table(comp, target_loss)
    rows = []
    for run, result in zip(comp.runs, summary.itertuples(index=False), strict=True):
        cfg = run_config(run)
        rows.append({"series": config_key(run.config), "world_size": run.world_size,
                     "global_batch": cfg.global_batch if cfg else None,
                     "effective_lr": cfg.effective_lr if cfg else None, "samples_per_s": result.samples_per_s,
                     "time_to_target_s": result.time_to_target_s, "samples_to_target": result.samples_to_target,
                     "run": run_label(run)})
    columns = ["setting", "world_size", "runs", "global_batch", "effective_lr", "samples_per_s",
               "ideal_samples_per_s", "efficiency", "time_to_target_s", "samples_to_target"]
    df = pd.DataFrame(rows)
    if df.empty or df["world_size"].nunique() < 2:
        return pd.DataFrame(columns=columns)
    points = df.groupby(["series", "world_size"], as_index=False, sort=True).agg(
        runs=("run", "size"), global_batch=("global_batch", "first"), effective_lr=("effective_lr", "first"),
        samples_per_s=("samples_per_s", "mean"), time_to_target_s=("time_to_target_s", "mean"),
        samples_to_target=("samples_to_target", "mean"))
    out = []
    for number, (_, series) in enumerate(points.groupby("series", sort=False), start=1):
        base = series.iloc[0]  # sorted: the smallest world size
        for row in series.itertuples(index=False):
            ideal = base["samples_per_s"] * row.world_size / base["world_size"] if base["samples_per_s"] else None
            out.append({**row._asdict(), "setting": f"setting {number}", "ideal_samples_per_s": ideal,
                        "efficiency": row.samples_per_s / ideal if ideal and row.samples_per_s else None})
    return pd.DataFrame(out, columns=columns)


def load_sweep(s: Session, sweep: str, budget: int = 500) -> Comparison:
    """Every run of a sweep (up to MAX_SWEEP_RUNS), with a smaller point budget per run than Compare's."""
    from ddpdash.db.runs import sweep_run_ids

    ids = sweep_run_ids(s, sweep)[:MAX_SWEEP_RUNS]
    runs = [get_run(s, i) for i in ids]
    comp = Comparison(runs, summaries=run_metric_summaries(s, ids).set_index("run_id"))
    for r in runs:
        comp.loss[r.id] = metric_series(s, r.id, Metric.LOSS, max_points=budget)
    return comp


def sweeps_frame(runs: pd.DataFrame) -> pd.DataFrame:
    """The Runs table grouped by sweep: its runs, how many are queued, running, succeeded, failed, and the
    best final loss."""
    df = runs[runs["sweep"].astype(bool)] if len(runs) else runs
    columns = ["sweep", "runs", "queued", "running", "succeeded", "failed", "best_final_loss", "started"]
    if df.empty:
        return pd.DataFrame(columns=columns)
    out = df.groupby("sweep", as_index=False).agg(
        runs=("id", "size"), queued=("status", lambda v: int((v == RunStatus.QUEUED).sum())),
        running=("status", lambda v: int(v.isin([RunStatus.RUNNING, RunStatus.STOPPING]).sum())),
        succeeded=("status", lambda v: int((v == RunStatus.SUCCEEDED).sum())),
        failed=("status", lambda v: int(v.isin([RunStatus.FAILED, RunStatus.LOST]).sum())),
        best_final_loss=("final_loss", "min"), started=("started", "min"))
    return out.sort_values("started", ascending=False)[columns]


def config_diff(runs: list[RunInfo]) -> pd.DataFrame:
    """Only the settings that differ across the runs: one row per setting, one column per run. Configs are read
    as RunConfig where they parse, so one stored by an earlier version (`model` for `recipe`) compares alike."""
    configs = [cfg.to_dict() if (cfg := run_config(r)) else r.config for r in runs]
    keys = sorted(set().union(*configs))
    rows = []
    for key in keys:
        values = [c.get(key) for c in configs]
        if any(json.dumps(v, sort_keys=True) != json.dumps(values[0], sort_keys=True) for v in values):
            rows.append({"setting": key, **{run_label(r): _cell(v) for r, v in zip(runs, values, strict=True)}})
    return pd.DataFrame(rows, columns=["setting", *(run_label(r) for r in runs)])


def _cell(value: object) -> str:
    return json.dumps(value) if isinstance(value, list | dict) else str(value)


def summary_table(comp: Comparison, target_loss: float | None = None) -> pd.DataFrame:
    """Per run: final and best loss and samples/s as the Runs page shows them (db.queries.
    run_metric_summaries: one definition), and the time and samples to reach `target_loss` (the first
    step whose mean loss over ranks is at or below it)."""
    rows = []
    for run in comp.runs:
        loss = comp.loss[run.id]
        row = {"run": run_label(run), "status": run.status, "final_loss": comp.summary(run.id, "final_loss"),
               "best_loss": comp.summary(run.id, "best_loss"), "total_time_s": run.duration_s,
               "samples_per_s": comp.summary(run.id, "samples_per_s"),
               "comm_share": comp.summary(run.id, "comm_share"), "time_to_target_s": None,
               "samples_to_target": None}
        if target_loss is not None and len(loss):
            mean = loss.groupby("step", as_index=False).agg(value=("value", "mean"), time=("time", "max"))
            hit = mean[mean["value"] <= target_loss]
            if len(hit):
                first = hit.iloc[0]
                start = run.started_at or float(loss["time"].min())
                row["time_to_target_s"] = float(first["time"]) - start
                batch = _global_batch(run)
                row["samples_to_target"] = int(first["step"]) * batch if batch else None
        rows.append(row)
    return pd.DataFrame(rows)


MAX_RUN_ID = 2**63 - 1  # what the store's integer keys hold


def parse_run_id(text: str | None) -> int | None:
    """A run id from a URL or a form: ASCII digits only (not "²" or "٣", which str.isdigit accepts),
    within the store's integer range; None otherwise."""
    text = (text or "").strip()
    if not text or not text.isascii() or not text.isdecimal() or len(text) > 19:
        return None
    value = int(text)
    return value if 0 < value <= MAX_RUN_ID else None


def parse_run_ids(raw: str | list[str] | None) -> list[int]:
    """Run ids from a URL query (`?runs=3,5,9` or repeated `runs=`); junk is ignored."""
    if not raw:
        return []
    parts = raw if isinstance(raw, list) else [raw]
    ids: list[int] = []
    for part in parts:
        for token in str(part).split(","):
            run_id = parse_run_id(token)
            if run_id is not None and run_id not in ids:
                ids.append(run_id)
    return ids[:MAX_COMPARE]


@dataclass(frozen=True)
class RunsPage:
    rows: pd.DataFrame  # the page's runs, RUN_COLUMNS
    matched: int  # runs the filter lets through
    total: int
    pages: int


# Computed from rollups: sorted after reading them.
METRIC_SORTS = ("final_loss", "best_loss", "samples_per_s", "comm_share")


def runs_page(s: Session, f: RunFilter, sort_by: str = "id", descending: bool = True, page: int = 1,
              size: int = 50) -> RunsPage:
    """One page of the Runs table, filtered, sorted and paged in SQL: only the page's runs are read whole
    (settings parsed, metric summaries from rollups), so 10,000 runs cost what 50 do. A sort by a metric
    reads the summaries of every run that matches, then pages."""
    if sort_by not in SORTABLE:
        raise ValueError(f"cannot sort by {sort_by!r}; choose one of {', '.join(SORTABLE)}")
    where = run_conditions(statuses=f.statuses, trains=f.models, backends=f.backends, tag=f.tag, text=f.text,
                           sweep=f.sweep)
    matched = count_runs(s, where)
    pages = max(1, -(-matched // size))
    page = min(max(page, 1), pages)
    if sort_by in METRIC_SORTS:
        every = run_ids_page(s, where, "id", True, 0, None)
        summaries = run_metric_summaries(s, every).set_index("run_id")[sort_by]
        ordered = summaries.sort_values(ascending=not descending, na_position="last", kind="stable")
        ids = [int(i) for i in ordered.index[(page - 1) * size: page * size]]
    else:
        ids = run_ids_page(s, where, sort_by, descending, (page - 1) * size, size)
    runs = [get_run(s, i) for i in ids]
    rows = _run_rows(runs, run_metric_summaries(s, ids).set_index("run_id"))
    return RunsPage(rows, matched, count_runs(s), pages)
