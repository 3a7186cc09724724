"""Where every rank of a run is, now: each live rank's stack — Python frames and, where py-spy can read them,
native ones (a rank blocked in a gloo or NCCL collective shows c10d's frames) — and a verdict in plain words:

    "ranks 0, 2, 3 wait in all_reduce (DDP backward, train.py:214); rank 1 is in time.sleep (train.py:98)"

py-spy reads a rank from outside (ptrace); where it cannot attach (ptrace denied, a container without the
capability), the trainer's ranks dump their own threads through `faulthandler` on SIGUSR2 into the run
folder. Each capture says which method it used and why. Alongside, every rank dumps its Flight Recorder
buffer (asked through the run folder: trainer/requests.py) and torch's analyser names the collective a
rank never joined (trainer/flight_recorder.py). Captures run in the dashboard's, the CLI's or the
supervisor's process (py-spy and the analyser are started by trainer.control) and are stored as a
`stacks` event: the verdict, and the stacks and the finding as JSON in its detail.
"""

from __future__ import annotations

import itertools
import json
import re
import sysconfig
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .requests import FLIGHT_RECORDER, ask, withdraw

STACK_SIGNAL = "SIGUSR2"  # the trainer's ranks dump their threads on it (faulthandler), for the fallback
FALLBACK_WAIT_S = 2.0
FLIGHT_RECORDER_WAIT_S = 3.0  # the ranks answer on their metrics thread, once a second
STDLIB = sysconfig.get_paths()["stdlib"]

# Native frame names → the collective they are, for the verdict (first match wins).
COLLECTIVES = (("allreduce", "all_reduce"), ("all_reduce", "all_reduce"), ("allgather", "all_gather"),
               ("all_gather", "all_gather"), ("reduce_scatter", "reduce_scatter"), ("broadcast", "broadcast"),
               ("barrier", "barrier"), ("sync_bucket_indices", "DDP's bucket rebuild (a broadcast)"),
               ("Reducer::finalize_backward", "all_reduce"),  # DDP's backward waits for its buckets' all-reduce
               ("Work::wait", "a collective"), ("ProcessGroup", "a collective"), ("c10d::", "a collective"))


@dataclass(frozen=True)
class Frame:
    name: str
    file: str
    line: int
    native: bool = False

    @property
    def where(self) -> str:
        return f"{Path(self.file).name}:{self.line}" if self.line else Path(self.file).name


@dataclass(frozen=True)
class RankStack:
    rank: int
    pid: int
    method: str  # "py-spy" or "faulthandler"
    frames: tuple[Frame, ...] = ()  # the main thread's, innermost first
    error: str = ""  # why no stack was read
    note: str = ""  # why this method (the fallback says why py-spy could not attach)

    @property
    def own_frame(self) -> Frame | None:
        """The innermost frame of the user's or the trainer's own code (not torch's, not Python's)."""
        return next((f for f in self.frames if is_own_code(f)), None)

    def state(self) -> str:
        """What the rank is doing, as the verdict says it: "wait in all_reduce (DDP backward, train.py:214)"."""
        if self.error:
            return f"could not be read ({self.error})"
        own = self.own_frame
        at = own.where if own else (self.frames[0].where if self.frames else "?")
        native = [f.name for f in self.frames if f.native]
        collective = next((label for key, label in COLLECTIVES if any(key in name for name in native)), None)
        python = [f for f in self.frames if not f.native]
        if collective is not None or any(_in_torch_distributed(f) for f in python):
            return f"wait in {collective or 'a collective'} ({_context(python)}, {at})"
        until_python = [f.name for f in itertools.takewhile(lambda f: f.native, self.frames)]
        if "time_sleep" in until_python:
            return f"is in time.sleep ({at})"
        inner = python[0] if python else None
        return f"is in {inner.name if inner else (until_python or ['?'])[-1]} ({at})"


