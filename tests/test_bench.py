"""Each benchmark in its tiny smoke mode, so none of them rots (the figures are not checked here:
benchmarks are not tests)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow
LINE = re.compile(r"^.+: .+ \(target .+\) (PASS|MISS)$", re.M)


def test_every_benchmark_runs_and_prints_a_result_line_per_target(tmp_path) -> None:  # type: ignore[no-untyped-def]
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "run.py"), "--smoke"], capture_output=True,
                            text=True, timeout=900, cwd=tmp_path, env={**__import__("os").environ,
                                                                       "DDPDASH_HOME": str(tmp_path)})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = result.stdout.split("== summary", 1)[1]
    targets = [m.group(0).split(":")[0] for m in LINE.finditer(summary)]
    # logging ×4 (the trainer and a script's ddpdash.log(), 1 process and 2 ranks), log() cost, ingest ×2,
    # chart, live (8 ranks; 64 ranks: tick and first draw), compare, long run ×3 (bytes per point, whole and last
    # 1 % charts), trainer and a recipe against plain DDP, launch, the recipe check, the Runs page ×2, stacks,
    # launch on Slurm, the writer at 64 ranks, the dashboard's memory
    assert len(targets) == 25, summary


def test_a_batch_costs_its_quad_and_what_spills_into_the_next() -> None:
    from bench.logging_overhead import Overhead

    # Ten quads a batch: the batch's quad 20 % slower, the quad after it 5 % faster (the supervisor
    # still writing during its unlogged first segment), the rest at 1.
    run = [(1.2, True), (0.95, False), *[(1.0, False)] * 8] * 5
    found = Overhead.of([run, run])
    assert found.per_step == 1.0 and found.quads == 100
    assert abs(found.batches - (0.2 - 0.05) / 10) < 1e-12
    assert Overhead.of([[(1.01, False)] * 4]).total == 1.01  # no batch at all: the median
