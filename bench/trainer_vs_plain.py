"""Target 5 — trainer vs plain DDP: ddpdash's trainer (metrics every step, relayed as in a launched run) against
bench/plain_ddp.py (same MLP on digits, batch, world size, steps) under torchrun, 2 gloo ranks, runs
interleaved. Samples/s are taken between the same two steps in both. Target ≥ 0.98×, for the built-in
recipe and for a user's recipe of the same model and data (bench/digits_recipe.py: a TensorDataset with
torch's default collate, as in the plain script).

    python bench/trainer_vs_plain.py [--quick | --smoke]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from sqlalchemy.orm import Session

from bench.common import ROOT, Result, Store, describe, interleaved, median_spread, ratios, run_main
from ddpdash.db.chunks import read_points
from ddpdash.trainer.config import RunConfig

BATCH, WIDTH, WARMUP = 32, 64, 50
FLIGHT_RECORDER_OFF = {"TORCH_FR_BUFFER_SIZE": "0", "TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}


def torchrun(*args: str, env: dict[str, str]) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **env})
    if result.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{result.stderr[-3000:]}")


def plain(steps: int) -> float:
    with tempfile.TemporaryDirectory() as work:
        out = Path(work) / "r.json"
        torchrun(str(ROOT / "bench" / "plain_ddp.py"), "--steps", str(steps), "--warmup", str(WARMUP), "--out",
                 str(out), "--batch-size", str(BATCH), "--width", str(WIDTH), env={})
        return float(json.loads(out.read_text())["samples_per_s"])


def ddpdash(steps: int, extra_env: dict[str, str] | None = None, **changes: object) -> float:
    """The trainer as ddpdash runs it: its ranks relay their metrics to a writer in another process
    (bench/relay_host.py, standing in for the supervisor), the Flight Recorder's buffer on."""
    cfg = RunConfig(name="bench", recipe="mlp", width=WIDTH, depth=2, batch_size=BATCH, max_steps=steps,
                    log_every=1, checkpoint_every=0, sync_check_every=0, num_procs=2).replace(**changes)
    with tempfile.TemporaryDirectory() as work:
        (Path(work) / "config.json").write_text(cfg.to_json())
        store = Store(Path(work), relay=True)
        torchrun("-m", "ddpdash.trainer", "--config", f"{work}/config.json", "--run-id", str(store.run_id), "--db-url",
                 store.url, env={**store.env, **(extra_env or {})})
        store.drain()
        with Session(store.engine) as s:
            loss = read_points(s, store.run_id, name="loss", rank=0)
        stamps = dict(zip(loss.step.tolist(), loss.time.tolist(), strict=True))
        store.engine.dispose()
        return (steps - WARMUP) * BATCH * 2 / (stamps[steps] - stamps[WARMUP])


def measure(steps: int, repeats: int) -> list[Result]:
    rates = interleaved({
        "plain DDP script": lambda: plain(steps),
        "ddpdash trainer": lambda: ddpdash(steps),
        "ddpdash trainer, checkpoint + sync check every 50": lambda: ddpdash(steps, checkpoint_every=50,
                                                                             sync_check_every=50),
        "ddpdash trainer, your recipe": lambda: ddpdash(steps, recipe=f"{ROOT / 'bench' / 'digits_recipe.py'}:build",
                                                         workdir=str(ROOT / "bench"), params=(f"width={WIDTH}",)),
        "ddpdash trainer, Flight Recorder off": lambda: ddpdash(steps, extra_env=FLIGHT_RECORDER_OFF),
    }, repeats)
    print(f"-- 2 gloo ranks, MLP on digits, batch {BATCH}/rank, {steps} steps (samples/s from step {WARMUP})")
    for name, values in rates.items():
        print("  " + describe(name, values, " samples/s"))
    share, spread = median_spread(ratios(rates["ddpdash trainer"], rates["plain DDP script"]))
    extra, _ = median_spread(ratios(rates["ddpdash trainer, checkpoint + sync check every 50"],
                                    rates["plain DDP script"]))
    own, own_spread = median_spread(ratios(rates["ddpdash trainer, your recipe"], rates["plain DDP script"]))
    recorder, recorder_spread = median_spread(ratios(rates["ddpdash trainer"],
                                                     rates["ddpdash trainer, Flight Recorder off"]))
    print(f"  ddpdash / plain: {share:.3f}× (spread {spread:.3f}); with checkpoints and sync checks: {extra:.3f}×; "
          f"your recipe: {own:.3f}× (spread {own_spread:.3f}); Flight Recorder on / off: {recorder:.3f}× "
          f"(spread {recorder_spread:.3f})")
    return [Result("trainer vs plain DDP", f"{share:.3f}× samples/s", "≥ 0.98×", share >= 0.98),
            Result("your recipe vs plain DDP", f"{own:.3f}× samples/s", "≥ 0.98×", own >= 0.98)]


# Arguments of measure() for each mode: --smoke (the test suite), --quick, and the full run.
SIZES = {"smoke": (80, 1), "quick": (1000, 5), "full": (2000, 7)}


def main() -> None:
    run_main(__doc__, SIZES, measure)


if __name__ == "__main__":
    main()
