"""Which rank failed, and why: read from the error files torchrun's `@record` leaves in the run folder,
telling the rank that failed first-hand from the ranks that merely lost their peer."""

from __future__ import annotations

import json
import re
import signal
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
        rank = run_dir.first_rank + int(rank_dir.name)  # torchrun names the folders by local rank
        failures.append(RankFailure(rank, message, trace, tail(rank_dir / "stderr.log", tail_lines), stamp))
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


# An entry of torchrun's failure summary (torch.distributed.elastic's ChildFailedError).
_SUMMARY_ENTRY = re.compile(r"rank\s*:\s*(\d+) \(local_rank: (\d+)\)\s*\n\s*exitcode\s*:\s*(-?\d+) \(pid: (\d+)\)")
AGENT_SHUTDOWN = -signal.SIGTERM  # how torchrun ends the survivors of a failure: not a cause


def _summary(run_dir: RunDir) -> list[tuple[int, int, int, str]]:
    """(rank, local rank, exit code, pid) of each entry of torchrun's failure summary."""
    return [(int(rank), int(local), int(code), pid)
            for rank, local, code, pid in _SUMMARY_ENTRY.findall(tail(run_dir.torchrun_log, 400))]


def signalled_ranks(run_dir: RunDir, tail_lines: int = 40) -> list[RankFailure]:
    """Ranks a signal killed (SIGKILL from the OOM killer or a user, SIGSEGV, ...), from torchrun's own
    failure summary: such a rank leaves no error file, and its peers' errors only say they lost it."""
    found: dict[int, RankFailure] = {}
    for rank, local_rank, exit_code, pid in _summary(run_dir):
        if exit_code >= 0 or exit_code == AGENT_SHUTDOWN:
            continue
        try:
            name = signal.Signals(-exit_code).name
        except ValueError:
            name = f"signal {-exit_code}"
        log = run_dir.rank_log(local_rank)
        found[rank] = RankFailure(rank, f"killed by {name} (exit code {exit_code}, pid {pid})", "",
                                  tail(log, tail_lines) if log else "")
    return list(found.values())


def exited_ranks(run_dir: RunDir, tail_lines: int = 40) -> list[RankFailure]:
    """Ranks that exited with an error and left no error file (a script without `@record` that does not
    use ddpdash's API): torchrun's summary names them; the traceback is their stderr's tail."""
    found: dict[int, RankFailure] = {}
    for rank, local_rank, code, _pid in _summary(run_dir):
        if code > 0:
            log = run_dir.rank_log(local_rank)
            stderr = tail(log, tail_lines) if log else ""
            last = next((line for line in reversed(stderr.splitlines()) if line.strip()), "")
            found[rank] = RankFailure(rank, last or f"exited with code {code}", stderr, stderr)
    return list(found.values())


def blame(run_dir: RunDir, frozen: dict[int, float]) -> tuple[list[RankFailure], list[RankFailure]]:
    """The ranks that caused a failure, and those that failed because of them. In order of evidence: a
    rank the supervisor found stopped (the others timed out waiting for it; `frozen`: rank -> seconds it
    was stopped), a rank killed by a signal, then the error files' first-hand failures."""
    reported = read_failures(run_dir)
    if frozen:
        causes = [RankFailure(rank, f"stopped (state T, e.g. SIGSTOP) for {seconds:.0f} s: the other ranks waited "
                              "for it in a collective until the process-group timeout; the supervisor killed it",
                              "", "") for rank, seconds in sorted(frozen.items())]
    else:
        causes = signalled_ranks(run_dir) or root_causes(reported)
    blamed = {f.rank for f in causes}
    return causes, [f for f in reported if f.rank not in blamed]


def flight_recorder_finding(run_dir: RunDir, world_size: int) -> str | None:
    """What the Flight Recorder dumps of the ranks that raised say (trainer/flight_recorder.py), when at least
    two ranks left one: the collective a rank never joined, or the ranks that left none. None otherwise."""
    from ..control import analyse_flight_recorder
    from ..flight_recorder import FAILURE_DUMP, dumped_ranks, with_missing

    folder = run_dir.flight_recorder(FAILURE_DUMP)
    if len(dumped_ranks(folder)) < 2:
        return None  # one rank's buffer alone has nothing to compare
    return with_missing(analyse_flight_recorder(folder)["finding"], set(range(world_size)), folder,
                        "they did not raise, or were killed first")
