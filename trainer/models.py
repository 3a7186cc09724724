"""Models, sized by the config so a GPU user can make the work heavy."""

from __future__ import annotations

import torch
from torch import nn

from .config import RunConfig
from .data import Data


class MLP(nn.Module):
    def __init__(self, in_features: int, out_features: int, width: int, depth: int) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        size = in_features
        for _ in range(depth):
            layers += [nn.Linear(size, width), nn.ReLU()]
            size = width
        layers.append(nn.Linear(size, out_features))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class SmallCNN(nn.Module):
    def __init__(self, channels: int, depth: int, num_classes: int, in_channels: int = 1, halve: bool = False) -> None:
        """`halve`: pool to half the size after every layer (images larger than the digits' 8 × 8)."""
        super().__init__()
        layers: list[nn.Module] = []
        c_in = in_channels
        for _ in range(depth):
            layers += [nn.Conv2d(c_in, channels, 3, padding=1), nn.ReLU(), *([nn.MaxPool2d(2)] if halve else [])]
            c_in = channels
        layers += [nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(channels * 16, num_classes)]
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class TinyLM(nn.Module):
    """A small causal transformer language model over bytes."""

    def __init__(self, vocab: int, width: int, depth: int, heads: int, seq_len: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.zeros(1, seq_len, width))
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq_len), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        h = self.embed(x) + self.pos[:, :n]
        h = self.blocks(h, mask=self.mask[:n, :n], is_causal=True)
        return self.head(self.norm(h))


def build(cfg: RunConfig, data: Data) -> nn.Module:
    if cfg.recipe == "linear":
        return nn.Linear(10, 1)
    if cfg.recipe == "mlp":
        in_features = 1
        for d in data.input_shape:
            in_features *= d
        return MLP(in_features, data.num_classes or 1, cfg.width, cfg.depth)
    if cfg.recipe == "cnn":
        return SmallCNN(cfg.width, cfg.depth, data.num_classes)
    return TinyLM(256, cfg.width, cfg.depth, cfg.num_heads, cfg.seq_len)
