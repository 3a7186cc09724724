"""The DDP training loop, in each rank. trainer/__main__.py has the command that runs it."""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import math
import os
import signal
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from ddpdash.db.vocab import EventKind, Metric, RankStatus
from ddpdash.recipe import Recipe

from . import flight_recorder, mpi
from .config import RunConfig
from .data import Samples
from .faults import Fault, InjectedFault, parse_faults
from .metrics import RankLogger
from .phases import CommSampler, comm_metrics, sample_every, sample_steps, start_sampling
from .profiling import ProfileHook
from .recipes import batch_length, forward, load_recipe, to_device
from .registry import RankPlace, open_logger, record_outcome_if_unsupervised, run_key
from .requests import RankRequests
from .rundir import RunDir

log = logging.getLogger(__name__)


# ---- process group ---------------------------------------------------------------------------
@dataclass(frozen=True)
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    attempt: int
    device: torch.device
    distributed: bool


def pick_device(cfg: RunConfig, local_rank: int) -> torch.device:
    if not cfg.uses_cuda:
        return torch.device("cpu")
    # The launcher narrows CUDA_VISIBLE_DEVICES to the chosen GPUs; by hand, index them directly.
    index = local_rank if os.environ.get("CUDA_VISIBLE_DEVICES") else cfg.devices[local_rank]
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def init_distributed(cfg: RunConfig) -> DistEnv:
    env = os.environ
    if cfg.resolved_backend == "mpi" and mpi.rank_from_env(env) is not None:
        return init_mpi(cfg)
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return DistEnv(0, 0, 1, 0, pick_device(cfg, 0), False)
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    local_rank, attempt = int(env.get("LOCAL_RANK", 0)), int(env.get("TORCHELASTIC_RESTART_COUNT", 0))
    device = pick_device(cfg, local_rank)
    timeout = timedelta(seconds=cfg.pg_timeout_s)
    # A store prefixed per attempt: the default init reconnects to the previous attempt's gloo
    # addresses after a restart and fails (shared/NOTES.md); this worked every time.
    agent_hosts_store = env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world_size=world,
                          is_master=rank == 0 and not agent_hosts_store, timeout=timeout)
    prefixed = dist.PrefixStore(f"ddpdash/attempt_{attempt}", store)
    dist.init_process_group(cfg.resolved_backend, store=prefixed, rank=rank, world_size=world, timeout=timeout)
    return DistEnv(rank, local_rank, world, attempt, device, True)


def init_mpi(cfg: RunConfig) -> DistEnv:
    """A rank started by mpirun: MPI itself knows the rank and the world size (no store, no restarts)."""
    placed = mpi.rank_from_env(os.environ)
    assert placed is not None
    _, local_rank, _ = placed
    dist.init_process_group("mpi", timeout=timedelta(seconds=cfg.pg_timeout_s))
    return DistEnv(dist.get_rank(), local_rank, dist.get_world_size(), 0, pick_device(cfg, local_rank), True)


# ---- stop signal -----------------------------------------------------------------------------
class StopFlag:
    """SIGTERM asks the loop to finish its step, flush and leave."""

    def __init__(self) -> None:
        self.requested = False
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, _frame: Any) -> None:
        self.requested = True


# ---- checkpoints -----------------------------------------------------------------------------
def save_checkpoint(path: Path, model: nn.Module, opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                    step: int, owner: str) -> None:
    """`owner` is the run's key: only that run may resume from this file."""
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "scaler": scaler.state_dict(),
                "step": step, "run": owner}, tmp)
    os.replace(tmp, path)  # atomic: a crash mid-write leaves the previous checkpoint whole


def read_checkpoint(path: Path, owner: str) -> dict[str, Any] | None:
    """The run folder's checkpoint when this run (key `owner`) wrote it (read once: main() needs its step,
    train() its state). Another run's checkpoint — a folder reused by hand, or after a database reset —
    is left alone: this run starts from step 0."""
    if not path.exists():
        return None
    state = torch.load(path, map_location="cpu", weights_only=True)
    if state.get("run") != owner:
        log.warning("%s was written by another run (%s); not resuming from it", path, state.get("run") or "unknown")
        return None
    return state


def apply_checkpoint(state: dict[str, Any], model: nn.Module, opt: torch.optim.Optimizer,
                     scaler: torch.amp.GradScaler) -> int:
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])  # moves the state to the parameters' device
    scaler.load_state_dict(state["scaler"])
    return int(state["step"])


