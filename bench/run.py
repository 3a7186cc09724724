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
from bench import chart_query, ingest, launch_latency, live_refresh, logging_overhead, trainer_vs_plain
from bench.common import Result, machine, parser, print_results

BENCHMARKS = (logging_overhead, ingest, chart_query, live_refresh, trainer_vs_plain, launch_latency)


def sizes(module, quick: bool, smoke: bool):  # type: ignore[no-untyped-def]
    """The arguments each benchmark's own main() would pick for the same flag."""
    table = {
        logging_overhead: ((60, 1), (1500, 3), (3000, 7)),
        ingest: ((500, 1), (25_000, 3), (50_000, 5)),
        chart_query: ((2, 5_000, 2), (8, 125_000, 5), (8, 125_000, 15)),
        live_refresh: ((2, 2_000, 2), (8, 100_000, 5), (8, 100_000, 15)),
        trainer_vs_plain: ((80, 1), (1000, 3), (2000, 7)),
        launch_latency: ((1,), (3,), (7,)),
    }[module]
    return table[0] if smoke else table[1] if quick else table[2]


def main() -> None:
    args = parser(__doc__ or "").parse_args()
    print(f"machine: {machine()}", flush=True)
    results: list[Result] = []
    for module in BENCHMARKS:
        name = module.__name__.split(".")[-1]
        print(f"\n== {name}", flush=True)
        start = time.perf_counter()
        found = module.measure(*sizes(module, args.quick, args.smoke))
        print_results(found)
        print(f"({time.perf_counter() - start:.0f} s)", flush=True)
        results.extend(found)
    print("\n== summary")
    print_results(results)


if __name__ == "__main__":
    main()
