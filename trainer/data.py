"""Real data that exists offline: synthetic regression (the seed's example), scikit-learn's bundled
digits images, and the Python documentation's topic texts (pydoc_data) as a byte-level corpus."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from .config import RunConfig

VAL_FRACTION = 0.2


@dataclass(frozen=True)
class Data:
    train: Samples
    val: Samples
    task: str  # "regression" | "classification" | "lm"
    num_classes: int = 0
    input_shape: tuple[int, ...] = ()


class Samples(Dataset[tuple[torch.Tensor, ...]]):
    """Tensors indexed along their first axis. The DataLoader fetches a whole batch at once through
    `__getitems__` (one gather per tensor instead of a tensor per sample and a stack), and each batch
    also carries its sample indices so the trainer can prove ranks see disjoint shards."""

    def __init__(self, *tensors: torch.Tensor) -> None:
        self.tensors = tensors

    def __len__(self) -> int:
        return len(self.tensors[0])

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        return tuple(t[i] for t in self.tensors)

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, ...]:
        idx = torch.as_tensor(indices)
        return (*(t[idx] for t in self.tensors), idx)


def keep_batch(batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """collate_fn for `Samples`: `__getitems__` already returns the batch."""
    return batch


def _split(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    order = np.random.default_rng(seed).permutation(n)
    cut = int(n * (1 - VAL_FRACTION))
    return order[:cut], order[cut:]


def regression(cfg: RunConfig) -> Data:
    # Fixed generator seed: the data set is the same on every rank and every run of this size.
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(cfg.num_samples, 10, generator=g)
    true_w = torch.randn(10, 1, generator=g)
    y = x @ true_w + 0.5 + 0.1 * torch.randn(cfg.num_samples, 1, generator=g)
    tr, va = _split(cfg.num_samples, 1234)
    return Data(Samples(x[tr], y[tr]), Samples(x[va], y[va]), "regression", input_shape=(10,))


def digits_path() -> Path:
    """scikit-learn's bundled copy of the UCI digits, found without importing scikit-learn (≈2 s)."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the digits data set ships with scikit-learn: pip install scikit-learn")
    return Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data" / "digits.csv.gz"


def digits(cfg: RunConfig) -> Data:
    table = np.loadtxt(digits_path(), delimiter=",", dtype=np.float32)  # 1797 rows: 64 pixels, then the label
    x = torch.from_numpy(table[:, :-1]).reshape(-1, 1, 8, 8) / 16.0
    y = torch.from_numpy(table[:, -1]).long()
    tr, va = _split(len(y), 1234)
    return Data(Samples(x[tr], y[tr]), Samples(x[va], y[va]), "classification", 10, (1, 8, 8))


def corpus_bytes() -> bytes:
    """About 0.8 MB of English prose: the Python docs' topics shipped with every CPython."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")


def token_windows(tokens: torch.Tensor, seq_len: int) -> Samples:
    """Non-overlapping windows of seq_len + 1 tokens: inputs and next-token targets."""
    count = (len(tokens) - 1) // seq_len
    starts = torch.arange(count).unsqueeze(1) * seq_len
    windows = tokens[starts + torch.arange(seq_len + 1)]
    return Samples(windows[:, :-1].contiguous(), windows[:, 1:].contiguous())


def text(cfg: RunConfig) -> Data:
    tokens = torch.frombuffer(bytearray(corpus_bytes()), dtype=torch.uint8).long()
    cut = int(len(tokens) * (1 - VAL_FRACTION))
    return Data(token_windows(tokens[:cut], cfg.seq_len), token_windows(tokens[cut:], cfg.seq_len), "lm", 256)


LOADERS = {"regression": regression, "digits": digits, "text": text}


def load(cfg: RunConfig) -> Data:
    return LOADERS[cfg.resolved_dataset](cfg)