# ---- pieces of the loop ----------------------------------------------------------------------
def make_optimizer(cfg: RunConfig, params: Iterator[nn.Parameter]) -> torch.optim.Optimizer:
    lr = cfg.effective_lr
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=lr)
    return torch.optim.AdamW(params, lr=lr)


def lr_at(cfg: RunConfig, step: int) -> float:
    if cfg.warmup_steps and step <= cfg.warmup_steps:
        return cfg.effective_lr * step / cfg.warmup_steps
    return cfg.effective_lr


def wrap_ddp(cfg: RunConfig, model: nn.Module, env: DistEnv) -> nn.Module:
    if not env.distributed:
        return model
    ddp = DDP(
        model,
        device_ids=[env.device.index] if env.device.type == "cuda" else None,
        bucket_cap_mb=cfg.bucket_cap_mb,
        find_unused_parameters=cfg.find_unused_parameters,
        gradient_as_bucket_view=cfg.gradient_as_bucket_view,
        static_graph=cfg.static_graph,
    )
    register_comm_hook(cfg, ddp)
    return ddp


def register_comm_hook(cfg: RunConfig, ddp: DDP) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if cfg.comm_hook == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif cfg.comm_hook == "bf16":
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif cfg.comm_hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                            start_powerSGD_iter=2)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)


