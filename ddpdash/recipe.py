"""`ddpdash.Recipe`: what a user's `build(params)` returns so ddpdash trains their model on their data with
every setting of the form (world size, backend, batch, AMP, lr scaling, accumulation, DDP knobs,
checkpoints, sync checks, restarts).

    def build(params: dict) -> ddpdash.Recipe:
        return ddpdash.Recipe(
            model=MyNet(params["width"]),
            train=train_set,                                   # any map-style torch Dataset
            val=val_set,                                       # optional
            loss=lambda out, batch: F.cross_entropy(out, batch[1]),
        )

Plain torch objects, no base class. A batch is whatever the DataLoader yields (`collate_fn`, default
torch's); ddpdash moves its tensors to the rank's device, calls `forward(model, batch)` (default:
`model(batch[0])`) and `loss(out, batch)`, which must return a scalar tensor. This module imports no
torch: `import ddpdash` stays light.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(kw_only=True)
class Recipe:
    model: Any  # torch.nn.Module: the replica DDP wraps, checkpoints and checks for sync
    train: Any  # torch.utils.data.Dataset (map-style: __len__ and __getitem__); DistributedSampler shards it
    loss: Callable[[Any, Any], Any]  # (out, batch) -> scalar tensor
    val: Any = None  # optional Dataset: evaluated on rank 0 after every epoch (val_loss, val_<metric>)
    # (out, batch) -> {name: float or 0-d tensor}: logged per rank like the loss (mean over the log window)
    metrics: Callable[[Any, Any], Mapping[str, Any]] | None = None
    forward: Callable[[Any, Any], Any] | None = None  # (model, batch) -> out, when a batch is not (inputs, ...)
    collate_fn: Callable[[list[Any]], Any] | None = None
    tokens_per_sample: int = 0  # > 0: tokens/s is logged beside samples/s
    about: str = ""  # one line the check shows beside its findings (what was inferred from the data, …)
