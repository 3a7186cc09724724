"""What the Live page shows, computed without Streamlit: incremental series, progress, the per-rank
table with straggler/hang flags, and machine stats."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import psutil
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from ddpdash.dashboard.charts import MAX_RANK_LINES
from ddpdash.db.queries import DEFAULT_POINT_BUDGET, SERIES_COLUMNS, metric_series
from ddpdash.db.runs import RunInfo
from ddpdash.db.vocab import EventKind, Metric, RankStatus, RunStatus
from ddpdash.trainer import health
from ddpdash.trainer.rundir import RunDir

LIVE_METRICS = Metric.LIVE
STALE_HEARTBEAT_S = 15.0


# Points per metric over every rank: a line of DEFAULT_POINT_BUDGET points each for up to 16 ranks, fewer
# past that (64 ranks: 250 each), so a refresh reads and draws the same whatever the world size.
TOTAL_POINT_BUDGET = 16_000
MIN_POINTS_PER_RANK = 200


def point_budget(world_size: int) -> int:
    return max(MIN_POINTS_PER_RANK, min(DEFAULT_POINT_BUDGET, TOTAL_POINT_BUDGET // max(world_size, 1)))


@dataclass
class SeriesCache:
    """The points a Live view already holds; each refresh fetches only points after the last step,
    and re-reads a downsampled copy when a line would outgrow the point budget."""

    run_id: int
    budget: int = DEFAULT_POINT_BUDGET
    frames: dict[str, pd.DataFrame] = field(default_factory=dict)
    fetches: int = 0

    def refresh(self, s: Session, names: tuple[str, ...] = LIVE_METRICS) -> dict[str, pd.DataFrame]:
        for name in names:
            held = self.frames.get(name)
            if held is None or held.empty:
                self.frames[name] = metric_series(s, self.run_id, name, max_points=self.budget)
            else:
                after = int(held["step"].min() if held.empty else held.groupby("rank")["step"].max().min())
                new = metric_series(s, self.run_id, name, max_points=self.budget, after_step=after)
                merged = pd.concat([held[held["step"] <= after], new], ignore_index=True)
                merged = merged.drop_duplicates(["rank", "step"], keep="last").sort_values(["rank", "step"])
                if merged.groupby("rank").size().max() > self.budget:
                    merged = metric_series(s, self.run_id, name, max_points=self.budget)
                self.frames[name] = merged.reset_index(drop=True)
            self.fetches += 1
        return self.frames

    def get(self, name: str) -> pd.DataFrame:
        return self.frames.get(name, pd.DataFrame(columns=SERIES_COLUMNS))


@dataclass(frozen=True)
class Progress:
    done: int
    total: int | None
    elapsed_s: float
    eta_s: float | None

    @property
    def fraction(self) -> float:
        return min(self.done / self.total, 1.0) if self.total else 0.0

    def text(self) -> str:
        total = self.total or "?"
        eta = f" · ETA {format_duration(self.eta_s)}" if self.eta_s is not None else ""
        return f"{self.done}/{total} steps · {format_duration(self.elapsed_s)} elapsed{eta}"


def progress(run: RunInfo, states: pd.DataFrame, now: float | None = None) -> Progress:
    now = now or time.time()
    done = int(states["step"].min()) if len(states) else 0
    start = run.started_at or run.created_at
    elapsed = ((run.ended_at or now) - start) if start else 0.0
    eta = None
    if run.is_active and run.total_steps and done > 0:
        eta = elapsed / done * max(run.total_steps - done, 0)
    return Progress(done, run.total_steps, elapsed, eta)


def format_duration(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    seconds = int(seconds)
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


def _last_per_rank(df: pd.DataFrame) -> pd.Series:
    """Each rank's newest value (the frame in (rank, step) order, as the cache keeps it)."""
    if df.empty:
        return pd.Series(dtype=float)
    return df.groupby("rank")["value"].last()


def hang_began(cache: SeriesCache, run: RunInfo, now: float | None = None) -> float | None:
    """When the run's current hang began (trainer.health.hang_began), None while no rank is stalled."""
    return health.hang_began(cache.get(Metric.LOSS), now or time.time(), hang_after_s(run))


