"""Profile on demand: every rank of a running run records the next N steps with `torch.profiler` (CPU, and
CUDA where the rank has a GPU; shapes and memory), writes its Chrome trace (gzipped: Perfetto and
chrome://tracing open it) and its top operators into the run folder, and posts a `profile` event.

    ask_profile(engine, run_id, steps) -> request id    the Live page's button, `ddpdash profile`
    wait_for_profiles(run_dir, request_id, ranks)      until every rank has written its operators
    ProfileHook(requests, folder_of, rank, device)     in a rank: tick(step) after each step (ddpdash.api: each log())

Nothing runs outside the profiled steps: a step pays one attribute read. Holistic Trace Analysis, where
installed (`pip install HolisticTraceAnalysis`), adds its temporal breakdown of the traces (hta_breakdown).
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddpdash.db.vocab import EventKind

from .requests import PROFILE, RankRequests, ask, withdraw
from .rundir import RunDir

log = logging.getLogger(__name__)
TOP_OPERATORS = 15
MAX_PROFILE_STEPS = 1000
TRACE_SUFFIX = ".trace.json.gz"
OPS_SUFFIX = ".ops.json"


def trace_file(folder: Path, rank: int) -> Path:
    return folder / f"rank{rank}{TRACE_SUFFIX}"


def ops_file(folder: Path, rank: int) -> Path:
    return folder / f"rank{rank}{OPS_SUFFIX}"


# ---- in a rank --------------------------------------------------------------------------------------------
class ProfileHook:
    """A rank's profiler, started when a request comes (RankRequests.profile) and stopped N steps later."""

    def __init__(self, requests: RankRequests, rank: int, device_type: str,
                 event: Callable[[str, str, str], None]) -> None:
        self.requests = requests
        self.rank = rank
        self.device_type = device_type
        self.event = event  # RankLogger.event: (kind, message, detail)
        self.profiler: Any = None
        self.request_id = ""
        self.steps = 0
        self.first_step = 0

    def tick(self, step: int) -> None:
        """After each step: start a requested profile (it covers the next N steps), or count one and finish."""
        if self.profiler is None:
            if self.requests.profile is not None:
                self._start(step)
            return
        if step - self.first_step + 1 >= self.steps:
            self._finish(step)

    def _start(self, step: int) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile

        wanted = self.requests.take_profile()
        assert wanted is not None
        self.request_id, self.steps = wanted[0], min(wanted[1], MAX_PROFILE_STEPS)
        activities = [ProfilerActivity.CPU]
        if self.device_type == "cuda" and torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        self.profiler = profile(activities=activities, record_shapes=True, profile_memory=True)
        self.profiler.__enter__()
        self.first_step = step + 1

    def _finish(self, step: int) -> None:
        profiler, self.profiler = self.profiler, None
        folder = self.requests.run_dir.profile(self.request_id)
        try:
            profiler.__exit__(None, None, None)
            folder.mkdir(parents=True, exist_ok=True)
            ops = top_operators(profiler.key_averages(), cuda=self.device_type == "cuda")
            trace = write_trace(profiler, trace_file(folder, self.rank))
            summary = {"request": self.request_id, "rank": self.rank, "steps": [self.first_step, step],
                       "trace": str(trace), "ops": ops}
            tmp = folder / f".rank{self.rank}.ops.tmp"
            tmp.write_text(json.dumps(summary))
            os.replace(tmp, ops_file(folder, self.rank))
        except Exception as exc:  # a profile must never take the rank down
            log.warning("profile not written: %s", exc)
            self.event(EventKind.PROFILE, f"rank {self.rank}: the profile could not be written: {exc}", "")
            return
        top = ops[0]["name"] if ops else "?"
        self.event(EventKind.PROFILE, f"rank {self.rank}: profiled steps {self.first_step}–{step}; "
                                      f"most self time in {top}", json.dumps(summary))


def write_trace(profiler: Any, path: Path) -> Path:
    raw = path.with_name(path.name.removesuffix(".gz") + ".tmp")
    profiler.export_chrome_trace(str(raw))
    with open(raw, "rb") as src, gzip.open(path, "wb", compresslevel=5) as dst:
        shutil.copyfileobj(src, dst)
    raw.unlink()
    return path


