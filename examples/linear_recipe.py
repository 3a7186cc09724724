"""The DDP guide's linear-regression example (examples/seed_script.py), written as a recipe: the model, the
data and the loss — ddpdash's trainer does the rest (DDP, DistributedSampler, the lr scaling rule, AMP,
accumulation, checkpoints, sync checks, restarts), with every setting of the form.

    ddpdash launch --recipe examples/linear_recipe.py:build --num-procs 2 --max-steps 200
    ddpdash launch --recipe examples/linear_recipe.py:build --param samples=8192 --param noise=0.5 --num-procs 2
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import ddpdash


def regression_data(samples: int, noise: float, seed: int) -> TensorDataset:
    """y = x·w + 0.5 + noise, with the same w for every split (its generator seed is fixed)."""
    w = torch.randn(10, 1, generator=torch.Generator().manual_seed(1234))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 10, generator=g)
    return TensorDataset(x, x @ w + 0.5 + noise * torch.randn(samples, 1, generator=g))


def build(params: dict) -> ddpdash.Recipe:
    samples, noise = int(params.get("samples", 2048)), float(params.get("noise", 0.1))
    return ddpdash.Recipe(
        model=nn.Linear(10, 1),
        train=regression_data(samples, noise, seed=0),
        val=regression_data(samples // 4, noise, seed=1),
        loss=lambda out, batch: F.mse_loss(out, batch[1]),
        metrics=lambda out, batch: {"mae": (out - batch[1]).abs().mean()},
    )
