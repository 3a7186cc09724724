"""ddpdash for a user's own torchrun script: three lines, in every rank.

    import ddpdash
    for step, batch in enumerate(loader):
        ...
        ddpdash.log({"loss": loss.item()}, step=step, samples=len(batch))   # samples -> samples/s
        if ddpdash.should_stop():       # the Stop button asked: finish the step and leave
            break

Where a step's time goes, and DDP's communication share:

    with ddpdash.phase("data"):     # data, forward, backward, optimizer (or any name: NAME_time)
        batch = next(it)
    ddpdash.watch(ddp_model)        # DDP's own sampled backward compute/communication/overlap timings

each added to the next log() as seconds per step. A profile asked from the dashboard (`ddpdash profile`)
covers the next N log() calls; a Flight Recorder dump asked on a hang is written by the logger's thread.

Everything is read when first needed, not at import: torchrun's environment (rank, world size), the run
ddpdash launched (its id and settings) or, outside one, one run registered per rendezvous in the store.
Logging never calls a collective and never waits on I/O: `log()` appends to a buffer that a thread hands
on once a second (trainer.metrics). Different ranks may log different keys. DDPDASH_DISABLED=1 makes
every call a no-op. Runs in the user's ranks.
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from ddpdash.db.vocab import EventKind, RankStatus

_log = logging.getLogger(__name__)

DISABLED_ENV = "DDPDASH_DISABLED"
RUN_ID_ENV = "DDPDASH_RUN_ID"  # set by the launcher for a script it starts
SETTINGS_ENV = "DDPDASH_SETTINGS"  # the form's settings for that script, as JSON (RunSettings' fields)
SAMPLES_PER_S = "samples_per_s"
RUN_DIR_ENV = "DDPDASH_RUN_DIR"  # set by the launcher: the run's folder, where the dashboard's requests wait


@dataclass(frozen=True)
class RunSettings:
    """What the form (or `ddpdash launch`) chose for this run, and where this process stands in it. A
    script honours what it wants of it; the same values are in DDPDASH_* environment variables."""

    run_id: int | None = None
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    # What the form chose; None in a run started by hand, where nothing was chosen.
    backend: str | None = None
    batch_size: int | None = None
    amp: str | None = None
    lr: float | None = None
    effective_lr: float | None = None
    max_steps: int | None = None
    num_epochs: int | None = None
    seed: int | None = None
    params: dict[str, Any] = field(default_factory=dict)
    launched: bool = False  # by ddpdash's launcher (else: by hand, registered on first use)
    enabled: bool = True


class _Run:
    """This process's part of its run: made on first use, closed at exit."""

    def __init__(self, logger: Any = None) -> None:
        """`logger`: this rank's, given (a benchmark times log() without a store); else opened from the run."""
        self.settings = _settings_from_env(os.environ)
        self.logger: Any = None  # trainer.metrics.RankLogger, None when disabled
        self.engine: Any = None  # when this rank writes the store itself
        self.next_step = 0
        self.last_samples_at = time.perf_counter()
        self.last_log_at = time.perf_counter()
        self.stop_requested = False
        self.warned: set[str] = set()
        self.failed = False
        self.closed = False
        self.nonfinite_reported = False
        self.phases: dict[str, float] = {}  # seconds per phase since the last log()
        self.comm: Any = None  # trainer.phases.CommSampler of the watched DDP model
        self._timed = False  # phase() or watch() was used: log() adds their figures
        self.profile: Any = None  # trainer.profiling.ProfileHook, for a launched run
        self._profiling = False  # a profile asked for or under way: log() ticks it
        # log()'s fast path, one flag: logging, nothing timed, nothing profiled (kept by the two setters).
        self.plain = False
        self.append_row: Any = None  # the logger's append_row((step, time, values))
        self.run_dir: Any = None
        if logger is not None:
            self.logger, self.append_row, self.plain = logger, logger.append_row, True
        elif self.settings.enabled:
            self.logger, run_id, self.engine = _open_logger(self.settings)
            self.settings = RunSettings(**{**self.settings.__dict__, "run_id": run_id})
            self.logger.check_values = self.clean  # non-numbers and non-finite values: on the logger's thread
            self.append_row, self.plain = self.logger.append_row, True
            self._install_handlers()
            self._answer_requests()

    @property
    def timed(self) -> bool:
        return self._timed

    @timed.setter
    def timed(self, value: bool) -> None:
        self._timed = value
        self.plain = self.logger is not None and not value and not self._profiling

    @property
    def profiling(self) -> bool:
        return self._profiling

    @profiling.setter
    def profiling(self, value: bool) -> None:
        self._profiling = value  # set by the logger's thread when a profile is asked: log() sees it next call
        self.plain = self.logger is not None and not value and not self._timed

    def _answer_requests(self) -> None:
        """A launched run's ranks answer what the dashboard asks through the run folder (trainer/requests.py)."""
        folder = os.environ.get(RUN_DIR_ENV)
        if not folder:
            return
        from ddpdash.trainer import flight_recorder
        from ddpdash.trainer.profiling import ProfileHook
        from ddpdash.trainer.requests import RankRequests
        from ddpdash.trainer.rundir import RunDir

        self.run_dir = RunDir(Path(folder))
        requests = RankRequests(self.run_dir, self.settings.rank, flight_recorder.dump)

        def poll() -> None:
            requests.poll()
            if requests.profile is not None:
                self.profiling = True

        self.logger.on_tick = poll
        self.profile = ProfileHook(requests, self.settings.rank, "cuda" if _uses_cuda() else "cpu", self.logger.event)

    def _install_handlers(self) -> None:
        if threading.current_thread() is threading.main_thread():
            previous = signal.getsignal(signal.SIGTERM)

            def on_term(signum: int, frame: Any) -> None:
                self.stop_requested = True  # should_stop() says so; the script finishes its step and leaves
                if callable(previous) and previous not in (signal.SIG_DFL, signal.SIG_IGN):
                    previous(signum, frame)

            signal.signal(signal.SIGTERM, on_term)
        hook = sys.excepthook

        def on_uncaught(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
            if self.stop_requested:  # a peer left first during the shutdown (its collective broke): the stop
                self.close()
                hook(kind, exc, tb)
                return
            self.failed = True
            rank = self.settings.rank
            if self.run_dir is not None:
                from ddpdash.trainer import flight_recorder

                flight_recorder.dump(self.run_dir.flight_recorder(flight_recorder.FAILURE_DUMP), rank)
            self.logger.event(EventKind.RANK_FAILED, f"rank {rank}: {kind.__name__}: {exc}",
                              "".join(traceback.format_exception(kind, exc, tb)))
            self.close()
            hook(kind, exc, tb)

        sys.excepthook = on_uncaught
        atexit.register(self.close)

    def clean(self, values: Mapping[str, Any], step: int) -> dict[str, float]:
        """Finite numbers only: a non-finite or non-numeric value is dropped with a warning (once per
        metric), the rest of the step kept; the first non-finite number is an event on the run."""
        out = {}
        for key, value in values.items():
            try:
                number = float(value)
            except (TypeError, ValueError, RuntimeError):
                number, numeric = math.nan, False
            else:
                numeric = True
            if math.isfinite(number):
                out[key] = number
                continue
            why = f"is {number}" if numeric else f"is not a number ({type(value).__name__})"
            if key not in self.warned:
                self.warned.add(key)
                _log.warning("ddpdash.log: %r %s: dropped (the step's other values are kept)", key, why)
            if numeric and not self.nonfinite_reported:  # a non-number is the script's mistake, not a blow-up
                self.nonfinite_reported = True
                self.logger.event(EventKind.NONFINITE,
                                  f"rank {self.settings.rank}: non-finite {key} ({number}) at step {step}")
        return out

    def profile_tick(self, step: int) -> None:
        self.profile.tick(step)
        if self.profile.profiler is None and self.profile.requests.profile is None:
            self.profiling = False

    def extras(self, now: float, steps: int) -> dict[str, float]:
        """What log() adds of its own: the phases timed since the last call and DDP's newest sample, per step."""
        from ddpdash.trainer.phases import comm_metrics, phase_metric

        out = {phase_metric(name): total / max(steps, 1) for name, total in self.phases.items()}
        self.phases = {}
        if self.comm is not None:
            wall = now - self.last_log_at
            out.update(comm_metrics(self.comm.read(self.next_step), wall / max(steps, 1)))
        self.last_log_at = now
        return out

    def close(self) -> None:
        """Hand on what is left with this rank's outcome; rank 0 of a run no supervisor watches (started by
        hand, or its supervisor gone) records the run's."""
        if self.logger is None or self.closed:
            return
        self.closed = True
        from ddpdash.trainer.registry import record_outcome_if_unsupervised

        status = RankStatus.FAILED if self.failed else RankStatus.STOPPED if self.stop_requested else RankStatus.DONE
        self.logger.close(status=status)
        if self.settings.rank == 0:
            record_outcome_if_unsupervised(self.logger, self.engine, self.settings.run_id or 0, status,
                                           self.settings.launched)


_lock = threading.Lock()
_current: _Run | None = None
_now = time.time


def _run() -> _Run:
    global _current
    if _current is None:
        with _lock:
            if _current is None:
                _current = _Run()
    return _current


# ---- the API ------------------------------------------------------------------------------------------
def init() -> RunSettings:
    """This run's settings (optional: the other calls start the run themselves); calling it again
    returns the same."""
    return _run().settings


def log(values: Mapping[str, Any], step: int | None = None, samples: int | None = None) -> None:
    """Record this rank's `values` at `step` (default: one after the last). `samples` (how many this rank
    trained on since the last call) adds samples/s. An append: it returns at once, and keeps the mapping
    it is given (pass a new one each call, as a dict literal does). Values that are not finite numbers are
    dropped with a warning by the logger's thread, off the step's path (_Run.clean)."""
    run = _current
    if run is not None and run.plain and step is not None and samples is None:
        run.next_step = step + 1  # the usual call: a step given, nothing timed or profiled
        run.append_row((step, _now(), values))
        return
    _log_call(run or _run(), values, step, samples)


def _log_call(run: _Run, values: Mapping[str, Any], step: int | None, samples: int | None) -> None:
    logger = run.logger
    if logger is None:
        return
    if step is None:
        step = run.next_step
    if run.timed:  # phases timed, or a DDP model watched: their figures per step since the last call
        values = {**values, **run.extras(time.perf_counter(), step + 1 - run.next_step)}
    run.next_step = step + 1
    if samples is not None:
        now = time.perf_counter()
        elapsed, run.last_samples_at = now - run.last_samples_at, now
        if elapsed > 0:
            values = {**values, SAMPLES_PER_S: samples / elapsed}
    logger.log(step, values)
    if run.profiling:  # a profile was asked for (set by the logger's thread) or is under way
        run.profile_tick(step)


class phase:  # lower case: used as a context manager, named like one
    """`with ddpdash.phase("data"): ...` times a part of the step; the next log() adds NAME_time (seconds per
    step since the previous log). Names the Live page stacks: data, forward, backward, optimizer."""

    __slots__ = ("name", "started")

    def __init__(self, name: str) -> None:
        self.name = name
        self.started = 0.0

    def __enter__(self) -> phase:
        self.started = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        run = _current or _run()
        run.phases[self.name] = run.phases.get(self.name, 0.0) + time.perf_counter() - self.started
        run.timed = True


def watch(ddp_model: Any) -> Any:
    """Report DDP's own sampled timings of `ddp_model` (a DistributedDataParallel): its backward's
    communication, their overlap with compute, and the communication's share of the step, with each
    log(). Returns the model."""
    from ddpdash.trainer.phases import CommSampler, sample_every, sample_steps, start_sampling

    run = _run()
    if run.logger is not None:
        start_sampling(ddp_model, sample_every(1, 1))
        run.comm = CommSampler(ddp_model, sample_steps(1))
        run.timed = True
    return ddp_model


def should_stop() -> bool:
    """True once ddpdash asked this run to stop (SIGTERM, the Stop button): finish the step and leave."""
    return _run().stop_requested


def event(kind: str, message: str) -> None:
    """A note on the run's Live page (a checkpoint written, a phase begun)."""
    run = _run()
    if run.logger is not None:
        run.logger.event(kind, message)


def finish() -> None:
    """Hand on everything logged and close (also done at exit)."""
    if _current is not None:
        _current.close()


# ---- where the run comes from ---------------------------------------------------------------------------
def _settings_from_env(env: Mapping[str, str]) -> RunSettings:
    enabled = env.get(DISABLED_ENV, "").strip().lower() not in ("1", "true", "yes")
    chosen = json.loads(env.get(SETTINGS_ENV) or "{}")
    known = {k: v for k, v in chosen.items() if k in RunSettings.__dataclass_fields__}
    run_id = env.get(RUN_ID_ENV)
    return RunSettings(**{**known, "rank": int(env.get("RANK", 0)), "local_rank": int(env.get("LOCAL_RANK", 0)),
                          "world_size": int(env.get("WORLD_SIZE", 1)),
                          "run_id": int(run_id) if run_id and run_id.isdigit() else None,
                          "launched": bool(run_id), "enabled": enabled})


def _uses_cuda() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized())


def _open_logger(settings: RunSettings) -> tuple[Any, int, Any]:
    from ddpdash.trainer.registry import RankPlace, open_logger
    from ddpdash.trainer.rundir import RunDir

    script = Path(sys.argv[0]).resolve() if sys.argv and sys.argv[0] not in ("", "-c") else Path.cwd() / "script"
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    place = RankPlace(settings.rank, "cpu", attempt, settings.world_size)
    return open_logger(settings.run_id, None, script.stem, _hand_started_config(script, settings), place,
                       RunDir(script.parent), None, replaces_steps=attempt > 0)


def _hand_started_config(script: Path, settings: RunSettings) -> str:
    from ddpdash.trainer.config import RunConfig

    return RunConfig(name=script.stem, num_procs=settings.world_size, script=str(script),
                     script_args=tuple(sys.argv[1:])).to_json()

