"""Target 1 — logging overhead: the same loop without logging, with ddpdash's writer, with MLflow
(`log_metric` to a SQLite store) and with TensorBoard's SummaryWriter; one process and two torchrun
ranks. Target: ddpdash ≤ 1.01× the loop without logging.

"ddpdash" is the path of every run ddpdash launches: the rank relays to its supervisor, which writes
(trainer/relay.py); "ddpdash, direct" is a hand-started torchrun, whose ranks write the database
themselves. An A/A control (the no-logging loop run twice) prints this machine's noise floor.

    python bench/logging_overhead.py [--quick | --smoke]
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import ROOT, Result, Store, describe, interleaved, quartiles, ratios, run_main

LOOP = ROOT / "bench" / "loop.py"
BASELINE, CONTROL = "no logging", "no logging again (A/A control)"
# Variant → the loop's --logger. "ddpdash" runs with a relay served by this process.
LOOP_LOGGER = {BASELINE: "none", CONTROL: "none", "ddpdash": "ddpdash", "ddpdash, direct": "ddpdash"}


def available(logger: str) -> bool:
    module = {"mlflow": "mlflow", "tensorboard": "tensorboard"}.get(logger)
    return module is None or importlib.util.find_spec(module) is not None


def run_loop(logger: str, steps: int, ranks: int) -> dict[str, float]:
    """One timed loop. "ddpdash" is how a launched run logs: the ranks relay to a writer in another
    process (here this one, idle otherwise, as the supervisor is); "ddpdash-direct" is how a
    hand-started run logs: each rank writes the database itself."""
    with tempfile.TemporaryDirectory() as work:
        out = Path(work) / "result.json"
        loop_logger = LOOP_LOGGER.get(logger, logger)
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
        # "elapsed" is the loop's own time: the writer's final flush at close() is a one-off at the end
        # of a run (reported by the loop, not per step), so it stays out of the per-step overhead.
        return {key: float(result[key]) for key in ("elapsed", "log_s", "thread_s")}


def compare(variants: list[str], steps: int, repeats: int, ranks: int) -> dict[str, list[dict[str, float]]]:
    """Interleaved rounds; per-round ratios to the loop without logging, their median and middle half.
    The A/A control (the same no-logging loop again) shows how much of a ratio is this machine's noise."""
    runs = interleaved({name: (lambda n=name: run_loop(n, steps, ranks)) for name in variants}, repeats)
    times = {name: [r["elapsed"] for r in results] for name, results in runs.items()}
    for name in variants:
        print("  " + describe(name, times[name], " s"))
    for name in variants[1:]:
        per_round = ratios(times[name], times[BASELINE])
        q1, q3 = quartiles(per_round)
        print(f"  {name} / {BASELINE}: median {statistics.median(per_round):.3f}× (middle half {q1:.3f}–{q3:.3f}; "
              f"fastest / fastest {min(times[name]) / min(times[BASELINE]):.3f}×)")
        on_rank = own_logging_share(runs[name])
        if on_rank:
            print(f"    in the training process: log() calls + the writer's thread = "
                  f"{on_rank:.2%} of the loop's time (same-run ratio)")
    return runs


def own_logging_share(runs: list[dict[str, float]]) -> float:
    """Median over runs of the time the training process itself spends logging — in log() calls and
    in its logging thread (ddpdash's sender or writer, CPU time) — as a share of the loop's time.
    A ratio within each run, so the host's bursts of slowness cancel; it cannot see indirect costs
    (caches, the other process's CPU), which the wall-clock ratio includes."""
    return statistics.median((r["log_s"] + r["thread_s"]) / r["elapsed"] for r in runs)


def measure(steps: int, repeats: int) -> list[Result]:
    others = [name for name in ("mlflow", "tensorboard") if available(name)]
    missing = sorted({"mlflow", "tensorboard"} - set(others))
    if missing:
        print(f"not installed, not measured: {', '.join(missing)} (pip install -e '.[bench]')")
    results = []
    for ranks in (1, 2):
        label = "1 process" if ranks == 1 else "2 torchrun ranks"
        print(f"-- {label}, {steps} steps, log every step, {repeats} rounds")
        runs = compare([BASELINE, "ddpdash", "ddpdash, direct", CONTROL], steps, repeats, ranks)
        times = {name: [r["elapsed"] for r in results] for name, results in runs.items()}
        med = statistics.median(ratios(times["ddpdash"], times[BASELINE]))
        control = statistics.median(ratios(times[CONTROL], times[BASELINE]))
        results.append(Result(f"logging overhead ({label}), wall clock", f"{med:.3f}× (A/A control {control:.3f}×)",
                              "≤ 1.01×", med <= 1.01))
        share = own_logging_share(runs["ddpdash"])
        results.append(Result(f"logging overhead ({label}), the rank's own logging time", f"{share:.2%} of the loop",
                              "≤ 1 %", share <= 0.01))
        if others:
            # MLflow logs ~20× slower: a shorter loop keeps the reference affordable.
            short = max(steps // 10, 50)
            print(f"-- {label}, {short} steps, for reference")
            compare([BASELINE, "ddpdash", *others], short, max(1, min(repeats, 3)), ranks)
    return results


# Arguments of measure() for each mode: --smoke (the test suite), --quick, and the full run.
# Many short rounds beat a few long ones here: the host's noise comes in bursts of seconds.
SIZES = {"smoke": (60, 1), "quick": (3000, 8), "full": (6000, 16)}


def main() -> None:
    run_main(__doc__, SIZES, measure)


if __name__ == "__main__":
    main()
