"""Seeded runs for dashboard, history and benchmark tests, written through the real writer."""

from __future__ import annotations

import math
import time

from sqlalchemy import Engine
from sqlalchemy.orm import Session

from ddpdash.db.runs import create_run, finish_run, update_run
from ddpdash.trainer.config import RunConfig
from ddpdash.trainer.metrics import direct_logger


def seed_run(engine: Engine, cfg: RunConfig, *, steps: int = 200, status: str = "succeeded",
             loss_scale: float = 1.0, speed_per_rank: float = 1000.0, metrics: tuple[str, ...] = ("loss",
             "samples_per_s", "step_time", "data_time"), tags: tuple[str, ...] = (), notes: str = "",
             start: float | None = None, step_seconds: float = 0.01) -> int:
    """A finished run whose ranks logged `steps` steps of a decaying loss."""
    start = start or time.time() - steps * step_seconds - 5
    with Session(engine) as s, s.begin():
        run_id = create_run(s, key=f"seed-{time.time_ns()}", name=cfg.name, config_json=cfg.to_json(),
                            world_size=cfg.world_size, status="running")
        update_run(s, run_id, started_at=start, total_steps=steps, tags=list(tags), notes=notes)
    for rank in range(cfg.world_size):
        w = direct_logger(engine, run_id, rank, send_interval_s=3600)
        for step in range(1, steps + 1):
            values = {
                "loss": loss_scale * (2.0 * math.exp(-step / (steps / 4)) + 0.1 + 0.01 * rank),
                "samples_per_s": speed_per_rank, "step_time": 0.01 * (1 + rank), "data_time": 0.001,
            }
            w.log(step, {k: v for k, v in values.items() if k in metrics}, at=start + step * step_seconds)
            if step % 50_000 == 0:
                w.flush()
        w.close(status="done" if status == "succeeded" else status)
    if status in ("succeeded", "failed", "stopped", "lost"):
        with Session(engine) as s, s.begin():
            finish_run(s, run_id, status, ended_at=start + steps * step_seconds)
    return run_id
