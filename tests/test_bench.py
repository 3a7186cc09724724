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
    # logging ×2 (1 process, 2 ranks), ingest ×2, chart, live, trainer, launch
    assert len(targets) == 8, summary
