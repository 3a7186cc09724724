"""A big run written through the real writer (one writer per rank, as the ranks do)."""

from __future__ import annotations

import time

from sqlalchemy import Engine
from sqlalchemy.orm import Session

from ddpdash.db.runs import create_run, update_run
from ddpdash.trainer.config import RunConfig
from ddpdash.trainer.metrics import direct_logger


def seed_big_run(engine: Engine, ranks: int, steps: int, metrics: tuple[str, ...] = ("loss",),
                 status: str = "running") -> int:
    cfg = RunConfig(name=f"big-{ranks}x{steps}", num_procs=ranks)
    start = time.time() - steps * 0.01
    with Session(engine) as s, s.begin():
        run_id = create_run(s, key=f"big-{time.time_ns()}", name=cfg.name, config_json=cfg.to_json(),
                            world_size=ranks, status=status)
        update_run(s, run_id, started_at=start, total_steps=steps * 2)
    for rank in range(ranks):
        w = direct_logger(engine, run_id, rank, send_interval_s=3600)
        for step in range(1, steps + 1):
            base = 2.0 / (1 + step / 1000) + 0.01 * rank
            w.log(step, {m: base if m == "loss" else 1000.0 + rank for m in metrics}, at=start + step * 0.01)
            if step % 25_000 == 0:
                w.flush()
        w.close(status="running")
    return run_id
