"""Writes a small image folder in the usual layout — one sub-folder per class — of drawn shapes, to train
the images recipe or shapes_project/recipe.py on:

    python examples/shapes_project/make_shapes.py /tmp/shapes --per-class 40
    ddpdash launch --recipe images --data /tmp/shapes --num-procs 2 --max-steps 60
    ddpdash launch --recipe examples/shapes_project/recipe.py:build --param data=/tmp/shapes --num-procs 2
"""

import argparse
import random
from pathlib import Path

from PIL import Image, ImageDraw

SHAPES = ("circle", "square", "triangle")


def draw(shape: str, size: int, rng: random.Random) -> Image.Image:
    image = Image.new("RGB", (size, size), tuple(rng.randrange(0, 80) for _ in range(3)))
    pen = ImageDraw.Draw(image)
    r = rng.uniform(0.25, 0.4) * size
    cx, cy = rng.uniform(r, size - r), rng.uniform(r, size - r)
    colour = tuple(rng.randrange(150, 256) for _ in range(3))
    if shape == "circle":
        pen.ellipse((cx - r, cy - r, cx + r, cy + r), fill=colour)
    elif shape == "square":
        pen.rectangle((cx - r, cy - r, cx + r, cy + r), fill=colour)
    else:
        pen.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=colour)
    return image


def make_shapes(root: Path, per_class: int, size: int = 32, seed: int = 0) -> Path:
    rng = random.Random(seed)
    for shape in SHAPES:
        (root / shape).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            draw(shape, size, rng).save(root / shape / f"{i:04d}.png")
    return root


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("root", type=Path)
    p.add_argument("--per-class", type=int, default=40)
    p.add_argument("--size", type=int, default=32)
    args = p.parse_args()
    print(make_shapes(args.root, args.per_class, args.size))
