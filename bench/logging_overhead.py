"""Target 1 — logging overhead: the same loop without logging, with ddpdash's writer, with MLflow
(`log_metric` to a SQLite store) and with TensorBoard's SummaryWriter; one process and two torchrun
ranks. Target: ddpdash ≤ 1.01× the loop without logging.

    python bench/logging_overhead.py [--quick | --smoke]
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import ROOT, Result, describe, interleaved, median_spread, ratios, run_main

LOOP = ROOT / "bench" / "loop.py"


def available(logger: str) -> bool:
    module = {"mlflow": "mlflow", "tensorboard": "tensorboard"}.get(logger)
    return module is None or importlib.util.find_spec(module) is not None


def run_loop(logger: str, steps: int, ranks: int) -> float:
    """One timed loop. "ddpdash" is how a launched run logs: the ranks relay to a writer in another
    process (here this one, idle otherwise, as the supervisor is); "ddpdash-direct" is how a
    hand-started run logs: each rank writes the database itself."""
    with tempfile.TemporaryDirectory() as work:
        out = Path(work) / "result.json"
        loop_logger = "ddpdash" if logger.startswith("ddpdash") else logger
        cmd = [sys.executable, str(LOOP), "--logger", loop_logger, "--steps", str(steps), "--workdir", work,
               "--out", str(out)]
        if ranks > 1:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
                   *cmd[1:]]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        store = Store(Path(work), relay=logger == "ddpdash") if loop_logger == "ddpdash" else None
        if store is not None:
            cmd += ["--run-id", str(store.run_id), "--db-url", store.url]
            env.update(store.env)
        done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
        if not out.exists():  # a teardown hiccup after the result was written does not void the timing
            raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
        result = json.loads(out.read_text())
        if store is not None:
            store.check_complete(expected=(result["steps"] + result["warmup"]) * 3 * ranks)
        # The loop's own time: the writer's final flush at close() is a one-off at the end of a run
        # (reported by the loop, not per step), so it stays out of the per-step overhead.
        return float(result["elapsed"])


class Store:
    """The database a ddpdash loop writes, its run, and (relay=True) the relay the ranks send to."""

    def __init__(self, work: Path, relay: bool) -> None:
        from sqlalchemy.orm import Session

        from db.migrate import open_store
        from db.runs import create_run
        from trainer.relay import Listener
        from trainer.relay_server import RelayServer

        self.url = f"sqlite:///{work / 'ddpdash.db'}"
        self.engine = open_store(self.url)
        with Session(self.engine) as s, s.begin():
            self.run_id = create_run(s, key=f"bench-{work.name}", name="bench", config_json="{}", world_size=1)
        self.env: dict[str, str] = {}
        self.server = None
        if relay:
            listener = Listener()
            self.server = RelayServer(self.engine, self.run_id, listener)
            self.env = listener.env()

    def check_complete(self, expected: int) -> None:
        """Every logged point is in the database: a fast writer that loses points would be no writer."""
        from sqlalchemy import func, select
        from sqlalchemy.orm import Session

        from db.models import MetricPoint

        if self.server is not None:
            self.server.drain()
        with Session(self.engine) as s:
            stored = s.scalar(select(func.count()).select_from(MetricPoint).where(MetricPoint.run_id == self.run_id))
        self.engine.dispose()
        if stored != expected:
            raise SystemExit(f"ddpdash stored {stored} points, the loop logged {expected}")


def compare(loggers: list[str], steps: int, repeats: int, ranks: int) -> dict[str, list[float]]:
    times = interleaved({name: (lambda n=name, r=ranks: run_loop(n, steps, r)) for name in loggers}, repeats)
    for name in loggers:
        print("  " + describe(name, times[name], " s"))
        if name != "none":
            med, spread = median_spread(ratios(times[name], times["none"]))
            print(f"  {name} / none: {med:.3f}× (spread {spread:.3f})")
    return times


def measure(steps: int, repeats: int) -> list[Result]:
    others = [name for name in ("mlflow", "tensorboard") if available(name)]
    missing = sorted({"mlflow", "tensorboard"} - set(others))
    if missing:
        print(f"not installed, not measured: {', '.join(missing)} (pip install -e '.[bench]')")
    results = []
    for ranks in (1, 2):
        label = "1 process" if ranks == 1 else "2 torchrun ranks"
        print(f"-- {label}, {steps} steps, log every step")
        times = compare(["none", "ddpdash", "ddpdash-direct"], steps, repeats, ranks)
        med, _ = median_spread(ratios(times["ddpdash"], times["none"]))
        results.append(Result(f"logging overhead ({label})", f"{med:.3f}×", "≤ 1.01×", med <= 1.01))
        if others:
            # MLflow logs ~20× slower: a shorter loop keeps the reference affordable.
            short = max(steps // 10, 50)
            print(f"-- {label}, {short} steps, for reference")
            compare(["none", "ddpdash", *others], short, max(1, min(repeats, 3)), ranks)
    return results


# Arguments of measure() for each mode: --smoke (the test suite), --quick, and the full run.
SIZES = {"smoke": (60, 1), "quick": (6000, 3), "full": (15000, 5)}


def main() -> None:
    run_main(__doc__, SIZES, measure)


if __name__ == "__main__":
    main()
