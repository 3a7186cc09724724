"""The training loop the logging-overhead benchmark times: an MLP on digits, logging every step.

    python bench/loop.py --logger none|ddpdash|mlflow|tensorboard --steps N --out RESULT.json
                         [--run-id N --db-url URL]   (ddpdash; DDPDASH_RELAY set: through the relay)
                         [--segment K]               (logging on and off every K steps, within the run)
    torchrun --standalone --nproc-per-node 2 bench/loop.py --logger ddpdash ...

Every variant computes the same values (.item() included); only where they go differs.

--segment K: the loop logs in alternate segments of K steps — on, off, off, on, on, off, off, on, … —
and times each one. This machine's slowness comes in bursts of seconds, so neighbouring segments about
ten milliseconds long see the same machine: their ratio is precise where two whole runs' is not.
Segments group into quads (off, on, on, off) whose ratio is taken. So that a quad holds all of
logging's cost, the sink's background thread (ddpdash's relay sender, or writer) no longer runs on its
own timer: it is woken at the first logged segment of a quad, at the cadence its timer would have
(every trainer.metrics.SEND_INTERVAL_S of logged steps), and sends (or writes) what was logged since
while the quad's two logged segments train; the supervisor writes it meanwhile. Each segment records
whether it woke it.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

import ddpdash
from ddpdash.trainer.config import RunConfig
from ddpdash.trainer.data import keep_batch, load
from ddpdash.trainer.metrics import SEND_INTERVAL_S
from ddpdash.trainer.models import build
from ddpdash.trainer.registry import RankPlace, open_logger
from ddpdash.trainer.rundir import RunDir
from ddpdash.trainer.train import DistEnv


class Sink:
    def log(self, step: int, values: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def make_sink(kind: str, workdir: Path, rank: int, run_id: int | None, db_url: str | None) -> Sink:
    if kind == "none":
        return Sink()
    if kind == "ddpdash":
        # The trainer's own choice: through the relay when the harness (standing in for the supervisor)
        # serves one, straight to the database otherwise (a hand-started run).
        env = DistEnv(rank, rank, dist.get_world_size() if dist.is_initialized() else 1, 0, torch.device("cpu"),
                      dist.is_initialized())
        place = RankPlace(env.rank, str(env.device), env.attempt, env.world_size)
        logger, _, _ = open_logger(run_id, db_url, "bench", RunConfig().to_json(), place, RunDir(workdir), None)
        return logger  # type: ignore[return-value]
    if kind == "ddpdash-api":
        # A user's script: the public API, in a run the harness launched (its relay, its run id).
        os.environ["DDPDASH_RUN_ID"] = str(run_id)
        from ddpdash import api

        ddpdash.init()

        class ApiSink(Sink):  # the loop calls ddpdash.log() itself, as a script does; this closes the run
            def close(self) -> None:
                ddpdash.finish()

        sink = ApiSink()
        logger = api._current.logger if api._current else None
        # The segment schedule reaches the logger's thread as it does the trainer's (work_on_demand, wake).
        sink._wake = logger._wake  # type: ignore[attr-defined, union-attr]
        sink._thread = logger._thread  # type: ignore[attr-defined, union-attr]
        sink.logger = logger  # type: ignore[attr-defined]
        return sink
    if kind == "mlflow":
        import mlflow

        mlflow.set_tracking_uri(f"sqlite:///{workdir / f'mlflow{rank}.db'}")
        mlflow.start_run()

        class MlflowSink(Sink):
            def log(self, step: int, values: dict[str, float]) -> None:
                for k, v in values.items():
                    mlflow.log_metric(k, v, step=step)

            def close(self) -> None:
                mlflow.end_run()

        return MlflowSink()
    if kind == "tensorboard":
        from torch.utils.tensorboard import SummaryWriter

        tb = SummaryWriter(str(workdir / f"tb{rank}"))

        class TbSink(Sink):
            def log(self, step: int, values: dict[str, float]) -> None:
                for k, v in values.items():
                    tb.add_scalar(k, v, step)

            def close(self) -> None:
                tb.close()

        return TbSink()
    raise SystemExit(f"unknown logger {kind}")


class Segments:
    """Segment mode's schedule and timings (see the module's docstring)."""

    def __init__(self, steps_per_segment: int, step_s: float) -> None:
        # Wake the sink once every `every` quads: a quad logs 2 segments, so this is its timer's cadence.
        self.every = max(1, round(SEND_INTERVAL_S / (2 * steps_per_segment * step_s)))
        self.times: list[tuple[bool, float, bool]] = []  # (logging, seconds, woke the sink)
        self.start = time.perf_counter()
        self.logging, self.woke = True, False

    def boundary(self, sink: Sink) -> bool:
        """Close the segment that ends here, open the next; whether the next one logs."""
        now = time.perf_counter()
        self.times.append((self.logging, now - self.start, self.woke))
        self.start = now
        index = len(self.times)
        self.logging = index % 4 in (0, 3)
        self.woke = index % 4 == 3 and (index // 4) % self.every == 0
        if self.woke:
            wake(sink)
        return self.logging

    def finish(self) -> None:
        self.times.append((self.logging, time.perf_counter() - self.start, self.woke))


def work_on_demand(sink: Sink) -> None:
    """Segment mode: the sink's background thread no longer works on its timer, only when woken."""
    target = getattr(sink, "logger", sink)
    if hasattr(target, "send_interval_s"):
        target.send_interval_s = 3600.0
    wake(sink)  # the thread re-reads its interval once it has done this round


