"""Activations on the ledger, measured: what autograd saves for backward in a training step, by unit.

A stack of Linear + ReLU blocks (each block a unit) whose saved tensors are known by hand, in fp32 with a
local batch of B rows of width w:

    root       the input x (B x 7, saved by the first Linear), the head's output and the target (B x 1 each,
               saved by mse_loss)
    blocks.0   its Linear's input (the first Linear's output, B x w) and its ReLU's output (B x w)
    blocks.k   its ReLU's output only: its Linear's input is blocks.k-1's ReLU output, counted there once

Parameters (the units' gathered views) are model state and never counted. The budget's figure must be exactly
that, at stages 2 and 3.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_shardlab import ShardLabBudget, ShardLabStrategy
from tests.helpers.launch import run_ranks
from tests.test_checkpoint import QUIET

WIDTH, DEPTH, BATCH, FLOAT = 16, 3, 5, 4


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(self.linear(x))


class Stack(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(7, WIDTH)
        self.blocks = nn.ModuleList(Block(WIDTH) for _ in range(DEPTH))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: Tensor) -> Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def expected_by_unit() -> dict[str, int]:
    rows = BATCH * FLOAT
    units = {"root": rows * (7 + 1 + 1), "blocks.0": rows * 2 * WIDTH}
    units.update({f"blocks.{k}": rows * WIDTH for k in range(1, DEPTH)})
    return units


def measured_by_stage(stages: list[int], directory: str) -> dict[int, Any]:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(4 * BATCH, 7, generator=g), torch.randn(4 * BATCH, 1, generator=g))
    out = {}
    for stage in stages:
        budget = ShardLabBudget()
        strategy = ShardLabStrategy(stage=stage, unit_classes=[Block], sanity_every_n_steps=0)
        root = f"{directory}/stage{stage}"
        trainer = L.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=strategy,
            max_steps=2,
            callbacks=[budget],
            default_root_dir=root,
            **QUIET,
        )
        trainer.fit(Stack(), DataLoader(data, batch_size=BATCH))
        out[stage] = budget.reports[trainer.global_rank]["activations_measured"] if budget.reports else None
    return out


def test_saved_activations_by_unit_are_what_autograd_keeps(tmp_path: Path) -> None:
    kwargs = {"stages": [2, 3], "directory": str(tmp_path)}
    ranks = run_ranks("tests.test_activations:measured_by_stage", 2, kwargs, timeout=120)
    for rank, by_stage in enumerate(ranks):
        for stage, measured in by_stage.items():
            assert measured["by_unit"] == expected_by_unit(), (rank, stage, measured)
            assert measured["total"] == sum(expected_by_unit().values())
            assert measured["checkpointed"] == []
    for stage in (2, 3):  # rank 0 drew every rank's stacked bar beside the JSON
        assert (tmp_path / f"stage{stage}" / "shardlab_budget.png").stat().st_size > 0
