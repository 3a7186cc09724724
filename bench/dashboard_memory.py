"""The dashboard's memory under load: `ddpdash ui` serving 5 browser sessions (headless Chromium) on the Live
page of a running 64-rank run (seeded through the writer, then moving on a step a second on every rank, as
a live run does) for 10 minutes of refreshes. The server's RSS (its process and children) is sampled every
few seconds; judged within the run: its mean over the last minute against its mean over the minute after
warm-up. Target: no growth (≤ 1.05×: no cache that grows without bound).

    python bench/dashboard_memory.py [--quick | --smoke]
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import Result, run_main
from bench.seed import seed_big_run

METRICS = ("loss", "samples_per_s", "step_time", "data_time")
SAMPLE_EVERY_S = 5.0


def rss_mib(proc: psutil.Process) -> float:
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            continue
    return total / 2**20


def keep_training(engine: object, run_id: int, ranks: int, first_step: int, stop: threading.Event) -> None:
    """Every rank logs a step a second: the run stays live (fresh heartbeats), Live has new points to draw."""
    from ddpdash.trainer.metrics import direct_logger

    loggers = [direct_logger(engine, run_id, r) for r in range(ranks)]  # type: ignore[arg-type]
    step = first_step
    while not stop.wait(1.0):
        step += 1
        for r, logger in enumerate(loggers):
            logger.log(step, {m: 1.0 / step + 0.01 * r for m in METRICS})
    for logger in loggers:
        logger.close(status="running")


def measure(ranks: int, steps: int, sessions: int, minutes: float, warmup_s: float) -> list[Result]:
    from playwright.sync_api import sync_playwright

    from ddpdash.db.migrate import open_store
    from tests.test_browser import CHROMIUM, CHROMIUM_ARGS, start_ui

    with tempfile.TemporaryDirectory() as folder:
        home = Path(folder) / "home"
        home.mkdir()
        engine = open_store(f"sqlite:///{home / 'ddpdash.db'}")
        t = time.perf_counter()
        run_id = seed_big_run(engine, ranks, steps, METRICS)
        print(f"  seeded {ranks} ranks × {steps:,} steps × {len(METRICS)} metrics in {time.perf_counter() - t:.0f} s")
        stop = threading.Event()
        trainer = threading.Thread(target=keep_training, args=(engine, run_id, ranks, steps, stop))
        trainer.start()
        server, url, first_url = start_ui(home)
        samples: list[tuple[float, float]] = []
        try:
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
                pages = []
                for _ in range(sessions):
                    context = browser.new_context(viewport={"width": 1400, "height": 1000})
                    page = context.new_page()
                    page.goto(first_url, wait_until="domcontentloaded")  # the token, then the Live page
                    page.goto(f"{url}/live?run={run_id}", wait_until="domcontentloaded")
                    pages.append(page)
                for page in pages:
                    page.wait_for_selector("[data-testid='stVegaLiteChart'] svg", timeout=120_000)
                started = time.monotonic()
                proc = psutil.Process(server.pid)
                while time.monotonic() - started < minutes * 60:
                    samples.append((time.monotonic() - started, rss_mib(proc)))
                    time.sleep(SAMPLE_EVERY_S)
                browser.close()
        finally:
            stop.set()
            trainer.join()
            server.terminate()
            server.wait(10)
            engine.dispose()
    window = max(SAMPLE_EVERY_S, min(60.0, (minutes * 60 - warmup_s) / 3))
    early = [m for at, m in samples if warmup_s <= at < warmup_s + window] or [samples[0][1]]
    late = [m for at, m in samples if at >= minutes * 60 - window] or [samples[-1][1]]
    growth = statistics.mean(late) / statistics.mean(early)
    print(f"  server RSS over {minutes:g} min, {sessions} sessions: " +
          ", ".join(f"{at:.0f} s {m:.0f} MiB" for at, m in samples[:: max(1, len(samples) // 12)]))
    print(f"  after warm-up {statistics.mean(early):.0f} MiB, at the end {statistics.mean(late):.0f} MiB, "
          f"peak {max(m for _, m in samples):.0f} MiB")
    return [Result(f"dashboard memory ({sessions} sessions on Live of {ranks} ranks, {minutes:g} min)",
                   f"{growth:.3f}× ({statistics.mean(early):.0f} → {statistics.mean(late):.0f} MiB)", "≤ 1.05×",
                   growth <= 1.05)]


# Arguments of measure() for each mode: ranks, steps, sessions, minutes, warm-up seconds.
SIZES = {"smoke": (4, 1_000, 1, 0.05, 0.0), "quick": (64, 20_000, 5, 5.0, 60.0),
         "full": (64, 200_000, 5, 10.0, 60.0)}


def main() -> None:
    os.environ.pop("DDPDASH_DB_URL", None)
    run_main(__doc__, SIZES, measure)


if __name__ == "__main__":
    main()