def wake(sink: Sink) -> None:
    event = getattr(sink, "_wake", None)
    if event is not None:
        event.set()


def agreed_step_time(step_s: float) -> float:
    """Rank 0's estimate, so that every rank wakes its sink in the same quads."""
    if not dist.is_initialized():
        return step_s
    t = torch.tensor([step_s], dtype=torch.float64)
    dist.broadcast(t, src=0)
    return float(t.item())


def thread_cpu(sink: Sink) -> float:
    """CPU seconds of the sink's background thread so far (ddpdash's sender or writer), 0 without one."""
    thread = getattr(sink, "_thread", None)
    if thread is None or thread.ident is None or not thread.is_alive():
        return 0.0
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--logger", default="none")
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--workdir", default=None)
    p.add_argument("--out", required=True)
    p.add_argument("--run-id", type=int, help="ddpdash: the run the harness created")
    p.add_argument("--db-url", help="ddpdash: the harness's database")
    p.add_argument("--segment", type=int, default=0, help="log in alternate segments of this many steps")
    args = p.parse_args()
    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    workdir = Path(args.workdir or tempfile.mkdtemp())
    cfg = RunConfig(recipe="mlp", width=64, depth=2, batch_size=32)
    torch.manual_seed(0)
    data = load(cfg)
    model = build(cfg, data)
    ddp = DDP(model) if distributed else model
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sampler = DistributedSampler(data.train, num_replicas=world, rank=rank, seed=0, drop_last=True)
    loader = DataLoader(data.train, batch_size=32, sampler=sampler, drop_last=True, collate_fn=keep_batch)
    sink = make_sink(args.logger, workdir, rank, args.run_id, args.db_url)
    script = args.logger == "ddpdash-api"
    append_row = getattr(sink, "append_row", None)  # ddpdash's trainer path
    if args.segment:
        work_on_demand(sink)
    segments: Segments | None = None
    step, epoch, start, log_s, thread_start, half_warm = 0, 0, 0.0, 0.0, 0.0, 0.0
    logging, logged_steps = True, 0
    while step < args.steps + args.warmup:
        sampler.set_epoch(epoch)
        for x, y, _ in loader:
            if step == args.warmup // 2:
                half_warm = time.perf_counter()
            if step == args.warmup:
                if args.segment:
                    step_s = (time.perf_counter() - half_warm) / (args.warmup - args.warmup // 2)
                    segments = Segments(args.segment, agreed_step_time(step_s))
                start, log_s, thread_start = time.perf_counter(), 0.0, thread_cpu(sink)
            elif segments is not None and (step - args.warmup) % args.segment == 0:
                logging = segments.boundary(sink)
            t0 = time.perf_counter()
            loss = torch.nn.functional.cross_entropy(ddp(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            values = {"loss": loss.item(), "samples_per_s": 32 / (time.perf_counter() - t0), "lr": 0.05}
            if segments is not None:  # timed by segment: the log() call alone is not timed
                if logging:
                    if script:  # as a user's script calls it, with no adapter in between
                        ddpdash.log(values, step=step)
                    elif append_row is not None:  # as the trainer does (trainer/train.py, after_step)
                        append_row((step, time.time(), values))
                    else:
                        sink.log(step, values)
                    logged_steps += 1
            else:
                t_log = time.perf_counter()
                if script:
                    ddpdash.log(values, step=step)
                elif append_row is not None:
                    append_row((step, time.time(), values))
                else:
                    sink.log(step, values)
                log_s += time.perf_counter() - t_log
                logged_steps += 1
            if step >= args.steps + args.warmup:
                break
        epoch += 1
    elapsed = time.perf_counter() - start
    if segments is not None:
        segments.finish()
    thread_s = thread_cpu(sink) - thread_start
    sink.close()  # flushing what is left is part of the cost
    elapsed_with_close = time.perf_counter() - start
    if rank == 0:
        Path(args.out).write_text(json.dumps({"elapsed": elapsed, "elapsed_with_close": elapsed_with_close,
                                              "steps": args.steps, "warmup": args.warmup,
                                              "log_s": log_s, "thread_s": thread_s, "logged_steps": logged_steps,
                                              "segments": segments.times if segments else []}))
    del ddp, model, opt, loss
    gc.collect()  # release DDP before tearing the group down (NOTES: SIGABRT at exit otherwise)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
