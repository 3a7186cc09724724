"""A recipe for a small CNN on an image folder, in a project of its own (model.py, utils.py beside it):

    python examples/shapes_project/make_shapes.py /tmp/shapes
    ddpdash launch --recipe examples/shapes_project/recipe.py:build --param data=/tmp/shapes --num-procs 2
"""

import torch
import torch.nn.functional as F
from model import SmallCNN
from torch.utils.data import random_split
from utils import FolderOfClasses

import ddpdash


def build(params: dict) -> ddpdash.Recipe:
    images = FolderOfClasses(params["data"], size=int(params.get("size", 32)))
    # The same split on every rank: a generator seeded alike.
    train, val = random_split(images, [0.8, 0.2], generator=torch.Generator().manual_seed(0))
    return ddpdash.Recipe(
        model=SmallCNN(len(images.classes), channels=int(params.get("channels", 16))),
        train=train,
        val=val,
        loss=lambda out, batch: F.cross_entropy(out, batch[1]),
        metrics=lambda out, batch: {"acc": (out.argmax(1) == batch[1]).float().mean()},
    )
