"""Containers iterated in different ways (the default unit policy reads the loops)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from tests.models.basic import Block


class Looped(nn.Module):
    """Three same-class blocks; each subclass runs them its own way (the policy reads the class's code)."""

    def __init__(self, container: str = "list") -> None:
        super().__init__()
        blocks = [Block(4) for _ in range(3)]
        self.layers = (
            nn.ModuleDict({str(i): b for i, b in enumerate(blocks)}) if container == "dict" else nn.ModuleList(blocks)
        )


class DictValues(Looped):
    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers.values():
            x = layer(x)
        return x


class Checkpointed(Looped):
    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            if self.training:
                x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
            else:
                x = layer(x)
        return x


class Reused(Looped):
    def forward(self, x: Tensor) -> Tensor:
        for _ in range(2):
            for layer in self.layers:
                x = layer(x)
        return x


class SkipsOne(Looped):
    def forward(self, x: Tensor) -> Tensor:
        for i, layer in enumerate(self.layers):
            if i == 1:
                continue
            x = layer(x)
        return x


class ByIndex(Looped):
    def forward(self, x: Tensor) -> Tensor:
        return self.layers[int(x.sum() > 0)](x)
