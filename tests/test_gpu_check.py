"""bench/gpu_check.py, the one prepared GPU check, as it runs where there is no GPU: every GPU line says
SKIP and why, and the same launch-and-verify machinery passes on CPU processes."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.mark.slow
def test_the_gpu_check_runs_and_says_what_it_skipped_without_a_gpu() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: run `python bench/gpu_check.py` itself (this test covers GPU-less machines)")
    out = subprocess.run([sys.executable, "bench/gpu_check.py", "--quick"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = dict(line.split(": ", 1) for line in out.stdout.splitlines() if ": " in line)
    for check in ("cuda", "gpu mlp amp=fp16", "gpu transformer amp=bf16", "nvml", "trainer vs plain DDP (gpu)",
                  "logging overhead (gpu)"):
        assert lines[check].startswith("SKIP no CUDA GPU here"), (check, lines[check])
    assert lines["cpu launcher (2 gloo ranks)"].startswith("PASS run 1 succeeded")
    assert "0 failed" in out.stdout
