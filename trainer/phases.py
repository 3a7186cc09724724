"""Where a step's time goes: DDP's own sampled timings of the backward (its compute, its communication —
the gradient all-reduce, first bucket to last — and how much of that ran while backward still computed),
read where DDP keeps them (`DistributedDataParallel._get_ddp_logging_data()`, sampled every N iterations:
`_set_ddp_runtime_logging_sample_rate`), beside the trainer's own perf_counter timers of data, forward,
backward and optimizer (trainer/train.py) or the phases a user's script times (`ddpdash.phase`).

Runs in the ranks; torch is imported by the caller, not here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ddpdash.db.vocab import Metric

NS = 1e-9
# Steps between DDP's samples, at least: a sample costs DDP its timers' bookkeeping (on a GPU, events it
# reads back at the next forward: a sync), and reading it costs a dict of some sixty entries from C++. One
# per log window, and at most one every this many steps, keeps both off nearly every step.
MIN_SAMPLE_EVERY = 10


def sample_steps(log_every: int) -> int:
    return max(log_every, MIN_SAMPLE_EVERY)


def sample_every(log_every: int, grad_accum_steps: int) -> int:
    """DDP iterations (forward calls) between samples."""
    return max(1, sample_steps(log_every) * grad_accum_steps)


def start_sampling(ddp: Any, every: int) -> None:
    setter = getattr(ddp, "_set_ddp_runtime_logging_sample_rate", None)
    if setter is not None:
        setter(every)


@dataclass
class CommSampler:
    """Reads a DDP model's newest sample, every `every_steps` steps at most; each sample is reported once
    (None until a new one is there)."""

    ddp: Any
    every_steps: int = 1
    last_iteration: int = -1
    last_read_step: int = -(10**9)

    def read(self, step: int) -> dict[str, float] | None:
        getter = getattr(self.ddp, "_get_ddp_logging_data", None)
        if getter is None or step - self.last_read_step < self.every_steps:
            return None
        self.last_read_step = step
        data = getter()
        iteration = int(data.get("iteration", 0) or 0)
        if "backward_comm_time" not in data or iteration == self.last_iteration:
            return None
        self.last_iteration = iteration
        return {
            Metric.COMM_TIME: float(data["backward_comm_time"]) * NS,
            Metric.COMM_OVERLAP_TIME: float(data.get("backward_compute_comm_overlap_time", 0)) * NS,
            "backward_compute": float(data.get("backward_compute_time", 0)) * NS,
            "forward_compute": float(data.get("forward_compute_time", 0)) * NS,
        }


def comm_metrics(sample: dict[str, float] | None, step_s: float) -> dict[str, float]:
    """The stored metrics of one sample: communication, its overlap, and its share of a `step_s` step."""
    if sample is None:
        return {}
    out = {Metric.COMM_TIME: sample[Metric.COMM_TIME], Metric.COMM_OVERLAP_TIME: sample[Metric.COMM_OVERLAP_TIME]}
    if step_s > 0:
        out[Metric.COMM_SHARE] = min(sample[Metric.COMM_TIME] / step_s, 1.0)
    return out


def phase_metric(name: str) -> str:
    """A script's phase name → its metric: data → data_time, forward → forward_time, any other → NAME_time."""
    return f"{name}_time"
