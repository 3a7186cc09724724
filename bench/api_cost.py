"""Target — the cost of `ddpdash.log()` on the rank: a call with 4 values, in a process whose logger hands
its batches to a sender that keeps nothing (the rank's side alone: the sending thread is parked), timed
in blocks of 1000 calls; beside `wandb.log` (offline mode) and `mlflow.log_metrics` when installed, in the
same run. Target: median ≤ 2 µs a call.

    python bench/api_cost.py [--quick | --smoke]
"""

from __future__ import annotations

import importlib.util
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import Result, run_main
from ddpdash.db.columns import Batch

BLOCK = 1000
TARGET_US = 2.0


class KeepNothing:
    dropped = 0

    def send(self, batch: Batch) -> None: ...
    def flush(self) -> None: ...
    def close(self, batch: Batch) -> None: ...


def ddpdash_log() -> Callable[[int], None]:
    from ddpdash import api
    from ddpdash.trainer.metrics import RankLogger

    # This process's run, without a store: the rank's side is what is timed.
    api._current = api._Run(logger=RankLogger(KeepNothing(), 0, send_interval_s=3600.0))
    values = {"loss": 0.5, "acc": 0.9, "lr": 0.1, "grad_norm": 1.5}
    return lambda step: api.log(values, step=step)


def wandb_log() -> Callable[[int], None] | None:
    if importlib.util.find_spec("wandb") is None:
        return None
    import wandb

    wandb.init(mode="offline", dir=tempfile.mkdtemp())
    return lambda step: wandb.log({"loss": 0.5, "acc": 0.9, "lr": 0.1, "grad_norm": 1.5}, step=step)


def mlflow_log() -> Callable[[int], None] | None:
    if importlib.util.find_spec("mlflow") is None:
        return None
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{tempfile.mkdtemp()}/mlflow.db")
    mlflow.start_run()
    return lambda step: mlflow.log_metrics({"loss": 0.5, "acc": 0.9, "lr": 0.1, "grad_norm": 1.5}, step=step)


def per_call_us(log: Callable[[int], None], blocks: int) -> list[float]:
    out, step = [], 0
    for _ in range(blocks):
        start = time.perf_counter()
        for _ in range(BLOCK):
            log(step)
            step += 1
        out.append((time.perf_counter() - start) / BLOCK * 1e6)
    return out


def measure(blocks: int) -> list[Result]:
    candidates = {"ddpdash.log": ddpdash_log(), "wandb.log (offline)": wandb_log(),
                  "mlflow.log_metrics": mlflow_log()}
    missing = [name for name, fn in candidates.items() if fn is None]
    if missing:
        print(f"not installed, not measured: {', '.join(missing)}")
    timings: dict[str, list[float]] = {name: [] for name, fn in candidates.items() if fn is not None}
    for _ in range(3):  # the candidates alternate, so the host's drift hits each alike
        for name, fn in candidates.items():
            if fn is not None:
                timings[name] += per_call_us(fn, max(blocks // 3, 1) if name == "ddpdash.log" else 1)
    for name, values in timings.items():
        print(f"  {name}: median {statistics.median(values):.2f} µs a call of 4 values ({len(values)} blocks)")
    ours = statistics.median(timings["ddpdash.log"])
    return [Result("ddpdash.log() of 4 values", f"{ours:.2f} µs a call (median)", f"≤ {TARGET_US} µs",
                   ours <= TARGET_US)]


SIZES = {"smoke": (3,), "quick": (300,), "full": (1500,)}


def main() -> None:
    run_main(__doc__, SIZES, measure)


if __name__ == "__main__":
    main()