def autocast(cfg: RunConfig, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    if cfg.amp == "off":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if cfg.amp == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


@torch.no_grad()
def evaluate(cfg: RunConfig, model: nn.Module, recipe: Recipe, device: torch.device) -> dict[str, float]:
    """The recipe's loss and metrics over its whole validation set, each weighted by its batch's size."""
    if recipe.val is None or len(recipe.val) == 0:
        return {}
    model.eval()
    loader = DataLoader(recipe.val, batch_size=max(cfg.batch_size, 64), collate_fn=recipe.collate_fn)
    sums: dict[str, float] = {}
    count = 0
    for batch in loader:
        batch = to_device(batch, device)
        n = batch_length(batch) or 1
        with autocast(cfg, device):
            out = forward(recipe, model, batch)
            values = {Metric.LOSS: recipe.loss(out, batch), **(recipe.metrics(out, batch) if recipe.metrics else {})}
        for name, value in values.items():
            sums[name] = sums.get(name, 0.0) + float(value) * n
        count += n
    model.train()
    return {Metric.VAL_PREFIX + name: total / max(count, 1) for name, total in sums.items()}


def param_checksums(model: nn.Module) -> torch.Tensor:
    return torch.stack([p.detach().double().sum() for p in model.parameters()])


def sync_check(model: nn.Module, env: DistEnv) -> list[int]:
    """Ranks whose parameters differ from rank 0's (all ranks take part: it is a collective)."""
    local = param_checksums(model)
    gathered = [torch.empty_like(local) for _ in range(env.world_size)]
    dist.all_gather(gathered, local)
    # NaN equals NaN here: replicas that blew up alike are in sync (the non-finite event says the rest).
    return [r for r, g in enumerate(gathered) if not torch.allclose(g, gathered[0], rtol=0.0, atol=0.0, equal_nan=True)]


class PhaseClock:
    """Sums each phase's time over a log window: perf_counter on CPU; CUDA events on a GPU (the work is
    asynchronous there), read at the log step, which waits for the device anyway."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.sums: dict[str, float] = dict.fromkeys(Metric.PHASES, 0.0)
        self.pending: list[tuple[str, Any, Any]] = []

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def add(self, phase: str, start: Any, end: Any) -> None:
        if self.cuda:
            self.pending.append((phase, start, end))
        else:
            self.sums[phase] += end - start

    def totals(self) -> dict[str, float]:
        for phase, start, end in self.pending:
            self.sums[phase] += start.elapsed_time(end) / 1e3
        self.pending.clear()
        return self.sums


@dataclass
class Window:
    """What happened since the last log line."""

    first_step: int
    cuda: bool = False
    start: float = field(default_factory=time.perf_counter)
    steps: int = 0
    samples: int = 0
    compute_s: float = 0.0
    data_s: float = 0.0
    losses: list[torch.Tensor] = field(default_factory=list)  # each micro-batch's, on the device till a log step
    grad_norm: torch.Tensor | None = None  # the log step's, before its update
    micro_batches: int = 0
    metric_sums: dict[str, Any] = field(default_factory=dict)  # the recipe's metrics, as tensors till a log step
    phases: PhaseClock = field(init=False)

    def __post_init__(self) -> None:
        self.phases = PhaseClock(self.cuda)


# ---- the loop --------------------------------------------------------------------------------
@dataclass
class Trainee:
    """What a rank trains, and the settings each step reads."""

    cfg: RunConfig
    env: DistEnv
    recipe: Recipe
    module: nn.Module  # the replica itself: checkpoints and sync checks read it
    model: nn.Module  # what forward runs through: the DDP wrapper when distributed
    opt: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    samples_per_step: int
    tokens_per_sample: int
    run_key: str  # whose checkpoints these are
    checkpoint_path: Callable[[int], Path]  # where the checkpoint of a step goes
    comm: CommSampler | None = None  # DDP's sampled backward timings (None without DDP)
    nonfinite_reported: bool = False  # a rank reports its first non-finite loss or gradient norm only


def make_trainee(cfg: RunConfig, env: DistEnv, recipe: Recipe, run_key: str,
                 checkpoint_path: Callable[[int], Path]) -> Trainee:
    module = recipe.model.to(env.device)
    model = wrap_ddp(cfg, module, env)
    comm = None
    if isinstance(model, DDP):
        start_sampling(model, sample_every(cfg.log_every, cfg.grad_accum_steps))
        comm = CommSampler(model, sample_steps(cfg.log_every))
    return Trainee(
        cfg, env, recipe, module, model, make_optimizer(cfg, module.parameters()),
        torch.amp.GradScaler(env.device.type, enabled=cfg.amp == "fp16"),
        samples_per_step=cfg.batch_size * cfg.grad_accum_steps,
        tokens_per_sample=recipe.tokens_per_sample, run_key=run_key, checkpoint_path=checkpoint_path, comm=comm,
    )


def trainee_of(cfg: RunConfig, env: DistEnv, run_key: str, checkpoint_path: Callable[[int], Path]) -> Trainee:
    torch.manual_seed(cfg.seed)  # same seed on every rank before the model is built: replicas start identical
    return make_trainee(cfg, env, load_recipe(cfg), run_key, checkpoint_path)


def make_loader(t: Trainee) -> tuple[DataLoader[Any], DistributedSampler[Any]]:
    cfg, env = t.cfg, t.env
    train_set = t.recipe.train
    sampler = DistributedSampler(train_set, num_replicas=env.world_size, rank=env.rank, shuffle=True,
                                 seed=cfg.seed, drop_last=True)
    if len(sampler) < cfg.batch_size * cfg.grad_accum_steps:
        raise ValueError(f"the train set has {len(train_set)} samples: {len(sampler)} per rank, fewer than one "
                         f"step's {cfg.batch_size} × {cfg.grad_accum_steps} (batch × accumulation)")
    loader = DataLoader(train_set, batch_size=cfg.batch_size, sampler=sampler, num_workers=cfg.num_workers,
                        collate_fn=t.recipe.collate_fn, drop_last=True, pin_memory=env.device.type == "cuda",
                        persistent_workers=cfg.num_workers > 0)
    return loader, sampler


def train(cfg: RunConfig, env: DistEnv, logger: RankLogger, run_dir: RunDir, stop: StopFlag,
          faults: list[Fault], run_key: str, checkpoint: dict[str, Any] | None = None,
          supervised: bool = False, profile: ProfileHook | None = None) -> str:
    """Train until done or asked to stop; returns the rank's final status (done or stopped). A supervised
    run writes its checkpoints as pending: the supervisor promotes one once every rank's metrics up to
    its step are stored, so a restart never resumes past metrics that were lost with a killed rank."""
    checkpoint_path = run_dir.pending_checkpoint if supervised else (lambda _step: run_dir.checkpoint)
    t = trainee_of(cfg, env, run_key, checkpoint_path)
    step = apply_checkpoint(checkpoint, t.module, t.opt, t.scaler) if checkpoint else 0
    loader, sampler = make_loader(t)
    steps_per_epoch = max(len(loader) // cfg.grad_accum_steps, 1)
    total = total_steps(cfg, steps_per_epoch)
    if env.rank == 0:
        logger.set_total_steps(total)
    sample_log = _sample_log(env)
    cuda = env.device.type == "cuda"
    window = Window(step + 1, cuda)
    first_step = step
    epoch = step // steps_per_epoch
    while step < total and not stop.requested:
        sampler.set_epoch(epoch)
        batches = iter(loader)
        for _ in range((step % steps_per_epoch) * cfg.grad_accum_steps):  # resume mid-epoch where we left off
            next(batches)
        for _ in range(steps_per_epoch - step % steps_per_epoch):
            if step >= total or stop.requested:
                break
            step += 1
            # static_graph + no_sync fails on the very first iteration (NOTES): sync that one fully.
            may_skip_sync = env.distributed and not (cfg.static_graph and step == first_step + 1)
            log_step = step % cfg.log_every == 0 or step == total
            train_step(t, step, batches, window, may_skip_sync, sample_log, log_step)
            apply_faults(faults, env, step, t.module)
            window = after_step(t, step, log_step, window, logger)
            if profile is not None:
                profile.tick(step)
        if step % steps_per_epoch == 0 or step >= total:
            if env.rank == 0:
                logger.log(step, {**evaluate(cfg, t.module, t.recipe, env.device), Metric.EPOCH: float(epoch + 1)})
            epoch += 1
    if sample_log is not None:
        sample_log.close()
    return RankStatus.STOPPED if stop.requested and step < total else RankStatus.DONE


def train_step(t: Trainee, step: int, batches: Iterator[Any], window: Window, may_skip_sync: bool,
               sample_log: Any, log_step: bool = False) -> None:
    """One optimizer step: grad_accum_steps micro-batches (no_sync on all but the last), then the update;
    each phase timed (PhaseClock), the gradient norm taken on log steps."""
    cfg, env = t.cfg, t.env
    for g in t.opt.param_groups:
        g["lr"] = lr_at(cfg, step)
    recipe, clock = t.recipe, window.phases
    for micro in range(cfg.grad_accum_steps):
        m0, t0 = clock.mark(), time.perf_counter()
        batch = to_device(next(batches), env.device)
        m1, t1 = clock.mark(), time.perf_counter()
        window.data_s += t1 - t0
        if sample_log is not None and isinstance(recipe.train, Samples):  # its batches end with their indices
            sample_log.write(" ".join(map(str, batch[-1].tolist())) + "\n")
        last_micro = micro == cfg.grad_accum_steps - 1
        sync_ctx = t.model.no_sync() if may_skip_sync and not last_micro else contextlib.nullcontext()
        with sync_ctx:
            with autocast(cfg, env.device):
                out = forward(recipe, t.model, batch)
                loss = recipe.loss(out, batch) / cfg.grad_accum_steps
            m2 = clock.mark()
            t.scaler.scale(loss).backward()
        m3 = clock.mark()
        clock.add(Metric.DATA_TIME, m0, m1)
        clock.add(Metric.FORWARD_TIME, m1, m2)
        clock.add(Metric.BACKWARD_TIME, m2, m3)
        window.losses.append(loss.detach())
        if recipe.metrics is not None:
            add_metrics(window, recipe, out, batch)
        window.micro_batches += 1
        window.compute_s += time.perf_counter() - t1
    m4, t2 = clock.mark(), time.perf_counter()
    # fp16's scaled gradients overflow on purpose (GradScaler skips those steps): no norm to judge there.
    if log_step and step % sample_steps(cfg.log_every) == 0 and cfg.amp != "fp16":
        window.grad_norm = total_grad_norm(t.module)
    t.scaler.step(t.opt)
    t.scaler.update()
    t.opt.zero_grad(set_to_none=True)
    clock.add(Metric.OPTIMIZER_TIME, m4, clock.mark())
    window.compute_s += time.perf_counter() - t2
    window.steps += 1
    window.samples += t.samples_per_step


def total_grad_norm(module: nn.Module) -> torch.Tensor | None:
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    return torch.nn.utils.get_total_norm(grads) if grads else None


@torch.no_grad()
def add_metrics(window: Window, recipe: Recipe, out: Any, batch: Any) -> None:
    assert recipe.metrics is not None
    for name, value in recipe.metrics(out, batch).items():
        value = value.detach() if isinstance(value, torch.Tensor) else float(value)
        window.metric_sums[name] = window.metric_sums.get(name, 0.0) + value


def after_step(t: Trainee, step: int, log_step: bool, window: Window, logger: RankLogger) -> Window:
    """What follows a step: its metrics at log steps (and a first non-finite value's event), the
    replica-sync check, the checkpoint. Returns the window the next step adds to."""
    cfg, env = t.cfg, t.env
    if log_step:
        values, nonfinite = window_metrics(window, t, step)
        logger.append_row((step, time.time(), values))
        if nonfinite and not t.nonfinite_reported:
            t.nonfinite_reported = True
            logger.event(EventKind.NONFINITE, f"rank {env.rank}: {nonfinite}")
        window = Window(step + 1, window.cuda)
    if cfg.sync_check_every and env.distributed and step % cfg.sync_check_every == 0:
        bad = sync_check(t.module, env)
        if bad and env.rank == 0:
            logger.event(EventKind.DESYNC, f"replicas out of sync at step {step}: rank(s) {bad} differ from rank 0")
    if cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and env.rank == 0:
        save_checkpoint(t.checkpoint_path(step), t.module, t.opt, t.scaler, step, t.run_key)
    return window


def total_steps(cfg: RunConfig, steps_per_epoch: int) -> int:
    by_epochs = cfg.num_epochs * steps_per_epoch if cfg.num_epochs else math.inf
    by_steps = cfg.max_steps or math.inf
    return int(min(by_epochs, by_steps))


def window_metrics(w: Window, t: Trainee, step: int) -> tuple[dict[str, float], str]:
    """The window's metrics per step, and what was first non-finite in it ("" when nothing was)."""
    elapsed = max(time.perf_counter() - w.start, 1e-9)
    steps = max(w.steps, 1)
    # One read from the device (a sync: only at log steps): every micro-batch's loss, and the gradient norm.
    tensors = [*w.losses, *([w.grad_norm] if w.grad_norm is not None else [])]
    read = [tensors[0].item()] if len(tensors) == 1 else torch.stack(tensors).float().tolist()
    losses, grad_norm = read[:len(w.losses)], (read[-1] if w.grad_norm is not None else None)
    values = {
        Metric.LOSS: sum(losses) / steps,
        Metric.SAMPLES_PER_S: w.samples / elapsed,
        Metric.STEP_TIME: w.compute_s / steps,
        Metric.LR: float(t.opt.param_groups[0]["lr"]),
    }
    values.update({name: total / steps for name, total in w.phases.totals().items()})
    if grad_norm is not None:
        values[Metric.GRAD_NORM] = grad_norm
    if t.comm is not None:
        values.update(comm_metrics(t.comm.read(step), (w.compute_s + w.data_s) / steps))
    env, tokens_per_sample = t.env, t.tokens_per_sample
    for name, total in w.metric_sums.items():  # .item() of the recipe's tensors: here, at log steps only
        values[name] = float(total) / max(w.micro_batches, 1)
    if tokens_per_sample:
        values[Metric.TOKENS_PER_S] = values[Metric.SAMPLES_PER_S] * tokens_per_sample
    if env.device.type == "cuda":
        values[Metric.GPU_MEM_MB] = torch.cuda.max_memory_allocated(env.device) / 2**20
    return values, first_nonfinite(losses, grad_norm, w.first_step, t.cfg.grad_accum_steps, step)


def first_nonfinite(losses: list[float], grad_norm: float | None, first_step: int, accum: int, step: int) -> str:
    """The window's first non-finite loss (by step) or gradient norm, in words; "" when all were finite."""
    bad = next((i for i, v in enumerate(losses) if not math.isfinite(v)), None)
    if bad is not None:
        return f"non-finite loss ({losses[bad]}) at step {first_step + bad // accum}"
    if grad_norm is not None and not math.isfinite(grad_norm):
        return f"non-finite gradient norm ({grad_norm}) at step {step}"
    return ""


def apply_faults(faults: list[Fault], env: DistEnv, step: int, module: nn.Module) -> None:
    for f in faults:
        if f.rank != env.rank:
            continue
        if f.kind == "sleep":
            time.sleep(f.at)
        elif step == int(f.at) and f.kind == "nan":
            with torch.no_grad():  # a real blow-up: this rank's next loss is NaN, and the all-reduce spreads it
                next(module.parameters()).view(-1)[0] = math.nan
        elif step == int(f.at) and f.kind == "stall":
            time.sleep(3600)
        elif step == int(f.at):
            if f.kind == "raise" or (f.kind == "raise-once" and env.attempt == 0):
                raise InjectedFault(f"injected fault on rank {env.rank} at step {step} (DDPDASH_TEST_FAULT)")
            if f.kind == "perturb":
                with torch.no_grad():
                    next(module.parameters()).view(-1)[0] += 1e-3


def _sample_log(env: DistEnv) -> Any:
    folder = os.environ.get("DDPDASH_TEST_SAMPLE_LOG")
    if not folder:
        return None
    Path(folder).mkdir(parents=True, exist_ok=True)
    return open(Path(folder) / f"rank{env.rank}.attempt{env.attempt}.txt", "w")


def _dump_threads_on_request(run_dir: RunDir, rank: int) -> None:
    """SIGUSR2 makes this rank write all its threads' stacks (the fallback where py-spy cannot attach);
    nothing runs until asked. Appended (the reader empties the file before it asks)."""
    import faulthandler

    path = run_dir.stack_file(rank)
    try:
        path.parent.mkdir(exist_ok=True)
        faulthandler.register(signal.SIGUSR2, file=open(path, "a"), all_threads=True)  # noqa: SIM115 (kept open)
    except OSError as exc:
        log.warning("no stack dumps on request: %s", exc)


# ---- entry -----------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ddpdash.trainer", description="One rank of a ddpdash DDP run.")
    p.add_argument("--config", required=True, type=Path, help="RUN_DIR/config.json written by ddpdash")
    p.add_argument("--run-id", type=int, help="the run's id in the database (omit to register a new run)")
    p.add_argument("--db-url", help="SQLAlchemy URL (default: DDPDASH_DB_URL or $DDPDASH_HOME/ddpdash.db)")
    return p.parse_args(argv)


@record
def main(argv: list[str] | None = None) -> int:
    rank_label = os.environ.get("RANK", "0")
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank_label} %(levelname)s %(message)s")
    args = parse_args(argv)
    cfg = RunConfig.from_file(args.config)
    run_dir = RunDir.of_config(args.config)
    stop = StopFlag()
    faults = parse_faults()
    env = init_distributed(cfg)
    supervised = args.run_id is not None
    key = run_key(run_dir)
    checkpoint = read_checkpoint(run_dir.checkpoint, key)
    resume_step = int(checkpoint["step"]) if checkpoint else 0
    resuming = env.attempt > 0 or resume_step > 0
    if env.rank == 0 and env.attempt > 0:
        for _, stale in run_dir.pending_checkpoints():  # the failed attempt's: never to be promoted now
            stale.unlink(missing_ok=True)
    _dump_threads_on_request(run_dir, env.rank)
    where = RankPlace(env.rank, str(env.device), env.attempt, env.world_size)
    logger, run_id, engine = open_logger(args.run_id, args.db_url, cfg.name, cfg.to_json(), where, run_dir,
                                         resume_step if resuming else None, key)
    requests = RankRequests(run_dir, env.rank, flight_recorder.dump)
    logger.on_tick = requests.poll  # a Flight Recorder dump, a profile: asked through the run folder
    profile = ProfileHook(requests, env.rank, env.device.type, logger.event)
    if env.rank == 0:
        if resuming:
            logger.event(EventKind.RESTART,
                         f"attempt {env.attempt}: resuming from the checkpoint at step {resume_step}")
        else:
            backend = cfg.resolved_backend if env.distributed else "none"
            logger.event(EventKind.STARTED, f"{env.world_size} rank(s), backend {backend}")
    log.info("run %s: %d rank(s) on %s, attempt %d, metrics %s", run_id, env.world_size, env.device, env.attempt,
             "via the supervisor's relay" if engine is None else "written to the database directly")
    status = RankStatus.FAILED
    try:
        status = train(cfg, env, logger, run_dir, stop, faults, key, checkpoint, supervised, profile)
        del checkpoint
    except Exception as exc:
        if stop.requested:
            status = RankStatus.STOPPED  # a peer left first during the shutdown; that is the stop, not a failure
        else:
            flight_recorder.dump(run_dir.flight_recorder(flight_recorder.FAILURE_DUMP), env.rank)
            logger.event(EventKind.RANK_FAILED, f"rank {env.rank}: {type(exc).__name__}: {exc}", traceback.format_exc())
            raise
    finally:
        logger.close(status=status)
        if env.rank == 0:
            record_outcome_if_unsupervised(logger, engine, run_id, status, supervised)
        gc.collect()  # release DDP's buffers before tearing the group down: avoids SIGABRT at exit (NOTES)
        if dist.is_initialized():
            dist.destroy_process_group()
    log.info("run %s: rank %d %s", run_id, env.rank, status)
    if any(f.kind == "abort-exit" and f.rank == env.rank for f in faults):
        os.abort()  # DDPDASH_TEST_FAULT: the SIGABRT-at-exit that torchrun reports as a failure
    return 0
