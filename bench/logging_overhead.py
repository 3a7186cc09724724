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
from bench.common import ROOT, Result, describe, interleaved, median_spread, parser, print_results, ratios

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
        subprocess.run(cmd, check=True, env=env, cwd=ROOT, capture_output=True)
        return float(json.loads(out.read_text())["elapsed_with_close"])


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
            short = max(steps // 4, 50)
            print(f"-- {label}, {short} steps, for reference")
            compare(["none", "ddpdash", *others], short, max(1, min(repeats, 3)), ranks)
    return results


def main() -> None:
    args = parser(__doc__ or "").parse_args()
    steps, repeats = (60, 1) if args.smoke else (1500, 3) if args.quick else (3000, 7)
    print_results(measure(steps, repeats))


if __name__ == "__main__":
    main()
