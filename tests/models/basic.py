"""Small models with odd shapes: units so small that some ranks hold only padding."""

from __future__ import annotations

import torch
from torch import Tensor, nn


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.l1 = nn.Linear(d, 17)
        self.l2 = nn.Linear(17, d)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.l2(torch.tanh(self.l1(x)))


class Gate(nn.Module):
    """One parameter of one element: at world size > 1 every rank but 0 holds only padding of it."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.scale


class OddNet(nn.Module):
    """Odd shapes (7, 15, 17), two block units, two one-element gate units, a size-1 layer at the root."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(7, 15)
        self.blocks = nn.ModuleList([Block(15) for _ in range(2)])
        self.gates = nn.ModuleList([Gate() for _ in range(2)])
        self.tiny = nn.Linear(15, 1)
        self.out = nn.Linear(1, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        for block, gate in zip(self.blocks, self.gates):
            h = gate(block(h))
        return self.out(self.tiny(h))


def regression_batches(steps: int, global_batch: int, seed: int = 1) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(global_batch, 7, generator=g), torch.randn(global_batch, 3, generator=g)) for _ in range(steps)
    ]
