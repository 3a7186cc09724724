"""Helpers shared by the benchmarks: side-by-side repetitions, medians and spreads, result lines."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

ROOT = Path(__file__).resolve().parent.parent
T = TypeVar("T")
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@dataclass(frozen=True)
class Result:
    """One target's outcome: `<target>: <measured> (target <goal>) PASS|MISS`."""

    target: str
    measured: str
    goal: str
    passed: bool

    def line(self) -> str:
        return f"{self.target}: {self.measured} (target {self.goal}) {'PASS' if self.passed else 'MISS'}"


# The baselines' table: one row per point, as ddpdash stored points before it stored chunks (and as a
# metrics table usually looks), with the same index and foreign key.
ROW_TABLE_DDL = (
    "CREATE TABLE IF NOT EXISTS point_rows (id INTEGER PRIMARY KEY, run_id INTEGER NOT NULL REFERENCES runs (id) "
    "ON DELETE CASCADE, rank INTEGER NOT NULL, step INTEGER NOT NULL, name VARCHAR(64) NOT NULL, "
    "value FLOAT NOT NULL, time FLOAT NOT NULL)",
    "CREATE INDEX IF NOT EXISTS ix_point_rows_run_name_step ON point_rows (run_id, name, step)",
)
INSERT_ROW_SQL = "INSERT INTO point_rows (run_id, rank, step, name, value, time) VALUES (?,?,?,?,?,?)"


def median_spread(values: list[float]) -> tuple[float, float]:
    """Median and spread (max − min) of repeated measurements."""
    return statistics.median(values), (max(values) - min(values)) if values else 0.0


def describe(name: str, values: list[float], unit: str = "") -> str:
    med, spread = median_spread(values)
    return f"{name}: median {med:.4g}{unit}, spread {spread:.3g}{unit} over {len(values)} runs"


def interleaved(variants: dict[str, Callable[[], T]], repeats: int) -> dict[str, list[T]]:
    """Run every variant once per round, rounds repeated, the order reversed every other round
    (A B C, C B A, …): drift on a noisy machine hits all alike, and no variant always goes first."""
    out: dict[str, list[T]] = {name: [] for name in variants}
    order = list(variants)
    for round_no in range(repeats):
        for name in order if round_no % 2 == 0 else reversed(order):
            out[name].append(variants[name]())
    return out


def quartiles(values: list[float]) -> tuple[float, float]:
    """The middle half of repeated measurements (25th and 75th percentiles): the spread that counts
    when a few rounds land on a burst of the host's noise."""
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[2]


def ratios(numerator: list[float], denominator: list[float]) -> list[float]:
    """Per-round ratios (the same round's measurements divided), robust to slow drift."""
    return [a / b for a, b in zip(numerator, denominator, strict=True)]


def differences(numerator: list[float], denominator: list[float], label: str) -> tuple[float, float, float]:
    """Per-round differences (seconds added), printed as their median and middle half; returned as
    (median, 25th, 75th percentile)."""
    extra = [a - b for a, b in zip(numerator, denominator, strict=True)]
    med, (q1, q3) = statistics.median(extra), quartiles(extra)
    print(f"  {label}, per round: median {med:+.2f} s (middle half {q1:+.2f} … {q3:+.2f} s)")
    return med, q1, q3


def machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="fewer repetitions, smaller sizes")
    p.add_argument("--smoke", action="store_true", help="a tiny run that only proves the benchmark works")
    return p


def print_results(results: list[Result]) -> None:
    for r in results:
        print(r.line(), flush=True)


def mode(args: argparse.Namespace) -> str:
    return "smoke" if args.smoke else "quick" if args.quick else "full"


def run_main(doc: str | None, sizes: dict[str, tuple[int, ...]],
             measure: Callable[..., list[Result]]) -> None:
    """A benchmark's command line: pick the sizes for the mode, measure, print one line per target."""
    args = parser(doc or "").parse_args()
    print_results(measure(*sizes[mode(args)]))


def launched_rank_env(run_folder: Path) -> dict[str, str]:
    """What a launched run's ranks get besides the relay (trainer.commands.torchrun_env): the run folder,
    where they read the dashboard's requests, and the Flight Recorder's collective buffer turned on."""
    from ddpdash.trainer.commands import RUN_DIR_ENV
    from ddpdash.trainer.flight_recorder import rank_env

    return {RUN_DIR_ENV: str(run_folder), **rank_env(run_folder)}


class Store:
    """The database a ddpdash loop writes, its run, and (relay=True) the relay the ranks send to, served
    as a launched run's is: by another process, in its own session, at the supervisor's priority."""

    def __init__(self, work: Path, relay: bool) -> None:
        from sqlalchemy.orm import Session

        from ddpdash.db.migrate import open_store
        from ddpdash.db.runs import create_run

        self.url = f"sqlite:///{work / 'ddpdash.db'}"
        self.engine = open_store(self.url)
        with Session(self.engine) as s, s.begin():
            self.run_id = create_run(s, key=f"bench-{work.name}", name="bench", config_json="{}", world_size=1)
        self.env: dict[str, str] = {}
        self.host: subprocess.Popen[str] | None = None
        if relay:
            self.host = subprocess.Popen(
                [sys.executable, str(ROOT / "bench" / "relay_host.py"), "--db-url", self.url, "--run-id",
                 str(self.run_id)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True,
            )
            assert self.host.stdout is not None
            self.env = json.loads(self.host.stdout.readline())
        self.env.update(launched_rank_env(work))


    def drain(self) -> None:
        """Once the ranks have exited: wait until the relay has written everything they sent."""
        if self.host is not None and self.host.poll() is None:
            self.host.communicate(timeout=120)  # its input closes: it drains the relay and exits

    def check_complete(self, expected: int) -> None:
        """Every logged point is in the database: a fast writer that loses points would be no writer."""
        from sqlalchemy.orm import Session

        from ddpdash.db.queries import count_points

        self.drain()
        with Session(self.engine) as s:
            stored = count_points(s, self.run_id)
        self.engine.dispose()
        if stored != expected:
            raise SystemExit(f"ddpdash stored {stored} points, the loop logged {expected}")
