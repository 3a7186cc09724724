"""The supervisor's CPU priority: how far it steps back for the training processes it watches.

The one knob is DDPDASH_SUPERVISOR_NICE (0–19, default 10). The launcher checks it before anything is
written or started; the supervisor reads it from the environment it inherits and applies it once
torchrun is running.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Mapping

NICE_ENV = "DDPDASH_SUPERVISOR_NICE"
DEFAULT_SUPERVISOR_NICE = 10  # about a tenth of a rank's CPU share under full contention: plenty to write metrics


class PriorityError(ValueError):
    """DDPDASH_SUPERVISOR_NICE is not a number from 0 to 19."""


def supervisor_nice(env: Mapping[str, str] | None = None) -> int:
    raw = (os.environ if env is None else env).get(NICE_ENV, "").strip()
    if not raw:
        return DEFAULT_SUPERVISOR_NICE
    if not raw.isdigit() or int(raw) > 19:
        raise PriorityError(f"{NICE_ENV} must be a whole number from 0 to 19, got {raw!r}")
    return int(raw)


def yield_cpu_to_training(nice: int) -> None:
    """Lower the supervisor's CPU priority, so that writing the ranks' metrics waits for a free core
    rather than preempt a rank: with DDP, a rank held back holds every rank back at the next
    all-reduce. Call it once torchrun is started (which keeps the workers' priority) and before any
    thread starts (they inherit it).

    Two settings, because Linux weighs one or the other: with autogroups (the default on desktops and
    most servers, for processes outside a CPU cgroup), the scheduler first shares the CPUs between
    sessions, and torchrun gives each worker a session of its own, so the weight of the supervisor's
    session (itself and the torchrun agent) is what counts; otherwise each thread's nice value does.
    Best effort: where either is refused, it is left as it was."""
    for _ in range(3):  # the kernel takes one change of an autogroup per 0.1 s, machine-wide
        try:
            with open("/proc/self/autogroup", "w") as f:
                f.write(str(nice))
            break
        except BlockingIOError:
            time.sleep(0.11)
        except OSError:
            break
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, 0, min(19, os.getpriority(os.PRIO_PROCESS, 0) + nice))
