"""Target 1 — logging overhead: the same loop without logging, with ddpdash's writer, with MLflow
(`log_metric` to a SQLite store) and with TensorBoard's SummaryWriter; one process and two torchrun
ranks. Target: ddpdash ≤ 1.01× the loop without logging.

"ddpdash" is the path of every run ddpdash launches: the rank relays to its supervisor, which writes
(trainer/relay.py); "ddpdash, direct" is a hand-started torchrun, whose ranks write the database
themselves.

The target is judged within a run: the loop logs in alternate segments about ten milliseconds
long (bench/loop.py --segment), and quads of neighbouring segments (off, on, on, off) give the
ratio. Two whole runs, one logging and one not, are also compared, for reference: on this machine
their ratio is good to several percent, not one. Both print an A/A control — the same measurement
with nothing logged — that shows how far from 1.000 noise alone lands.

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
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import ROOT, Result, Store, describe, interleaved, quartiles, ratios, run_main

LOOP = ROOT / "bench" / "loop.py"
BASELINE, CONTROL = "no logging", "no logging again (A/A control)"
# Variant → the loop's --logger. "ddpdash" runs with a relay served as the supervisor serves it.
SCRIPT = "ddpdash, your script"  # a launched user script logging with ddpdash.log(): the same relay
LOOP_LOGGER = {BASELINE: "none", CONTROL: "none", "ddpdash": "ddpdash", "ddpdash, direct": "ddpdash",
               SCRIPT: "ddpdash-api"}
RELAYED = ("ddpdash", SCRIPT)


def available(logger: str) -> bool:
    module = {"mlflow": "mlflow", "tensorboard": "tensorboard"}.get(logger)
    return module is None or importlib.util.find_spec(module) is not None


def run_loop(logger: str, steps: int, ranks: int) -> dict[str, float]:
    """One timed loop. "ddpdash" is how a launched run logs: the ranks relay to a writer in another
    process (bench/relay_host.py: its own session, the supervisor's priority); "ddpdash-direct" is how a
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
        store = Store(Path(work), relay=logger in RELAYED) if loop_logger.startswith("ddpdash") else None
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


def run_segmented(logger: str, steps: int, ranks: int, segment: int) -> list[tuple[float, bool]]:
    """One loop logging in alternate segments; per quad (off, on, on, off) the ratio of its logged to its
    unlogged time, and whether the sink was woken (sent or wrote a batch) in it."""
    with tempfile.TemporaryDirectory() as work:
        out = Path(work) / "result.json"
        cmd = [sys.executable, str(LOOP), "--logger", LOOP_LOGGER.get(logger, logger), "--steps", str(steps),
               "--workdir", work, "--out", str(out), "--segment", str(segment),
               "--warmup", str(SEGMENT_WARMUP_STEPS)]
        if ranks > 1:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
                   *cmd[1:]]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        store = Store(Path(work), relay=logger in RELAYED) if logger.startswith("ddpdash") else None
        if store is not None:
            cmd += ["--run-id", str(store.run_id), "--db-url", store.url]
            env.update(store.env)
        done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
        if not out.exists():
            raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
        result = json.loads(out.read_text())
        if store is not None:
            store.check_complete(expected=result["logged_steps"] * 3 * ranks)
        return quads(result["segments"])


def quads(segments: list[list[object]]) -> list[tuple[float, bool]]:
    """Segments are (logging, seconds, woke the sink), on, off, off, on, on, …; from the third on they
    group into quads off, on, on, off, symmetric in time, so that a drift hits both halves alike."""
    out = []
    for first in range(2, len(segments) - 3, 4):
        quad = segments[first : first + 4]
        if [bool(seg[0]) for seg in quad] != [False, True, True, False]:
            continue
        logged = float(quad[1][1]) + float(quad[2][1])  # type: ignore[arg-type]
        plain = float(quad[0][1]) + float(quad[3][1])  # type: ignore[arg-type]
        out.append((logged / plain, bool(quad[1][2])))
    return out