def top_operators(averages: Any, cuda: bool = False, limit: int = TOP_OPERATORS) -> list[dict[str, Any]]:
    """The operators with the most self time (device time on a GPU rank), as plain rows."""
    def self_time(e: Any) -> float:
        return float(e.self_device_time_total if cuda else e.self_cpu_time_total)

    rows = sorted(averages, key=self_time, reverse=True)[:limit]
    total = sum(self_time(e) for e in averages) or 1.0
    return [{"name": e.key, "calls": int(e.count), "self_ms": self_time(e) / 1e3, "share": self_time(e) / total,
             "total_ms": float(e.device_time_total if cuda else e.cpu_time_total) / 1e3,
             "self_cpu_mem_mb": float(e.self_cpu_memory_usage) / 2**20} for e in rows]


# ---- asking, and reading the answers ------------------------------------------------------------------------
@dataclass(frozen=True)
class RankProfile:
    rank: int
    steps: tuple[int, int]
    trace: Path
    ops: list[dict[str, Any]]

    @classmethod
    def of(cls, summary: dict[str, Any]) -> RankProfile:
        """From the summary a rank writes (its ops file, and its `profile` event's detail)."""
        first, last = summary["steps"]
        return cls(int(summary["rank"]), (int(first), int(last)), Path(summary["trace"]), summary["ops"])


def ask_profile(run_dir: RunDir, steps: int) -> str:
    if not 1 <= steps <= MAX_PROFILE_STEPS:
        raise ValueError(f"steps must be between 1 and {MAX_PROFILE_STEPS}, got {steps}")
    return ask(run_dir, PROFILE, steps=steps)


def read_profiles(folder: Path) -> list[RankProfile]:
    out = []
    for path in sorted(folder.glob(f"rank*{OPS_SUFFIX}")):
        out.append(RankProfile.of(json.loads(path.read_text())))
    return sorted(out, key=lambda p: p.rank)


def wait_for_profiles(run_dir: RunDir, request_id: str, ranks: int, timeout_s: float,
                      still_running: Callable[[], bool] = lambda: True) -> list[RankProfile]:
    """Every rank's profile once all `ranks` have written theirs (or what came by the deadline, or when
    the run ended); the request is withdrawn either way."""
    folder = run_dir.profile(request_id)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline and still_running():
            if len(list(folder.glob(f"rank*{OPS_SUFFIX}"))) >= ranks:
                break
            time.sleep(0.2)
        return read_profiles(folder)
    finally:
        withdraw(run_dir, request_id)


def latest_profiles(events: Any) -> list[RankProfile]:
    """The newest profile's ranks, from a run's events frame (db.queries.events)."""
    found = events[(events["kind"] == EventKind.PROFILE) & (events["detail"].astype(bool))]
    if found.empty:
        return []
    summaries = [json.loads(detail) for detail in found["detail"]]
    newest = summaries[-1]["request"]
    return sorted((RankProfile.of(s) for s in summaries if s["request"] == newest), key=lambda p: p.rank)


def profile_table(profile: RankProfile) -> Any:
    """A rank's top operators as a frame: operator, calls, self ms, share of all self time, total ms."""
    import pandas as pd

    frame = pd.DataFrame(profile.ops, columns=["name", "calls", "self_ms", "share", "total_ms", "self_cpu_mem_mb"])
    return frame.rename(columns={"name": "operator", "self_ms": "self ms", "total_ms": "total ms",
                                 "self_cpu_mem_mb": "self CPU memory (MB)"})


def hta_breakdown(folder: Path) -> Any:
    """Holistic Trace Analysis' temporal breakdown (idle, compute, communication time per rank) of a profile's
    traces, where HTA is installed; None where it is not. It reads GPU kernels: CPU-only traces have none."""
    try:
        from hta.trace_analysis import TraceAnalysis  # type: ignore[import-not-found]
    except ImportError:
        return None
    return TraceAnalysis(trace_dir=str(folder)).get_temporal_breakdown(visualize=False)