@dataclass
class Capture:
    at: float
    verdict: str
    stacks: list[RankStack] = field(default_factory=list)
    finding: str = ""  # the Flight Recorder analyser's, in a line ("rank 1 never joined collective #13 all_reduce")

    def detail(self) -> str:
        return json.dumps({"stacks": [asdict(s) for s in self.stacks], "flight_recorder": self.finding})

    @classmethod
    def from_event(cls, at: float, message: str, detail: str) -> Capture:
        data = json.loads(detail or "[]")
        if isinstance(data, list):  # stored before the Flight Recorder was read
            data = {"stacks": data}
        stacks = []
        for item in data.get("stacks", []):
            frames = tuple(Frame(**f) for f in item.pop("frames", []))
            stacks.append(RankStack(frames=frames, **item))
        return cls(at, message, stacks, str(data.get("flight_recorder", "")))


def is_own_code(frame: Frame) -> bool:
    if frame.native or frame.file.startswith("<"):
        return False
    if "/ddpdash/" in frame.file or "/trainer/" in frame.file:
        return True
    return not (frame.file.startswith(STDLIB) or "site-packages" in frame.file or "/torch/" in frame.file)


def _in_torch_distributed(frame: Frame) -> bool:
    return "torch/distributed" in frame.file and "elastic" not in frame.file


def _context(python: list[Frame]) -> str:
    names = {f.name.rsplit(".", 1)[-1] for f in python}
    if "backward" in names or "_engine_run_backward" in names:
        return "DDP backward"
    if "_pre_forward" in names or "_run_ddp_forward" in names:
        return "DDP forward"
    collective = next((f.name for f in python if _in_torch_distributed(f)), None)
    return collective or "a collective"


def verdict(stacks: list[RankStack]) -> str:
    """Ranks grouped by what they do: "ranks 0, 2 wait in …; rank 1 is in time.sleep (train.py:98)"."""
    groups: dict[str, list[int]] = {}
    for s in sorted(stacks, key=lambda s: s.rank):
        groups.setdefault(s.state(), []).append(s.rank)
    parts = []
    for state, ranks in groups.items():
        many = len(ranks) > 1
        who = f"rank{'s' if many else ''} {', '.join(map(str, ranks))}"
        verb = state if many or not state.startswith("wait ") else "waits " + state.removeprefix("wait ")
        parts.append(f"{who} {verb}")
    return "; ".join(parts) or "no rank could be read"


# ---- reading a rank ------------------------------------------------------------------------------------
def parse_py_spy(text: str, pid: int) -> tuple[Frame, ...]:
    """py-spy's `dump --json [--native]`: the main thread's frames (its os thread id is the pid)."""
    threads = json.loads(text)
    main = next((t for t in threads if t.get("os_thread_id") == pid), threads[0] if threads else None)
    if main is None:
        return ()
    return tuple(Frame(_short(str(f.get("name", "?"))), str(f.get("filename", "")), int(f.get("line") or 0),
                       native=_is_native(str(f.get("filename", "")))) for f in main.get("frames", []))


def _short(name: str, most: int = 120) -> str:
    """pybind11's template names run to a thousand characters: the start says enough."""
    return name if len(name) <= most else name[:most] + "…"


def _is_native(filename: str) -> bool:
    """py-spy names a native frame's file by its library (libtorch_cpu.so), a Python one by its .py."""
    return not filename.endswith(".py") and not filename.startswith("<")


FAULTHANDLER_LINE = re.compile(r'^\s+File "(?P<file>.+)", line (?P<line>\d+) in (?P<name>.+)$')


def parse_faulthandler(text: str) -> tuple[Frame, ...]:
    """faulthandler's dump of all threads: the thread marked "Current thread" or the main one, else the first."""
    blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", text.strip())
    main = next((b for b in blocks if b.startswith("Current thread")), None) or (blocks[-1] if blocks else "")
    return tuple(Frame(m["name"], m["file"], int(m["line"])) for line in main.splitlines()
                 if (m := FAULTHANDLER_LINE.match(line)))