@dataclass(frozen=True)
class Overhead:
    """Logging's cost from quad ratios: what every step pays (the median quiet quad) plus what a batch
    costs, times the share of quads with one. A batch costs its own quad's excess (the median quad that
    sent one, less the every-step part) and the next quad's: with no idle core the supervisor may
    still be writing it there, and that lands in the next quad's unlogged first segment as often as
    not — counted as quiet, it would read below 1 and hide part of the cost. Medians, so that a burst
    of the host's noise does not count."""

    total: float
    per_step: float
    batches: float
    quads: int

    @classmethod
    def of(cls, runs: list[list[tuple[float, bool]]]) -> Overhead:
        """`runs`: each run's quads in order, (ratio, sent a batch)."""
        quiet, busy, after = [], [], []
        for quads in runs:
            for i, (ratio, woke) in enumerate(quads):
                (busy if woke else after if i and quads[i - 1][1] else quiet).append(ratio)
        count = len(quiet) + len(busy) + len(after)
        if not quiet or not busy:  # a batch in every quad (or none): one median says it all
            med = statistics.median(busy + quiet + after)
            return cls(med, med, 0.0, count)
        per_step = statistics.median(quiet)
        excess = statistics.median(busy) - per_step + (statistics.median(after) - per_step if after else 0.0)
        batches = excess * len(busy) / count
        return cls(per_step + batches, per_step, batches, count)

    def describe(self) -> str:
        return (f"{self.total:.4f}× = every step {self.per_step:.4f}× {self.batches:+.2%} for the batches "
                f"({self.quads} quads)")


def compare_segmented(variants: list[str], steps: int, repeats: int, ranks: int, segment: int) -> dict[str, Overhead]:
    runs = interleaved({name: (lambda n=name: run_segmented(n, steps, ranks, segment)) for name in variants}, repeats)
    found = {}
    for name, per_run in runs.items():
        found[name] = Overhead.of(per_run)
        spread = [Overhead.of([run]).total for run in per_run]
        print(f"  {name}: {found[name].describe()}; per run {', '.join(f'{x:.4f}×' for x in spread)}")
    return found


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


def measure(segmented_steps: int, segmented_rounds: int, steps: int, repeats: int) -> list[Result]:
    others = [name for name in ("mlflow", "tensorboard") if available(name)]
    missing = sorted({"mlflow", "tensorboard"} - set(others))
    if missing:
        print(f"not installed, not measured: {', '.join(missing)} (pip install -e '.[bench]')")
    results = []
    for ranks in (1, 2):
        label = "1 process" if ranks == 1 else "2 torchrun ranks"
        segment = SEGMENT_STEPS[ranks]
        rounds = segmented_rounds * SEGMENT_ROUNDS_FACTOR[ranks]
        print(f"-- {label}: logging on and off every {segment} steps, {segmented_steps // ranks} steps a run, "
              f"{rounds} rounds")
        found = compare_segmented(["ddpdash", SCRIPT, CONTROL], segmented_steps // ranks, rounds, ranks, segment)
        ddpdash, script, control = found["ddpdash"], found[SCRIPT], found[CONTROL]
        results.append(Result(f"logging overhead ({label})", f"{ddpdash.total:.3f}× (A/A control {control.total:.3f}×)",
                              "≤ 1.01×", ddpdash.total <= 1.01))
        results.append(Result(f"logging overhead, your script's ddpdash.log() ({label})",
                              f"{script.total:.3f}× (A/A control {control.total:.3f}×)", "≤ 1.01×",
                              script.total <= 1.01))
        print(f"-- {label}, whole runs for reference: {steps} steps, log every step, {repeats} rounds")
        compare([BASELINE, "ddpdash", "ddpdash, direct", CONTROL], steps, repeats, ranks)
        if others:
            # MLflow logs ~20× slower: a shorter loop keeps the reference affordable.
            short = max(steps // 10, 50)
            print(f"-- {label}, {short} steps, for reference")
            compare([BASELINE, "ddpdash", *others], short, max(1, min(repeats, 3)), ranks)
    return results


# Steps per segment: about ten milliseconds (a step takes ≈ 0.4 ms in one process, ≈ 2.5 ms with
# two gloo ranks on two cores).
SEGMENT_STEPS = {1: 25, 2: 5}
# Rounds of the segmented comparison: the mode's count, times this. Two ranks sharing two cores with the
# supervisor vary most from one run to the next (a run's own figure lands anywhere in ±1.5 %), so their
# pooled figure takes twice the runs.
SEGMENT_ROUNDS_FACTOR = {1: 1, 2: 2}
# Steps before the first segment; the second half of them times a step, which sets the cadence at
# which the sink is woken (every SEND_INTERVAL_S of logged steps, as its timer would).
SEGMENT_WARMUP_STEPS = 400
# Arguments of measure() for each mode: --smoke (the test suite), --quick, and the full run: steps of
# a segmented run (divided by the ranks) and its rounds, then steps and rounds of the whole-run comparison.
SIZES = {"smoke": (1200, 1, 60, 1), "quick": (30_000, 3, 3000, 4), "full": (80_000, 5, 6000, 10)}


def main() -> None:
    run_main(__doc__, SIZES, measure)


if __name__ == "__main__":
    main()