def hang_after_s(run: RunInfo) -> float:
    return float(run.config.get("hang_after_s") or health.HANG_AFTER_S)


def rank_table(run: RunInfo, states: pd.DataFrame, cache: SeriesCache, now: float | None = None) -> pd.DataFrame:
    """One row per rank with a plain-words flag for stale heartbeats, stalled ranks and stragglers."""
    now = now or time.time()
    quiet = health.quiet_per_rank(cache.get(Metric.LOSS), now)
    loss = _last_per_rank(cache.get(Metric.LOSS))
    speed = _last_per_rank(cache.get(Metric.SAMPLES_PER_S))
    step_time = _last_per_rank(cache.get(Metric.STEP_TIME))
    straggler = health.find_straggler(cache.get(Metric.STEP_TIME))
    rows = []
    for st_row in states.itertuples(index=False):
        rank = int(st_row.rank)
        age = now - float(st_row.heartbeat_at) if st_row.heartbeat_at else None
        rows.append({
            "rank": rank, "status": st_row.status, "step": int(st_row.step),
            "loss": loss.get(rank), "samples/s": speed.get(rank), "step time (s)": step_time.get(rank),
            "heartbeat age (s)": round(age, 1) if age is not None else None,
            "host": st_row.host, "device": st_row.device,
            "flag": rank_flag(run, st_row.status, age, rank, quiet.get(rank), straggler),
        })
    return pd.DataFrame(rows, columns=["rank", "status", "step", "loss", "samples/s", "step time (s)",
                                       "heartbeat age (s)", "host", "device", "flag"])


def rank_flag(run: RunInfo, status: str, heartbeat_age: float | None, rank: int,
              quiet: health.Quiet | None = None, straggler: health.Straggler | None = None) -> str:
    """The heartbeat says the process is alive (its metrics thread still talks); steps say it works:
    a rank stuck in a collective keeps its heartbeat and stops stepping."""
    if not run.is_active or status != RankStatus.RUNNING:
        return ""
    if heartbeat_age is not None and heartbeat_age > STALE_HEARTBEAT_S:
        return f"no heartbeat for {heartbeat_age:.0f} s: the process is frozen or dead"
    if health.stalled(quiet, hang_after_s(run)):
        assert quiet is not None
        return (f"no new step for {quiet[0]:.0f} s (it logs every {quiet[1]:.1f} s): hung — a collective "
                "waiting on a peer, a deadlock — or in a long pause (evaluation, checkpoint)")
    if straggler is not None and straggler.rank == rank:
        return straggler.text()
    return ""


BREAKDOWN_WINDOW = 30  # the newest points per rank a step's breakdown is the median of
EXPOSED_COMM = "communication (not overlapped)"
BACKWARD_COMPUTE = "backward compute"
PHASE_LABELS = {Metric.DATA_TIME: "data wait", Metric.FORWARD_TIME: "forward", Metric.BACKWARD_TIME: "backward",
                Metric.OPTIMIZER_TIME: "optimizer"}
BREAKDOWN_COLUMNS = ["rank", "phase", "order", "seconds"]


def step_breakdown(cache: SeriesCache, window: int = BREAKDOWN_WINDOW) -> pd.DataFrame:
    """Per rank, where a step's time goes (the median over its newest points of each phase): data wait,
    forward, backward, optimizer — the backward split into its own compute and the communication that
    did not overlap it, where DDP's sampled timings are there. Long frame [rank, phase, order, seconds]."""
    medians = {name: _recent_median(cache.get(name), window) for name in (*Metric.PHASES, Metric.COMM_TIME,
                                                                          Metric.COMM_OVERLAP_TIME)}
    rows = []
    for rank in sorted(set().union(*(m.index for m in medians.values()))):
        exposed = None
        if rank in medians[Metric.COMM_TIME].index:
            overlap = medians[Metric.COMM_OVERLAP_TIME].get(rank, 0.0)
            exposed = max(float(medians[Metric.COMM_TIME][rank]) - float(overlap), 0.0)
        for order, name in enumerate(Metric.PHASES):
            if rank not in medians[name].index:
                continue
            seconds = float(medians[name][rank])
            label = PHASE_LABELS[name]
            if name == Metric.BACKWARD_TIME and exposed is not None:
                exposed = min(exposed, seconds)
                rows.append((int(rank), EXPOSED_COMM, order + 0.5, exposed))
                seconds, label = seconds - exposed, BACKWARD_COMPUTE
            rows.append((int(rank), label, order, seconds))
    return pd.DataFrame(rows, columns=BREAKDOWN_COLUMNS)