def read_rank(rank: int, pid: int, stack_file: Path | None) -> RankStack:
    from .control import py_spy_dump, signal_rank

    ok, output = py_spy_dump(pid)
    if ok:
        try:
            return RankStack(rank, pid, "py-spy", parse_py_spy(output, pid), note="attached, native frames included")
        except ValueError:
            output = f"py-spy printed no JSON: {output[:200]}"
    why = output.strip().splitlines()[-1] if output.strip() else "py-spy failed"
    if stack_file is None:
        return RankStack(rank, pid, "py-spy", error=why)
    if not stack_file.exists():
        return RankStack(rank, pid, "py-spy", error=f"{why}; and this rank dumps no stacks on request")
    stack_file.write_text("")  # the rank appends its dump: an empty file then holds this one alone
    if not signal_rank(pid, STACK_SIGNAL):
        return RankStack(rank, pid, "faulthandler", error=f"{why}; the process is gone")
    deadline = time.monotonic() + FALLBACK_WAIT_S
    while time.monotonic() < deadline:
        if stack_file.stat().st_size:
            time.sleep(0.05)  # the dump is written in one go; let it finish
            return RankStack(rank, pid, "faulthandler", parse_faulthandler(stack_file.read_text(errors="replace")),
                             note=f"py-spy could not attach ({why}): the rank dumped its own threads")
        time.sleep(0.05)
    return RankStack(rank, pid, "faulthandler", error=f"{why}; the rank did not answer {STACK_SIGNAL}")


def capture(places: list[tuple[int, int]], stack_file: Any = None) -> Capture:
    """Every (rank, pid) read at once (a thread each: 8 ranks take as long as one); `stack_file(rank)` is
    where a trainer rank's faulthandler writes, for the fallback."""
    with ThreadPoolExecutor(max_workers=max(len(places), 1)) as pool:
        stacks = list(pool.map(lambda p: read_rank(p[0], p[1], stack_file(p[0]) if stack_file else None), places))
    return Capture(time.time(), verdict(stacks), stacks)


# ---- a run's ranks ----------------------------------------------------------------------------------------
def capture_run(engine: Any, run_id: int, flight_recorder: bool = True) -> Capture:
    """Read every live rank of a run on this host (and, with `flight_recorder`, have each dump its Flight
    Recorder buffer and analyse the dumps); store the capture as a `stacks` event."""
    import socket

    from sqlalchemy.orm import Session

    from ddpdash.db.queries import rank_states
    from ddpdash.db.runs import add_event, get_run
    from ddpdash.db.vocab import EventKind

    from .control import alive
    from .rundir import RunDir

    with Session(engine) as s:
        run = get_run(s, run_id)
        states = rank_states(s, run_id)
    here = socket.gethostname()
    places = [(int(r.rank), int(r.pid)) for r in states.itertuples(index=False)
              if r.pid and r.host in ("", here) and alive(int(r.pid))]
    run_dir = RunDir(Path(run.run_dir)) if run.run_dir else None
    finding: Future[str] | None = None
    with ThreadPoolExecutor(max_workers=1) as pool:
        if flight_recorder and run_dir is not None and places:  # beside py-spy: the ranks answer meanwhile
            request = ask(run_dir, FLIGHT_RECORDER)
            finding = pool.submit(read_flight_recorder, run_dir, request, {rank for rank, _ in places})
        result = capture(places, run_dir.stack_file if run_dir else None)
        if finding is not None:
            result.finding = finding.result()
    if not places:
        result.verdict = "no live rank of this run on this host to read"
    with Session(engine) as s, s.begin():
        add_event(s, run_id, EventKind.STACKS, result.verdict, detail=result.detail())
    return result


def read_flight_recorder(run_dir: Any, request: str, ranks: set[int]) -> str:
    """The analyser's finding over the ranks' answers to `request`, once every rank in `ranks` has dumped
    (or FLIGHT_RECORDER_WAIT_S has passed)."""
    from .control import analyse_flight_recorder
    from .flight_recorder import dumped_ranks, with_missing

    folder = run_dir.flight_recorder(request)
    try:
        result = analyse_flight_recorder(folder, ranks, FLIGHT_RECORDER_WAIT_S)
    finally:
        withdraw(run_dir, request)
    if not dumped_ranks(folder):
        return ("no rank dumped its Flight Recorder buffer (a script's ranks answer only while they log "
                "through ddpdash; a run without a process group has none)")
    return with_missing(result["finding"], ranks, folder)


def latest_capture(events: Any) -> Capture | None:
    """The newest `stacks` event of a run's events frame (db.queries.events), as a Capture."""
    from ddpdash.db.vocab import EventKind

    found = events[events["kind"] == EventKind.STACKS]
    if found.empty:
        return None
    last = found.iloc[-1]
    return Capture.from_event(float(last["time"]), str(last["message"]), str(last["detail"]))
