"""The project's model: a small CNN. (Named model.py like in many projects: the recipe imports it as
`from model import SmallCNN`, because ddpdash puts the project folder first on the ranks' import path.)"""

from torch import nn


class SmallCNN(nn.Module):
    def __init__(self, num_classes: int, channels: int = 16) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, channels, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(channels, 2 * channels, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4),
        )
        self.head = nn.Linear(2 * channels * 16, num_classes)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))
