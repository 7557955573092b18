"""Small classifiers for `task.kind: classify` on images [B, channels, side, side].

    model:
      kind: custom
      target: "user_models.cnn:build"
      args: {width: 16, n_classes: 10}

`build` returns an `nn.Sequential`, which is its own list of pipeline layers, so
every layout trains it, pipelines included. `Flat` is the same task written as a
module with its own `forward()` and no `pipeline_layers()`: the data-parallel
layouts and the parameter server train it; a pipeline refuses it in one line.
"""

from __future__ import annotations

import torch
from torch import nn


def build(
    width: int = 16, *, n_classes: int = 10, channels: int = 1, side: int = 8
) -> nn.Sequential:
    """A CNN: one 3x3 convolution of `width` channels (padding keeps the image size),
    ReLU, then a linear head on every pixel's features -> logits [B, n_classes].

    No pooling: the clusters data's class templates differ pixel by pixel, so the
    head keeps where each feature is.
    """
    if width < 1 or n_classes < 2:
        raise ValueError(f"width={width}, n_classes={n_classes}: need width >= 1, n_classes >= 2")
    return nn.Sequential(
        nn.Conv2d(channels, width, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(width * side * side, n_classes),
    )


class Flat(nn.Module):
    """An MLP on the flattened input: [B, *shape] -> logits [B, n_classes]."""

    def __init__(self, in_features: int = 64, *, hidden: int = 64, n_classes: int = 10) -> None:
        super().__init__()
        self.hidden = nn.Linear(in_features, hidden)
        self.out = nn.Linear(hidden, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.hidden(x.flatten(1))))
