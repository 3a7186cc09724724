"""Run every benchmark and end with one line per target: `<target>: <measured> (target <goal>) PASS|MISS`.

    python bench/run.py            # full: several minutes, the figures recorded in bench/README.md
    python bench/run.py --quick    # fewer repetitions
    python bench/run.py --smoke    # tiny: proves each benchmark still works (the test suite runs this)
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import (
    api_cost,
    chart_query,
    compare_many,
    dashboard_memory,
    ingest,
    launch_latency,
    live_refresh,
    logging_overhead,
    long_run,
    recipe_check,
    runs_page,
    slurm_launch,
    stacks_capture,
    trainer_vs_plain,
    writer_64,
)
from bench.common import Result, machine, mode, parser, print_results

BENCHMARKS = (logging_overhead, api_cost, ingest, chart_query, live_refresh, compare_many, long_run, trainer_vs_plain,
              launch_latency, recipe_check, runs_page, stacks_capture, slurm_launch, writer_64, dashboard_memory)


def main() -> None:
    args = parser(__doc__ or "").parse_args()
    print(f"machine: {machine()}", flush=True)
    results: list[Result] = []
    for module in BENCHMARKS:
        name = module.__name__.split(".")[-1]
        print(f"\n== {name}", flush=True)
        start = time.perf_counter()
        found = module.measure(*module.SIZES[mode(args)])
        print_results(found)
        print(f"({time.perf_counter() - start:.0f} s)", flush=True)
        results.extend(found)
    print("\n== summary")
    print_results(results)


if __name__ == "__main__":
    main()
