"""From a run's config to the `ddpdash.Recipe` its ranks train: the demo recipes, the two for a user's data
(a table, an image folder), and the user's own `build(params)`. One loop trains them all (train.py).

Runs in the ranks and in the check's child process (check.py), never in the dashboard's or CLI's process:
a user's recipe is user code.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset, Subset

from ddpdash.db.vocab import Metric
from ddpdash.recipe import Recipe

from .config import DATA_RECIPES, DEMO_RECIPES, RunConfig, script_workdir
from .data import Samples, keep_batch, load
from .models import MLP, SmallCNN, build

IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp", ".gif"})
TABLE_SUFFIXES = {".csv": "CSV", ".tsv": "CSV", ".parquet": "Parquet", ".pq": "Parquet"}
MAX_CLASSES_OF_WHOLE_NUMBERS = 20  # a whole-number target with at most this many values is taken for classes


class RecipeError(ValueError):
    """The recipe or its data cannot be trained; `field` is the setting to fix."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(message)


def load_recipe(cfg: RunConfig) -> Recipe:
    if cfg.recipe in DEMO_RECIPES:
        return demo_recipe(cfg)
    if cfg.recipe == "table":
        return table_recipe(cfg)
    if cfg.recipe == "images":
        return images_recipe(cfg)
    return own_recipe(cfg)


# ---- losses and metrics shared by the built-in recipes ---------------------------------------------
def cross_entropy(out: torch.Tensor, batch: Any) -> torch.Tensor:
    return nn.functional.cross_entropy(out.float(), batch[1])


def mse(out: torch.Tensor, batch: Any) -> torch.Tensor:
    return nn.functional.mse_loss(out.float(), batch[1])


def next_token_loss(out: torch.Tensor, batch: Any) -> torch.Tensor:
    return nn.functional.cross_entropy(out.float().reshape(-1, out.shape[-1]), batch[1].reshape(-1))


def accuracy(out: torch.Tensor, batch: Any) -> dict[str, torch.Tensor]:
    # A 0-d tensor, not a float: reading it would wait for the device every step (train.py reads at log steps).
    return {Metric.ACC: (out.argmax(-1) == batch[1]).float().mean()}


# ---- the demos ----------------------------------------------------------------------------------
def demo_recipe(cfg: RunConfig) -> Recipe:
    data = load(cfg)
    loss = {"regression": mse, "lm": next_token_loss}.get(data.task, cross_entropy)
    return Recipe(model=build(cfg, data), train=data.train, val=data.val, loss=loss, collate_fn=keep_batch,
                  metrics=accuracy if data.task == "classification" else None,
                  tokens_per_sample=cfg.seq_len if data.task == "lm" else 0)


