"""Test-only fault switches, off by default: set DDPDASH_TEST_FAULT to a comma-separated list of

    raise:RANK:STEP        rank RANK raises RuntimeError at optimizer step STEP (every attempt)
    raise-once:RANK:STEP   the same, only in the first attempt (a restart then succeeds)
    perturb:RANK:STEP      rank RANK nudges one weight at STEP, so the replica-sync check must fire
    sleep:RANK:SECONDS     rank RANK sleeps SECONDS after each step (a straggler)
    stall:RANK:STEP        rank RANK stops at STEP for an hour (a hang: the others wait in the next all-reduce)
    nan:RANK:STEP          rank RANK sets a weight to NaN after STEP (its next loss is NaN; the all-reduce spreads it)
    abort-exit:RANK:0      rank RANK dies with SIGABRT after finishing training (the teardown crash in NOTES)

and DDPDASH_TEST_SAMPLE_LOG to a folder where each rank writes the sample indices it trained on, and
DDPDASH_TEST_MOUNTS to a file a Slurm node's supervisor reads instead of /proc/mounts (a network file
system the tests cannot mount: trainer/supervisor/node.store_refusal).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

MOUNTS_ENV = "DDPDASH_TEST_MOUNTS"


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    at: float


def parse_faults(text: str | None = None) -> list[Fault]:
    text = os.environ.get("DDPDASH_TEST_FAULT", "") if text is None else text
    faults = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        kind, rank, at = part.split(":")
        if kind not in ("raise", "raise-once", "perturb", "sleep", "stall", "nan", "abort-exit"):
            raise ValueError(f"DDPDASH_TEST_FAULT: unknown fault {kind!r}")
        faults.append(Fault(kind, int(rank), float(at)))
    return faults


class InjectedFault(RuntimeError):
    """Raised on purpose by DDPDASH_TEST_FAULT."""
