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
    with tempfile.TemporaryDirectory() as work:
        out = Path(work) / "result.json"
        cmd = [sys.executable, str(LOOP), "--logger", logger, "--steps", str(steps), "--workdir", work,
               "--out", str(out)]
        if ranks > 1:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
                   *cmd[1:]]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
        if not out.exists():  # a teardown hiccup after the result was written does not void the timing
            raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
        # The loop's own time: the writer's final flush at close() is a one-off at the end of a run
        # (reported by the loop, not per step), so it stays out of the per-step overhead.
        return float(json.loads(out.read_text())["elapsed"])


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
        times = compare(["none", "ddpdash"], steps, repeats, ranks)
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
