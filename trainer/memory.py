"""A run's memory, estimated from its config before anything starts: parameters, gradients, optimizer
state, DDP's gradient buckets, the activations of one batch, the data set, DataLoader workers and each
rank's own process. Pure arithmetic (no torch): the form shows it and validation refuses a run that
will not fit (RunConfig.memory_check turns that off).

The figures are deliberately on the high side — fp32 everywhere, every activation kept for backward —
so a run refused here would really not have fitted, give or take the allocator's slack.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config import RunConfig  # config.py imports this module when it validates

FP32 = 4
INT64 = 8
MIB = 2**20
GIB = 2**30
RANK_PROCESS_BYTES = 600 * MIB  # a rank before its model: Python, torch, gloo (and SQLAlchemy when it writes the
# store itself): peak RSS measured 400 MiB relaying, up to ≈ 520 MiB writing directly
WORKER_PROCESS_BYTES = 300 * MIB  # a DataLoader worker: its own interpreter and a copy-on-write share of the data
FIT_FRACTION = 0.9  # of the memory free now: the rest is the page cache's and the dashboard's
# The built-in data sets' input sizes (trainer/data.py).
DIGITS = 1797
DIGITS_FEATURES = 64
DIGITS_CLASSES = 10
REGRESSION_FEATURES = 10
TEXT_BYTES = 800_000
VOCAB = 256


@dataclass(frozen=True)
class MemoryEstimate:
    parameters: int  # count
    weights_bytes: int  # parameters, their gradients, the optimizer's state and DDP's buckets
    activations_bytes: int  # one micro-batch's, kept for backward
    data_bytes: int
    process_bytes: int  # the rank's own process and its DataLoader workers
    world_size: int
    on_gpu: bool

    @property
    def device_bytes(self) -> int:
        """What each rank needs on its device (a GPU, or the CPU's memory)."""
        return self.weights_bytes + self.activations_bytes + (0 if self.on_gpu else self.data_bytes)

    @property
    def host_bytes(self) -> int:
        """What this machine's memory must hold for all ranks together."""
        per_rank = self.process_bytes + self.data_bytes + (0 if self.on_gpu else self.device_bytes - self.data_bytes)
        return per_rank * self.world_size

    def text(self) -> str:
        where = f"{_gib(self.device_bytes)} per GPU, " if self.on_gpu else ""
        return (f"≈ {where}{_gib(self.host_bytes)} of this machine's memory for {self.world_size} rank(s) "
                f"({self.parameters:,} parameters: {_gib(self.weights_bytes)} with gradients and optimizer state "
                f"per rank; activations {_gib(self.activations_bytes)} per batch)")


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB / 10 else f"{n / MIB:.0f} MiB"


def estimate(c: RunConfig) -> MemoryEstimate:
    params = parameter_count(c)
    optimizer_copies = 1 if c.optimizer == "sgd" else 2  # momentum; or Adam's two moments
    bucket_copies = 0 if c.gradient_as_bucket_view or c.world_size == 1 else 1
    weights = params * FP32 * (2 + optimizer_copies + bucket_copies)  # weights and grads, then the rest
    return MemoryEstimate(
        parameters=params, weights_bytes=weights, activations_bytes=activation_bytes(c), data_bytes=data_bytes(c),
        process_bytes=RANK_PROCESS_BYTES + c.num_workers * WORKER_PROCESS_BYTES, world_size=c.world_size,
        on_gpu=c.uses_cuda,
    )


def parameter_count(c: RunConfig) -> int:
    w, d = c.width, c.depth
    model = c.recipe
    if model == "linear":
        return REGRESSION_FEATURES + 1
    if model == "mlp":
        regression = c.resolved_dataset == "regression"
        inputs, outputs = (REGRESSION_FEATURES, 1) if regression else (DIGITS_FEATURES, DIGITS_CLASSES)
        return inputs * w + w + (d - 1) * (w * w + w) + w * outputs + outputs
    if model == "cnn":
        return (9 * w + w) + (d - 1) * (9 * w * w + w) + 16 * w * DIGITS_CLASSES + DIGITS_CLASSES
    seq = c.seq_len
    block = 4 * w * w + 4 * w + 2 * (w * 4 * w) + 4 * w + w + 4 * w  # attention, feed-forward, two norms
    return VOCAB * w + seq * w + d * block + 2 * w + w * VOCAB + VOCAB


def activation_bytes(c: RunConfig) -> int:
    """One micro-batch's activations kept for backward (half as many bytes under autocast)."""
    b, w, d = c.batch_size, c.width, c.depth
    if c.recipe == "transformer":
        # Korthikanti et al. (2022), per layer: s·b·h·(34 + 5·a·s/h) bytes in 16-bit, attention
        # scores included; doubled for fp32. Plus the embeddings and the logits over the vocabulary.
        s, a = c.seq_len, c.num_heads
        half_precision = s * b * w * (34 + 5 * a * s / w) * d + 2 * s * b * (w + VOCAB)
        total = 2 * half_precision
    else:
        if c.recipe == "linear":
            values = b * (REGRESSION_FEATURES + 1)
        elif c.recipe == "mlp":
            values = b * (DIGITS_FEATURES + 2 * w * d + DIGITS_CLASSES)
        else:
            values = b * (64 + 2 * w * 64 * d + 16 * w + DIGITS_CLASSES)
        total = 2 * values * FP32  # each kept output, and its gradient while backward passes it
    return int(total / 2 if c.amp != "off" else total)


def data_bytes(c: RunConfig) -> int:
    dataset = c.resolved_dataset
    if dataset == "regression":
        return c.num_samples * (REGRESSION_FEATURES + 1) * FP32
    if dataset == "digits":
        return DIGITS * (DIGITS_FEATURES * FP32 + INT64)
    return 2 * TEXT_BYTES * INT64  # inputs and targets as int64 token windows


def fits(e: MemoryEstimate, free_bytes: int, gpu_bytes: float | None) -> str | None:
    """Why the run will not fit (one line, with the estimate), or None when it will."""
    if e.on_gpu and gpu_bytes is not None and e.device_bytes > FIT_FRACTION * gpu_bytes:
        return (f"needs {_gib(e.device_bytes)} per GPU and the smallest chosen GPU has {_gib(int(gpu_bytes))}: "
                f"{e.text()}")
    if free_bytes and e.host_bytes > FIT_FRACTION * free_bytes:
        return f"needs {_gib(e.host_bytes)} and this machine has {_gib(free_bytes)} free: {e.text()}"
    return None