def _recent_median(df: pd.DataFrame, window: int) -> pd.Series:
    if df.empty:
        return pd.Series(dtype=float)
    return df.groupby("rank").tail(window).groupby("rank")["value"].median()  # (rank, step) order: no sort


OUTLIER_RANKS = 3


def outlier_ranks(df: pd.DataFrame, k: int = OUTLIER_RANKS, window: int = BREAKDOWN_WINDOW) -> list[int]:
    """The `k` ranks whose recent values (the median of their newest points) lie furthest from the
    ranks' median: what a many-rank chart draws besides the band, unless the user picks."""
    medians = _recent_median(df, window).dropna()
    far = (medians - medians.median()).abs().sort_values(ascending=False, kind="stable")
    return sorted(int(r) for r in far.index[:k])


def drawn_ranks(world_size: int, picked: list[int], loss: pd.DataFrame) -> list[int] | None:
    """Which ranks the Live charts draw as lines: every one (None) for a few ranks; for many, the ranks
    the user picked, else the outliers."""
    if world_size <= MAX_RANK_LINES:
        return None
    return sorted(picked) if picked else outlier_ranks(loss)


def first_nonfinite(events: pd.DataFrame) -> str | None:
    """The run's first non-finite loss or gradient norm, as its event said it (the earliest step's)."""
    found = events[events["kind"] == EventKind.NONFINITE]
    if found.empty:
        return None
    steps = found["message"].str.extract(r"at step (\d+)", expand=False).astype(float).fillna(float("inf"))
    # At the same step a loss comes before a gradient norm: the all-reduce spread a rank's NaN loss to the others.
    order = steps * 2 + found["message"].str.contains("gradient").astype(float)
    return str(found.loc[order.idxmin(), "message"])


def failures(events: pd.DataFrame) -> pd.DataFrame:
    return events[events["kind"].isin(EventKind.PROBLEMS)]


@dataclass(frozen=True)
class SystemStats:
    cpu_percent: float
    mem_used_gib: float
    mem_total_gib: float
    gpus: tuple[dict[str, float | str], ...]


def system_stats() -> SystemStats:
    mem = psutil.virtual_memory()
    return SystemStats(psutil.cpu_percent(interval=None), (mem.total - mem.available) / 2**30, mem.total / 2**30,
                       tuple(nvml_stats()))


def nvml_stats() -> list[dict[str, float | str]]:
    """Per-GPU utilisation and memory through NVML (nvidia-ml-py, optional); empty without it."""
    try:
        import pynvml
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except Exception:  # no driver on this machine
        return []
    out: list[dict[str, float | str]] = []
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            util = pynvml.nvmlDeviceGetUtilizationRates(handle)
            mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
            name = pynvml.nvmlDeviceGetName(handle)
            out.append({"gpu": i, "name": name if isinstance(name, str) else name.decode(),
                        "util %": float(util.gpu), "memory used (GiB)": mem.used / 2**30,
                        "memory total (GiB)": mem.total / 2**30})
    finally:
        pynvml.nvmlShutdown()
    return out


def newest_run_id(engine: Engine) -> int | None:
    from ddpdash.db.runs import list_runs

    with Session(engine) as s:
        active = list_runs(s, statuses=RunStatus.ACTIVE, limit=1)
        if active:
            return active[0].id
        latest = list_runs(s, limit=1)
    return latest[0].id if latest else None


def job_logs(run: RunInfo, folder: RunDir) -> dict[str, Path]:
    """The logs of a Slurm run besides its ranks': Slurm's own output of the job, each node's supervisor and
    torchrun (named as the Logs picker shows them)."""
    if not run.job_id:
        return {}
    out = {f"Slurm output (slurm-{run.job_id}.out)": folder.slurm_output_of(run.job_id)}
    out.update({path.name: path for path in folder.node_logs()})
    return out