def split(n: int, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Train and validation indices: a permutation by the run's seed, so every rank splits alike."""
    order = np.random.default_rng(seed).permutation(n)
    cut = n - round(n * val_fraction)
    return order[:cut], order[cut:]


# ---- a table ------------------------------------------------------------------------------------
def read_table(path: Path) -> Any:
    import pandas as pd

    kind = TABLE_SUFFIXES.get(path.suffix.lower())
    if kind is None:
        raise RecipeError("data", f"{path.name} is not a table ddpdash reads: name a .csv, .tsv or .parquet file")
    if not path.is_file():
        raise RecipeError("data", f"{path} is not a file")
    try:
        if kind == "Parquet":
            return pd.read_parquet(path)
        return pd.read_csv(path, sep="\t" if path.suffix.lower() == ".tsv" else ",")
    except Exception as exc:  # pandas raises many kinds; each is "this file is not a table"
        raise RecipeError("data", f"{path.name} cannot be read as {kind}: {exc}") from exc


def table_task(cfg: RunConfig, target: Any) -> str:
    from pandas.api import types

    numeric = types.is_numeric_dtype(target) and not types.is_bool_dtype(target)
    if cfg.task == "regression" and not numeric:
        raise RecipeError("task", f"regression needs a numeric target; {cfg.target!r} holds {target.dtype} values")
    if cfg.task != "auto":
        return cfg.task
    if not numeric:
        return "classification"
    whole = types.is_integer_dtype(target)
    return "classification" if whole and target.nunique() <= MAX_CLASSES_OF_WHOLE_NUMBERS else "regression"


def table_recipe(cfg: RunConfig) -> Recipe:
    from pandas.api import types

    path = Path(cfg.data).expanduser()
    frame = read_table(path)
    if cfg.target not in frame.columns:
        raise RecipeError("target", f"{cfg.target!r} is not a column of {path.name}; its columns: "
                                    f"{', '.join(map(str, frame.columns))}")
    features = frame.drop(columns=[cfg.target])
    if features.shape[1] == 0:
        raise RecipeError("data", f"{path.name} has no column besides the target {cfg.target!r} to learn from")
    text_columns = [f"{c!r} ({features[c].dtype})" for c in features.columns
                    if not types.is_numeric_dtype(features[c])]
    if text_columns:
        raise RecipeError("data", f"feature column {', '.join(text_columns)} of {path.name} is not numeric: "
                                  "encode it as numbers or drop it")
    gaps = [repr(c) for c in frame.columns if frame[c].isna().any()]
    if gaps:
        raise RecipeError("data", f"column {', '.join(gaps)} of {path.name} has missing values: fill or drop them")
    if len(frame) < 2:
        raise RecipeError("data", f"{path.name} has {len(frame)} row(s): too few to train and validate on")
    task = table_task(cfg, frame[cfg.target])
    tr, va = split(len(frame), cfg.val_fraction, cfg.seed)
    x = torch.tensor(features.to_numpy(dtype=np.float32))
    mean, std = x[tr].mean(0), x[tr].std(0, correction=0)  # the training split's: nothing of validation leaks
    x = (x - mean) / torch.where(std > 0, std, torch.ones_like(std))
    if task == "classification":
        classes = [str(v) for v in sorted(frame[cfg.target].unique())]  # 2 before 10 for numbers
        index = {c: i for i, c in enumerate(classes)}
        y = torch.tensor([index[v] for v in frame[cfg.target].astype(str)], dtype=torch.long)
        outputs, loss, metrics = len(classes), cross_entropy, accuracy
        about = f"classification of {cfg.target!r} into {len(classes)} classes ({_listed(classes)})"
    else:
        # Standardised like the features (loss in units of the target's spread): a raw price in the
        # thousands would make any sensible lr diverge.
        y = torch.tensor(frame[cfg.target].to_numpy(dtype=np.float32)).unsqueeze(1)
        y = (y - y[tr].mean()) / max(float(y[tr].std(correction=0)), 1e-12)
        outputs, loss, metrics = 1, mse, None
        about = f"regression of {cfg.target!r} (standardised: the loss is in units of its variance)"
    torch.manual_seed(cfg.seed)
    model = MLP(x.shape[1], outputs, cfg.width, cfg.depth)
    about += f" from {x.shape[1]} feature column(s), standardised by the training split"
    return Recipe(model=model, train=Samples(x[tr], y[tr]), val=Samples(x[va], y[va]) if len(va) else None,
                  loss=loss, metrics=metrics, collate_fn=keep_batch, about=about)


def _listed(names: list[str], most: int = 6) -> str:
    return ", ".join(names[:most]) + (f", … {len(names) - most} more" if len(names) > most else "")


# ---- an image folder ------------------------------------------------------------------------------
class ImageFolder(Dataset[tuple[torch.Tensor, int]]):
    """torchvision's ImageFolder layout and class order (one sub-folder per class, sorted by name), read
    with Pillow: torchvision's wheel does not load beside every torch build, and this is all it takes."""

    def __init__(self, root: Path, size: int) -> None:
        self.root, self.size = root, size
        self.classes = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
        self.samples = [(path, label) for label, name in enumerate(self.classes)
                        for path in sorted((root / name).rglob("*"))
                        if path.suffix.lower() in IMAGE_SUFFIXES and path.is_file()]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        from PIL import Image

        path, label = self.samples[i]
        with Image.open(path) as image:
            rgb = image.convert("RGB").resize((self.size, self.size))
        pixels = torch.frombuffer(bytearray(rgb.tobytes()), dtype=torch.uint8)
        return pixels.view(self.size, self.size, 3).permute(2, 0, 1).float().div_(255.0), label


def image_model(cfg: RunConfig, num_classes: int) -> nn.Module:
    if cfg.arch == "cnn":
        return SmallCNN(cfg.width, cfg.depth, num_classes, in_channels=3, halve=cfg.image_size >= 4 * 2**cfg.depth)
    try:
        import torchvision
    except Exception as exc:  # absent, or a wheel that does not load beside this torch
        raise RecipeError("arch", f"{cfg.arch} is a torchvision architecture and torchvision cannot be imported "
                                  f"here ({type(exc).__name__}: {exc}); install the torchvision that matches "
                                  "your torch, or use arch cnn") from exc
    if cfg.arch not in torchvision.models.list_models():
        raise RecipeError("arch", f"torchvision has no architecture {cfg.arch!r}")
    return torchvision.models.get_model(cfg.arch, weights=None, num_classes=num_classes)  # no download


def images_recipe(cfg: RunConfig) -> Recipe:
    root = Path(cfg.data).expanduser()
    if not root.is_dir():
        raise RecipeError("data", f"{root} is not a folder: the images recipe reads a folder with one sub-folder "
                                  "of images per class")
    folder = ImageFolder(root, cfg.image_size)
    if not folder.classes:
        raise RecipeError("data", f"{root} has no classes: put each class's images in a sub-folder of its own")
    if not folder.samples:
        raise RecipeError("data", f"{root} has class folders but no images ({', '.join(sorted(IMAGE_SUFFIXES))})")
    tr, va = split(len(folder), cfg.val_fraction, cfg.seed)
    torch.manual_seed(cfg.seed)
    model = image_model(cfg, len(folder.classes))
    about = (f"{len(folder.classes)} classes ({_listed(folder.classes)}), images resized to "
             f"{cfg.image_size} × {cfg.image_size}, model {cfg.arch}")
    return Recipe(model=model, train=Subset(folder, tr.tolist()), val=Subset(folder, va.tolist()) if len(va) else None,
                  loss=cross_entropy, metrics=accuracy, about=about)


# ---- the user's own -------------------------------------------------------------------------------
def project_folder(cfg: RunConfig) -> Path:
    """The folder a recipe's imports are resolved from: workdir, else the recipe file's folder, else here."""
    where = cfg.recipe.rpartition(":")[0]
    if cfg.workdir or not where.endswith(".py"):
        return script_workdir(cfg).resolve()
    return recipe_path(cfg).parent


def recipe_path(cfg: RunConfig) -> Path:
    """The file of a `path/to/file.py:build` recipe (relative to workdir when one is given)."""
    path = Path(cfg.recipe.rpartition(":")[0]).expanduser()
    if not path.is_absolute() and cfg.workdir:
        path = Path(cfg.workdir).expanduser() / path
    return path.resolve()


def import_recipe_module(cfg: RunConfig) -> Any:
    """The module `build` lives in, imported with the project folder first on sys.path (so the user's
    `utils.py` or `model.py` beside it is the one their code imports; ddpdash's own modules are already
    imported under `ddpdash.*`, so nothing of the user's can stand in for them)."""
    folder = str(project_folder(cfg))
    if folder not in sys.path:
        sys.path.insert(0, folder)
    where = cfg.recipe.rpartition(":")[0]
    if not where.endswith(".py"):
        try:
            return importlib.import_module(where)
        except ModuleNotFoundError as exc:
            if exc.name and where.startswith(exc.name):
                raise RecipeError("recipe", f"module {where} cannot be found from {folder}") from exc
            raise
    path = recipe_path(cfg)
    if not path.is_file():
        raise RecipeError("recipe", f"{path} is not a file")
    name = path.stem if path.stem not in sys.modules and path.stem.isidentifier() else f"ddpdash_recipe_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # so the user's own `import model` finds this one, not a second copy
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def own_recipe(cfg: RunConfig) -> Recipe:
    module = import_recipe_module(cfg)
    function = cfg.recipe.rpartition(":")[2]
    build_fn = getattr(module, function, None)
    if build_fn is None:
        found = sorted(n for n, v in vars(module).items()  # its own functions, not what it imported
                       if callable(v) and not n.startswith("_") and getattr(v, "__module__", None) == module.__name__)
        raise RecipeError("recipe", f"{Path(module.__file__ or '?').name} has no {function!r}"
                                    + (f"; it has {', '.join(found[:8])}" if found else ""))
    if not callable(build_fn):
        raise RecipeError("recipe", f"{function} in {module.__name__} is a {type(build_fn).__name__}, not a function")
    recipe = build_fn(dict(cfg.parameters))
    return checked(recipe, function)


def checked(recipe: Any, function: str) -> Recipe:
    """What build() returned, held to the interface before a single step is taken."""
    if not isinstance(recipe, Recipe):
        raise RecipeError("recipe", f"{function}() returned {type(recipe).__name__}, not a ddpdash.Recipe")
    if not isinstance(recipe.model, nn.Module):
        raise RecipeError("recipe", f"Recipe.model is a {type(recipe.model).__name__}, not a torch.nn.Module")
    for name in ("train", "val"):
        data = getattr(recipe, name)
        if data is None and name == "val":
            continue
        if not (hasattr(data, "__getitem__") and hasattr(data, "__len__")):
            raise RecipeError("recipe", f"Recipe.{name} is a {type(data).__name__}, not a map-style Dataset "
                                        "(__len__ and __getitem__): DistributedSampler shards by index")
    for name in ("loss", "metrics", "forward", "collate_fn"):
        value = getattr(recipe, name)
        if value is not None and not callable(value):
            raise RecipeError("recipe", f"Recipe.{name} is a {type(value).__name__}, not a function")
    if recipe.loss is None:
        raise RecipeError("recipe", "Recipe.loss is missing: (out, batch) -> a scalar tensor")
    return recipe


# ---- one batch's way through a recipe (the loop's, and the check's) ---------------------------------------
def to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, tuple | list):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, Mapping):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


def forward(recipe: Recipe, model: nn.Module, batch: Any) -> Any:
    if recipe.forward is not None:
        return recipe.forward(model, batch)
    return model(batch[0] if isinstance(batch, tuple | list) else batch)


def batch_length(batch: Any) -> int:
    """How many samples a batch holds: the first axis of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return len(batch) if batch.ndim else 1
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, tuple | list) else ()
    for value in values:
        n = batch_length(value)
        if n:
            return n
    return 0


def is_builtin(cfg: RunConfig) -> bool:
    return cfg.recipe in DEMO_RECIPES or cfg.recipe in DATA_RECIPES
