"""Target — reading every rank's stack: `trainer.stacks.capture_run` of a hung run of 8 gloo ranks (rank 1
stalled, the others waiting in the all-reduce), beside one `py-spy dump` of a single rank in the same run.
Target: the whole capture under 5 s. Nothing is measured on the training step: a rank pays nothing until
asked (py-spy reads it from outside; the faulthandler fallback is a signal handler).

    python bench/stacks_capture.py [--quick | --smoke]
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from sqlalchemy.orm import Session

from bench.common import Result, describe, interleaved, median_spread, run_main


def measure(ranks: int, repeats: int) -> list[Result]:
    with tempfile.TemporaryDirectory() as home:
        os.environ.update({"DDPDASH_HOME": home, "DDPDASH_CPU_SLOTS": str(ranks),
                           "DDPDASH_TEST_FAULT": "stall:1:5"})
        from ddpdash.db.migrate import open_store
        from ddpdash.db.queries import rank_states
        from ddpdash.trainer import control
        from ddpdash.trainer.config import RunConfig, detect_machine
        from ddpdash.trainer.stacks import capture_run

        engine = open_store(f"sqlite:///{home}/ddpdash.db")
        cfg = RunConfig(name="hung", num_procs=ranks, width=16, depth=1, batch_size=8, max_steps=10_000,
                        checkpoint_every=0, sync_check_every=0)
        run_id = control.launch(engine, cfg, detect_machine())
        try:
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                with Session(engine) as s:
                    states = rank_states(s, run_id)
                if len(states) == ranks and int(states["step"].min()) >= 4:
                    break
                time.sleep(0.5)
            time.sleep(2.0)
            pid = int(states["pid"].iloc[0])

            def whole() -> float:
                t = time.perf_counter()
                found = capture_run(engine, run_id)
                assert len(found.stacks) == ranks and "rank 1 is in time.sleep" in found.verdict, found.verdict
                return time.perf_counter() - t

            def one() -> float:
                t = time.perf_counter()
                ok, out = control.py_spy_dump(pid)
                assert ok, out
                return time.perf_counter() - t

            times = interleaved({f"capture of {ranks} ranks": whole, "one py-spy dump": one}, repeats)
        finally:
            control.stop(engine, run_id)
            engine.dispose()
    print(f"-- a hung run of {ranks} gloo ranks (rank 1 stalled at step 5)")
    for name, values in times.items():
        print("  " + describe(name, values, " s"))
    capture, spread = median_spread(times[f"capture of {ranks} ranks"])
    single, _ = median_spread(times["one py-spy dump"])
    print(f"  the capture takes {capture / single:.1f}× one dump (the ranks are read in parallel)")
    return [Result(f"stacks of {ranks} ranks", f"{capture:.2f} s (spread {spread:.2f}; one dump {single:.2f} s)",
                   "< 5 s", capture < 5.0)]


SIZES = {"smoke": (2, 1), "quick": (8, 3), "full": (8, 7)}


def main() -> None:
    run_main(__doc__, SIZES, measure)


if __name__ == "__main__":
    main()
