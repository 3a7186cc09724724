"""Target 6 — launch latency: from `launch()` to the run's first metric row in the database, against
a bare `torchrun` of bench/plain_ddp.py to its first step, interleaved. Target ≤ +0.5 s.

    python bench/launch_latency.py [--quick | --smoke]
"""

from __future__ import annotations

import itertools
import json
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import ROOT, Result, describe, differences, interleaved, run_main
from ddpdash.db.migrate import open_store
from ddpdash.db.vocab import RunStatus
from ddpdash.trainer.config import Machine, RunConfig
from ddpdash.trainer.control import launch, stop

CPU = Machine(cpu_count=os.cpu_count() or 1)


def bare_torchrun() -> float:
    with tempfile.TemporaryDirectory() as work:
        out = Path(work) / "r.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(ROOT / "bench" / "plain_ddp.py"), "--steps", "5", "--warmup", "1", "--out", str(out)]
        start = time.time()
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        if not out.exists():
            raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
        return float(json.loads(out.read_text())["first_step"]) - start


def ddpdash_launch(home: Path, cfg: RunConfig | None = None) -> float:
    """`launch()` of `cfg` (two CPU ranks here by default) → its first metric row in the store."""
    os.environ["DDPDASH_HOME"] = str(home)
    engine = open_store(f"sqlite:///{home / 'ddpdash.db'}")
    cfg = cfg or RunConfig(name="latency", num_procs=2, max_steps=100_000, checkpoint_every=0)
    # The watcher must not load the machine it measures: a bare sqlite3 query every 10 ms costs
    # microseconds (an ORM session per poll cost ≈ 1 ms, a tenth of a core).
    watch = sqlite3.connect(home / "ddpdash.db", timeout=5)
    start = time.time()
    run_id = launch(engine, cfg, CPU)
    try:
        for polls in itertools.count():
            if watch.execute("SELECT 1 FROM metric_chunks WHERE run_id = ? LIMIT 1", (run_id,)).fetchone():
                return time.time() - start
            if polls % 100 == 99:
                status = watch.execute("SELECT status FROM runs WHERE id = ?", (run_id,)).fetchone()[0]
                if status in RunStatus.FINAL or time.time() - start > 120:
                    raise SystemExit(f"run {run_id} is {status} after {time.time() - start:.0f} s with no metric row")
            time.sleep(0.01)
        raise AssertionError("unreachable")
    finally:
        watch.close()
        stop(engine, run_id)
        engine.dispose()


def measure(repeats: int) -> list[Result]:
    bare, ours, control = ("bare torchrun → first step", "ddpdash launch() → first metric row",
                           "bare torchrun again (A/A control)")
    with tempfile.TemporaryDirectory() as work:
        times = interleaved({bare: bare_torchrun, ours: lambda: ddpdash_launch(Path(work)), control: bare_torchrun},
                            repeats)
    for name, values in times.items():
        print("  " + describe(name, values, " s"))
    med, q1, q3 = differences(times[ours], times[bare], "ddpdash − bare")
    noise = differences(times[control], times[bare], "A/A control − bare")[0]
    return [Result("launch latency", f"{med:+.2f} s (middle half {q1:+.2f} … {q3:+.2f}; A/A control "
                   f"{noise:+.2f} s)", "≤ +0.5 s", med <= 0.5)]


# Arguments of measure() for each mode: --smoke (the test suite), --quick, and the full run.
SIZES = {"smoke": (1,), "quick": (6,), "full": (16,)}


def main() -> None:
    run_main(__doc__, SIZES, measure)


if __name__ == "__main__":
    main()
