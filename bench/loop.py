"""The training loop the logging-overhead benchmark times: an MLP on digits, logging every step.

    python bench/loop.py --logger none|ddpdash|mlflow|tensorboard --steps N --out RESULT.json
                         [--run-id N --db-url URL]   (ddpdash; DDPDASH_RELAY set: through the relay)
    torchrun --standalone --nproc-per-node 2 bench/loop.py --logger ddpdash ...

Every variant computes the same values (.item() included); only where they go differs.
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

from trainer.config import RunConfig
from trainer.data import keep_batch, load
from trainer.models import build
from trainer.train import DistEnv, open_writer


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
        writer, _, _ = open_writer(argparse.Namespace(run_id=run_id, db_url=db_url), RunConfig(), env, workdir, None)
        return writer  # type: ignore[return-value]
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
    args = p.parse_args()
    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    workdir = Path(args.workdir or tempfile.mkdtemp())
    cfg = RunConfig(model="mlp", width=64, depth=2, batch_size=32)
    torch.manual_seed(0)
    data = load(cfg)
    model = build(cfg, data)
    ddp = DDP(model) if distributed else model
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sampler = DistributedSampler(data.train, num_replicas=world, rank=rank, seed=0, drop_last=True)
    loader = DataLoader(data.train, batch_size=32, sampler=sampler, drop_last=True, collate_fn=keep_batch)
    sink = make_sink(args.logger, workdir, rank, args.run_id, args.db_url)
    step, epoch, start, log_s, thread_start = 0, 0, 0.0, 0.0, 0.0
    while step < args.steps + args.warmup:
        sampler.set_epoch(epoch)
        for x, y, _ in loader:
            if step == args.warmup:
                start, log_s, thread_start = time.perf_counter(), 0.0, thread_cpu(sink)
            t0 = time.perf_counter()
            loss = torch.nn.functional.cross_entropy(ddp(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            values = {"loss": loss.item(), "samples_per_s": 32 / (time.perf_counter() - t0), "lr": 0.05}
            t_log = time.perf_counter()
            sink.log(step, values)
            log_s += time.perf_counter() - t_log
            if step >= args.steps + args.warmup:
                break
        epoch += 1
    elapsed = time.perf_counter() - start
    thread_s = thread_cpu(sink) - thread_start
    sink.close()  # flushing what is left is part of the cost
    elapsed_with_close = time.perf_counter() - start
    if rank == 0:
        Path(args.out).write_text(json.dumps({"elapsed": elapsed, "elapsed_with_close": elapsed_with_close,
                                              "steps": args.steps, "warmup": args.warmup,
                                              "log_s": log_s, "thread_s": thread_s}))
    del ddp, model, opt, loss
    gc.collect()  # release DDP before tearing the group down (NOTES: SIGABRT at exit otherwise)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
