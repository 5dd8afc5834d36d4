"""A model built in ``configure_model`` (on the meta device under shardlab)."""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn


class WideBlocks(L.LightningModule):
    """Only shapes until setup: ``configure_model`` builds it, each module initialises itself in
    ``reset_parameters`` (torch's layers do), so an eager build from the same seed gives the same values."""

    def __init__(self, width: int = 64, depth: int = 4, lr: float = 1e-3) -> None:
        super().__init__()
        self.width, self.depth, self.lr = width, depth, lr
        self.blocks: nn.ModuleList | None = None

    def configure_model(self) -> None:
        if self.blocks is not None:
            return
        self.inp = nn.Linear(7, self.width)
        self.blocks = nn.ModuleList([Block2(self.width) for _ in range(self.depth)])
        self.norm = nn.LayerNorm(self.width)
        self.out = nn.Linear(self.width, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(self.norm(h))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class Block2(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.l1 = nn.Linear(d, d)
        self.l2 = nn.Linear(d, d)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.l2(torch.relu(self.l1(x)))
