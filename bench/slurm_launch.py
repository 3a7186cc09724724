"""Slurm launch latency: from ddpdash's `launch()` of a Slurm run to its first metric in the store (what
Live reads), against `sbatch` of the same torchrun job without ddpdash (bench/plain_ddp.py under srun) to
its first step, interleaved, on the one-host Slurm cluster of tests/slurm_cluster.py (started here when
it is not running). Target ≤ +1 s.

    python bench/slurm_launch.py [--quick | --smoke]
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import ROOT, Result, describe, differences, interleaved, run_main
from bench.launch_latency import ddpdash_launch
from ddpdash.trainer.config import RunConfig
from tests import slurm_cluster

TIMEOUT_S = 120.0


def plain_job(work: Path) -> float:
    """sbatch → first step of a bare torchrun job: one node, two gloo ranks, the same one-task srun."""
    out = work / f"plain-{time.time_ns()}.json"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                str(ROOT / "bench" / "plain_ddp.py"), "--steps", "5", "--warmup", "1", "--out", str(out)]
    script = work / "plain.sh"
    script.write_text("#!/bin/bash\n#SBATCH --nodes=1\n#SBATCH --ntasks-per-node=1\n#SBATCH --cpus-per-task=2\n"
                      f"#SBATCH --output={work}/plain-%j.out\n"
                      f"exec srun --ntasks-per-node=1 {shlex.join(torchrun)}\n")
    start = time.time()
    subprocess.run(["sbatch", "--parsable", str(script)], check=True, capture_output=True, text=True,
                   env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=ROOT)
    while not out.exists():
        if time.time() - start > TIMEOUT_S:
            raise SystemExit(f"the plain job wrote no first step in {TIMEOUT_S:g} s; see {work}")
        time.sleep(0.01)
    time.sleep(0.05)  # the file is written whole by then
    return float(json.loads(out.read_text())["first_step"]) - start


def ddpdash_job(home: Path) -> float:
    """launch() of the same ranks on Slurm → their first metric row, as the Live page would see it."""
    return ddpdash_launch(home, RunConfig(name="slurm-latency", launcher="slurm", num_procs=2, max_steps=100_000,
                                          checkpoint_every=0))


def measure(repeats: int) -> list[Result]:
    why = slurm_cluster.available()
    if why:
        print(f"  not measured: {why}")
        return [Result("Slurm launch latency", f"not measured ({why})", "≤ +1 s", False)]
    was_running = slurm_cluster.running()
    os.environ.update(slurm_cluster.start())
    try:
        return _measure(repeats)
    finally:
        if not was_running:
            slurm_cluster.stop()


def _measure(repeats: int) -> list[Result]:
    plain, ours = "sbatch → first step (torchrun, no ddpdash)", "ddpdash launch() on Slurm → first metric row"
    with tempfile.TemporaryDirectory() as work:
        if repeats > 1:
            plain_job(Path(work))  # the first job after slurmctld starts is slow (NOTES): not a measurement
        times = interleaved({plain: lambda: plain_job(Path(work)), ours: lambda: ddpdash_job(Path(work))}, repeats)
    for name, values in times.items():
        print("  " + describe(name, values, " s"))
    med, q1, q3 = differences(times[ours], times[plain], "ddpdash − plain")
    return [Result("Slurm launch latency", f"{med:+.2f} s (middle half {q1:+.2f} … {q3:+.2f} s; plain "
                   f"{statistics.median(times[plain]):.2f} s)", "≤ +1 s", med <= 1.0)]


# Arguments of measure() for each mode: --smoke (the test suite), --quick, and the full run.
SIZES = {"smoke": (1,), "quick": (5,), "full": (10,)}


def main() -> None:
    run_main(__doc__, SIZES, measure)


if __name__ == "__main__":
    main()
