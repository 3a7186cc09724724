"""The project's data helpers (utils.py, a name many projects use: it is this project's, not anything of
ddpdash's or the standard library's)."""

from pathlib import Path

import torch
from PIL import Image
from torch.utils.data import Dataset

SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp"}


class FolderOfClasses(Dataset):
    """One sub-folder per class, as torchvision's ImageFolder reads them."""

    def __init__(self, root: Path, size: int = 32) -> None:
        self.classes = sorted(d.name for d in Path(root).iterdir() if d.is_dir())
        self.items = [(p, c) for c, name in enumerate(self.classes)
                      for p in sorted((Path(root) / name).iterdir()) if p.suffix.lower() in SUFFIXES]
        self.size = size

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        path, label = self.items[i]
        with Image.open(path) as image:
            rgb = image.convert("RGB").resize((self.size, self.size))
        x = torch.frombuffer(bytearray(rgb.tobytes()), dtype=torch.uint8).view(self.size, self.size, 3)
        return x.permute(2, 0, 1).float() / 255.0, label
