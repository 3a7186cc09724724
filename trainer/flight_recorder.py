"""PyTorch's Flight Recorder for ddpdash runs: every rank keeps a ring buffer of its last collectives
(TORCH_FR_BUFFER_SIZE; with gloo as with NCCL in torch ≥ 2.10), dumped on request (a hang: trainer.stacks),
when a rank raises (trainer.train, ddpdash.api), and by NCCL's watchdog on a timeout; the dumps are read
by torch's own analyser (`torch.distributed.flight_recorder`), which names the collective a rank never
joined:

    "rank 1 never joined collective #812 all_reduce (rank 0 waits in it)"

The analyser unpickles the dumps, so it runs in a child process of its own (`python -m
ddpdash.trainer.flight_recorder FOLDER`, started by trainer.control), never in the dashboard's.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pickle
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BUFFER_ENTRIES = "2000"  # collectives each rank remembers; a few hundred bytes each, recorded as they are issued
ANALYSER_MODULE = "ddpdash.trainer.flight_recorder"
FAILURE_DUMP = "failure"  # RunDir.flight_recorder's folder for the dumps of ranks that raised
TIMEOUT_DUMP = "timeout"  # and for NCCL's watchdog's, on a collective's timeout
DUMP_PREFIX = "rank_"  # torch's analyser takes the rank from the file name after this


def rank_env(run_dir_path: Path) -> dict[str, str]:
    """The settings that turn the buffer on in every rank (the user's own, where set, win)."""
    timeout_folder = run_dir_path / "flight_recorder" / TIMEOUT_DUMP
    return {"TORCH_FR_BUFFER_SIZE": BUFFER_ENTRIES, "TORCH_NCCL_TRACE_BUFFER_SIZE": BUFFER_ENTRIES,
            "TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "TORCH_FR_DUMP_TEMP_FILE": str(timeout_folder / DUMP_PREFIX)}


# ---- in a rank ------------------------------------------------------------------------------------------
def dump(folder: Path, rank: int) -> bool:
    """Write this rank's buffer to FOLDER/rank_<rank>; False where there is nothing to dump (no process
    group, a torch without the recorder). Called from a rank's own threads, never a signal handler."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return False
    try:
        c10d = sys.modules["torch"]._C._distributed_c10d
        nccl = "nccl" in str(dist.get_backend()) and hasattr(c10d, "_dump_nccl_trace")
        data = c10d._dump_nccl_trace(True, True, False) if nccl else c10d._dump_fr_trace(True, True, False)
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{DUMP_PREFIX}{rank}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, folder / f"{DUMP_PREFIX}{rank}")
        return True
    except Exception as exc:  # a diagnosis must never take the rank down
        logging.getLogger(__name__).warning("no Flight Recorder dump: %s", exc)
        return False


def with_missing(finding: str, expected: set[int], folder: Path, why: str = "") -> str:
    """The analyser's finding, and the ranks of `expected` that left no dump in `folder` (and why, if known)."""
    missing = sorted(expected - set(dumped_ranks(folder)))
    return finding + (f" (no dump from rank(s) {missing}{': ' + why if why else ''})" if missing else "")


def dumped_ranks(folder: Path) -> list[int]:
    return sorted(int(p.name.removeprefix(DUMP_PREFIX)) for p in folder.glob(f"{DUMP_PREFIX}*")
                  if p.name.removeprefix(DUMP_PREFIX).isdigit())


# ---- the analyser (a child process) ---------------------------------------------------------------------
MISSING = re.compile(r"Not all ranks joining collective, sequence number: (?P<seq>\d+)")


def analyse(folder: Path) -> dict[str, str]:
    """torch's analyser over one dump folder: {"finding": one line, "report": what it printed}."""
    dumps = {rank: _load(folder / f"{DUMP_PREFIX}{rank}") for rank in dumped_ranks(folder)}
    if not dumps:
        return {"finding": "no rank wrote a Flight Recorder dump", "report": ""}
    report = _torch_report(dumps)
    finding = finding_from_report(report) or finding_from_status(dumps)
    return {"finding": finding, "report": report}


def _load(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        return pickle.load(f)  # this child process is where the ranks' dumps are unpickled, alone


def normalised(dump: dict[str, Any]) -> dict[str, Any]:
    """gloo's dumps name the default group "" in pg_config and "0" in its entries; the analyser needs one."""
    names = {tuple(e["process_group"]) for e in dump.get("entries", [])}
    config = dict(dump.get("pg_config", {}))
    if "" in config and len(names) == 1:
        (name, desc), = names
        config[name] = {**config.pop(""), "name": name, "desc": desc}
    return {**dump, "pg_config": config}


def _torch_report(dumps: dict[int, dict[str, Any]]) -> str:
    """What torch.distributed.flight_recorder prints for these dumps (its logger's lines)."""
    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    try:
        from torch.distributed.flight_recorder.components.builder import build_db
        from torch.distributed.flight_recorder.components.config_manager import JobConfig
        from torch.distributed.flight_recorder.components.loader import read_dir
    except ImportError as exc:
        return f"(torch's Flight Recorder analyser is not in this torch: {exc})"
    fr_log = logging.getLogger("Flight Recorder")
    fr_log.addHandler(Collect())
    with tempfile.TemporaryDirectory() as tmp:
        for rank, data in dumps.items():
            with open(Path(tmp) / f"{DUMP_PREFIX}{rank}", "wb") as f:
                pickle.dump(normalised(data), f)
        try:
            args = JobConfig().parse_args([tmp, "--prefix", DUMP_PREFIX, "--allow-incomplete-ranks"])
            details, version = read_dir(args)
            build_db(details, args, version)
        except Exception as exc:
            lines.append(f"(the analyser stopped: {type(exc).__name__}: {exc})")
    return "\n".join(lines)


def finding_from_report(report: str) -> str | None:
    """The analyser's first "not all ranks joining" block, as one line."""
    match = MISSING.search(report)
    if match is None:
        return None
    block = report[match.start():]
    collective = re.search(r"collective: (?:\w+:)?(?P<name>\S+)", block)
    missing = re.search(r"missing ranks: \{(?P<ranks>[\d, ]*)\}", block)
    expected = re.search(r"expected ranks: \{(?P<ranks>[\d, ]*)\}", block)
    absent = _ranks(missing["ranks"]) if missing else []
    waiting = [r for r in (_ranks(expected["ranks"]) if expected else []) if r not in absent]
    return _missing_line(absent, int(match["seq"]), collective["name"] if collective else "?", waiting)


def finding_from_status(dumps: dict[int, dict[str, Any]]) -> str:
    """Without the analyser's word: each rank's last collective issued (pg_status), compared."""
    last: dict[int, tuple[int, str]] = {}
    for rank, data in dumps.items():
        entries = data.get("entries") or []
        seq = max((int(e.get("collective_seq_id", 0)) for e in entries), default=0)
        name = next((str(e.get("profiling_name", "?")) for e in reversed(entries)
                     if int(e.get("collective_seq_id", 0)) == seq), "?")
        last[rank] = (seq, name.split(":")[-1])
    newest = max(seq for seq, _ in last.values())
    behind = sorted(r for r, (seq, _) in last.items() if seq < newest)
    if not behind:
        return f"every rank issued collective #{newest}: none is missing a rank"
    name = next(n for seq, n in last.values() if seq == newest)
    return _missing_line(behind, newest, name, sorted(set(last) - set(behind)))


def _missing_line(absent: list[int], seq: int, name: str, waiting: list[int]) -> str:
    there = f" ({_who(waiting)} wait{'' if len(waiting) > 1 else 's'} in it)" if waiting else ""
    return f"{_who(absent)} never joined collective #{seq} {name}{there}"


def _who(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def _ranks(text: str) -> list[int]:
    return sorted(int(x) for x in text.replace(" ", "").split(",") if x)


def wait_for_dumps(folder: Path, ranks: set[int], wait_s: float) -> None:
    deadline = time.monotonic() + wait_s
    while not ranks <= set(dumped_ranks(folder)) and time.monotonic() < deadline:
        time.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m {ANALYSER_MODULE}", description="Analyse a Flight Recorder dump.")
    p.add_argument("folder", type=Path)
    p.add_argument("--expect", default="", help="ranks whose dumps to wait for, comma-separated")
    p.add_argument("--wait", type=float, default=0.0, help="seconds to wait for them at most")
    args = p.parse_args(argv)
    import torch.distributed.flight_recorder.components.builder  # noqa: F401 (torch loads while the ranks dump)

    wait_for_dumps(args.folder, {int(r) for r in args.expect.split(",") if r}, args.wait)
    print(json.dumps(analyse(args.folder)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
