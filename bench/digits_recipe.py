"""bench/plain_ddp.py's model and data as a user's recipe: the same MLP on the same digits TensorDataset
(torch's default collate), for the trainer-versus-plain benchmark's recipe case."""

import sys
from pathlib import Path

import torch.nn.functional as F
from torch import nn

import ddpdash

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plain_ddp import digits


def build(params: dict) -> ddpdash.Recipe:
    width = int(params.get("width", 64))
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                          nn.Linear(width, 10))
    return ddpdash.Recipe(model=model, train=digits(), loss=lambda out, batch: F.cross_entropy(out, batch[1]))
