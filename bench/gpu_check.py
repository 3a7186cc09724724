"""One prepared check of ddpdash's GPU paths: CUDA device choice, nccl, amp off / bf16 / fp16 with
GradScaler, the MLP and the transformer at their GPU size presets, `gpu_mem_mb`, NVML, and the
trainer-vs-plain and logging-overhead comparisons — all through ddpdash's own launcher (the CLI).

    python bench/gpu_check.py            # on a machine with an NVIDIA GPU (under 8 minutes on one)
    python bench/gpu_check.py --quick    # fewer steps and rounds (what the test suite runs, on CPU)

One line per check: `<check>: PASS|FAIL|SKIP <detail>`; exit 1 when any check fails. Without a CUDA
GPU every GPU line says SKIP and why, and the same launch-and-verify machinery runs once on CPU
processes (gloo), so the script stays tested where no GPU is. World size 1 with nccl on the GPU: one
GPU cannot host two nccl ranks.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sqlalchemy.orm import Session

from bench.common import ROOT

# The form's "large (GPU)" presets (dashboard/forms.py PRESETS), with batches that keep a step short.
GPU_RUNS = {
    "mlp": ["--recipe", "mlp", "--width", "4096", "--depth", "8", "--batch-size", "256"],
    "transformer": ["--recipe", "transformer", "--width", "1024", "--depth", "12", "--num-heads", "16",
                    "--seq-len", "1024", "--batch-size", "8"],
}
AMPS = ("off", "bf16", "fp16")
TRAINER_VS_PLAIN_TARGET = 0.98
LOGGING_TARGET = 1.01


@dataclass(frozen=True)
class Check:
    name: str
    outcome: str  # PASS | FAIL | SKIP
    detail: str

    def line(self) -> str:
        return f"{self.name}: {self.outcome} {self.detail}"


def cuda_devices() -> list[str]:
    import torch

    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


# ---- launching through ddpdash's CLI and reading what the store says -------------------------------------
def launch_and_verify(name: str, home: Path, flags: list[str], expect_gpu_memory: bool) -> Check:
    """`ddpdash launch … --wait`, then: succeeded, every rank's loss fell, and (on a GPU) gpu_mem_mb logged."""
    env = {k: v for k, v in os.environ.items() if k not in ("DDPDASH_DB_URL", "DDPDASH_TEST_FAULT")}
    env["DDPDASH_HOME"] = str(home)
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "ddpdash.cli", "launch", "--name", name, *flags, "--wait"],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    took = time.monotonic() - started
    run_id = out.stdout.strip().splitlines()[0] if out.stdout.strip() else ""
    if out.returncode != 0 or not run_id.isdigit():
        return Check(name, "FAIL", f"launch exited {out.returncode}: {out.stderr.strip().splitlines()[-1:]}")
    from ddpdash.db.migrate import open_store
    from ddpdash.db.queries import metric_series
    from ddpdash.db.runs import get_run
    from ddpdash.db.vocab import Metric, RunStatus

    engine = open_store(f"sqlite:///{home / 'ddpdash.db'}")
    with Session(engine) as s:
        run = get_run(s, int(run_id))
        loss = metric_series(s, run.id, Metric.LOSS, max_points=100_000)
        memory = metric_series(s, run.id, Metric.GPU_MEM_MB, max_points=100_000)
    engine.dispose()
    if run.status != RunStatus.SUCCEEDED:
        return Check(name, "FAIL", f"run {run.id} {run.status}: {run.error.strip().splitlines()[:1]}")
    problems = []
    for rank, series in loss.sort_values("step").groupby("rank"):
        values = series["value"].tolist()
        tenth = max(len(values) // 10, 1)
        first, last = statistics.fmean(values[:tenth]), statistics.fmean(values[-tenth:])
        if not last < first:
            problems.append(f"rank {rank}'s loss did not fall ({first:.4g} → {last:.4g})")
    if expect_gpu_memory and (memory.empty or not (memory["value"] > 0).all()):
        problems.append("gpu_mem_mb was not recorded")
    if problems:
        return Check(name, "FAIL", "; ".join(problems))
    peak = f", peak {memory['value'].max():.0f} MiB" if not memory.empty else ""
    return Check(name, "PASS", f"run {run.id} succeeded in {took:.0f} s, loss falling on every rank{peak}")


def nvml_check() -> Check:
    from ddpdash.dashboard.livedata import nvml_stats

    try:
        import pynvml  # noqa: F401
    except ImportError:
        return Check("nvml", "FAIL", "nvidia-ml-py is not installed (pip install -e '.[gpu]'; carry its wheel)")
    stats = nvml_stats()
    if not stats or not all(float(g["memory total (GiB)"]) > 0 for g in stats):
        return Check("nvml", "FAIL", f"NVML answered {stats!r}")
    first = stats[0]
    return Check("nvml", "PASS", f"{len(stats)} GPU(s); {first['name']}: {first['util %']:.0f} % busy, "
                 f"{first['memory used (GiB)']:.1f} of {first['memory total (GiB)']:.1f} GiB")


# ---- same-run comparisons on the GPU ---------------------------------------------------------------------
def torchrun(args: list[str], env: dict[str, str]) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", *args]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "PYTHONPATH": str(ROOT), **env})
    if result.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed: {result.stderr[-2000:]}")


def plain_samples_per_s(steps: int, warmup: int, batch: int, width: int) -> float:
    with tempfile.TemporaryDirectory() as work:
        out = Path(work) / "r.json"
        torchrun([str(ROOT / "bench" / "plain_ddp.py"), "--device", "cuda", "--steps", str(steps), "--warmup",
                  str(warmup), "--batch-size", str(batch), "--width", str(width), "--out", str(out)], {})
        return float(json.loads(out.read_text())["samples_per_s"])


def trainer_samples_per_s(steps: int, warmup: int, batch: int, width: int, log_every: int = 1) -> float:
    """ddpdash's trainer on cuda:0 with nccl, relaying every step to a writer in another process."""
    from bench.common import Store
    from ddpdash.db.chunks import read_points
    from ddpdash.trainer.config import RunConfig

    cfg = RunConfig(name="gpu-bench", recipe="mlp", width=width, depth=2, batch_size=batch, max_steps=steps,
                    log_every=log_every, checkpoint_every=0, sync_check_every=0, devices=(0,), backend="nccl")
    with tempfile.TemporaryDirectory() as work:
        (Path(work) / "config.json").write_text(cfg.to_json())
        store = Store(Path(work), relay=True)
        torchrun(["-m", "ddpdash.trainer", "--config", f"{work}/config.json", "--run-id", str(store.run_id),
                  "--db-url", store.url], store.env)
        store.drain()
        with Session(store.engine) as s:
            wall = read_points(s, store.run_id, name="samples_per_s", rank=0)
        store.engine.dispose()
        stamps = dict(zip(wall.step.tolist(), wall.time.tolist(), strict=True))
        first = min(s for s in stamps if s >= warmup)
        return (max(stamps) - first) * batch / (stamps[max(stamps)] - stamps[first])


def compare(name: str, target: float, higher_is_better: bool, rounds: int,
            ours: Callable[[], float], baseline: Callable[[], float]) -> Check:
    ratios = []
    for i in range(rounds):  # interleaved, the order swapped every round: the host's drift hits both
        first, second = (ours, baseline) if i % 2 == 0 else (baseline, ours)
        a, b = first(), second()
        mine, theirs = (a, b) if i % 2 == 0 else (b, a)
        ratios.append(mine / theirs)
    ratio = statistics.median(ratios)
    ok = ratio >= target if higher_is_better else ratio <= target
    shown = ", ".join(f"{r:.3f}" for r in ratios)
    return Check(name, "PASS" if ok else "FAIL",
                 f"{ratio:.3f}× (target {'≥' if higher_is_better else '≤'} {target}×; rounds {shown})")


# ---- the whole check -------------------------------------------------------------------------------------
def run_checks(quick: bool) -> list[Check]:
    gpus = cuda_devices()
    no_gpu = "no CUDA GPU here (torch.cuda.is_available() is False): a GPU-only check"
    checks = [Check("cuda", "PASS", f"{len(gpus)} GPU(s): {', '.join(gpus)}") if gpus
              else Check("cuda", "SKIP", no_gpu)]
    steps = 60 if quick else 200
    with tempfile.TemporaryDirectory() as work:
        home = Path(work) / "home"
        for model, flags in GPU_RUNS.items():
            for amp in AMPS:
                name = f"gpu {model} amp={amp}"
                if not gpus:
                    checks.append(Check(name, "SKIP", no_gpu))
                    continue
                checks.append(launch_and_verify(name, home, [*flags, "--devices", "0", "--backend", "nccl",
                                                             "--amp", amp, "--max-steps", str(steps)], True))
        if not gpus:  # the same machinery, on what this machine has
            checks.append(launch_and_verify("cpu launcher (2 gloo ranks)", home,
                                            ["--num-procs", "2", "--recipe", "mlp", "--width", "32", "--max-steps",
                                             str(steps), "--batch-size", "32"], False))
    checks.append(nvml_check() if gpus else Check("nvml", "SKIP", no_gpu))
    if not gpus:
        checks += [Check("trainer vs plain DDP (gpu)", "SKIP", no_gpu), Check("logging overhead (gpu)", "SKIP", no_gpu)]
        return checks
    bench_steps, warmup, rounds = (1000, 100, 3) if quick else (4000, 200, 5)
    checks.append(compare("trainer vs plain DDP (gpu)", TRAINER_VS_PLAIN_TARGET, True, rounds,
                          lambda: trainer_samples_per_s(bench_steps, warmup, 256, 1024),
                          lambda: plain_samples_per_s(bench_steps, warmup, 256, 1024)))
    # Logging every step against logging every 100th (the timestamps still need a point now and then),
    # same trainer: on a GPU a step is short, so this is where a per-step cost would show.
    checks.append(compare("logging overhead (gpu)", LOGGING_TARGET, False, rounds,
                          lambda: 1 / trainer_samples_per_s(bench_steps, warmup, 256, 1024, log_every=1),
                          lambda: 1 / trainer_samples_per_s(bench_steps, warmup, 256, 1024, log_every=100)))
    return checks


def main() -> None:
    quick = "--quick" in sys.argv
    started = time.monotonic()
    checks = run_checks(quick)
    for check in checks:
        print(check.line(), flush=True)
    failed = [c for c in checks if c.outcome == "FAIL"]
    print(f"{len(checks) - len(failed)} of {len(checks)} checks passed or skipped, {len(failed)} failed "
          f"({time.monotonic() - started:.0f} s)")
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
