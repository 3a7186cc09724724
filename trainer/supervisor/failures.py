"""Which rank failed, and why: read from the error files torchrun's `@record` leaves in the run folder,
telling the rank that failed first-hand from the ranks that merely lost their peer."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..rundir import RunDir, tail

# What a rank reports when another rank died under it (gloo, NCCL, the store).
CONSEQUENCE_MARKERS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                       "NCCL communicator was aborted", "Socket Timeout", "recvBytes", "Connection refused")


@dataclass(frozen=True)
class RankFailure:
    rank: int
    message: str
    traceback: str
    stderr_tail: str
    timestamp: float = 0.0

    @property
    def is_consequence(self) -> bool:
        """A peer's failure seen through the collective, not a cause of its own."""
        return any(marker in self.message for marker in CONSEQUENCE_MARKERS)


def root_causes(failures: list[RankFailure]) -> list[RankFailure]:
    """The ranks that failed first-hand; if all look like consequences, the earliest."""
    causes = [f for f in failures if not f.is_consequence]
    if causes:
        return causes
    return sorted(failures, key=lambda f: f.timestamp)[:1]


def read_failures(run_dir: RunDir, tail_lines: int = 40) -> list[RankFailure]:
    """Failing ranks of the last attempt (torchrun layout: attempt_<n>/<local_rank>/{error.json,stderr.log})."""
    attempts = run_dir.attempts()
    if not attempts:
        return []
    failures = []
    for rank_dir in sorted(attempts[-1].iterdir(), key=lambda p: int(p.name) if p.name.isdigit() else -1):
        error_file = rank_dir / "error.json"
        if not error_file.exists():
            continue
        message, trace, stamp = _parse_error_file(error_file)
        failures.append(RankFailure(int(rank_dir.name), message, trace, tail(rank_dir / "stderr.log", tail_lines),
                                    stamp))
    return failures


def _parse_error_file(path: Path) -> tuple[str, str, float]:
    try:
        data = json.loads(path.read_text())
        inner = data.get("message", {})
        if isinstance(inner, dict):
            extra = inner.get("extraInfo", {})
            return str(inner.get("message", "")), str(extra.get("py_callstack", "")), float(extra.get("timestamp", 0))
        return str(inner), "", 0.0
    except (OSError, ValueError):
        return "unreadable error file", "", 0.0
