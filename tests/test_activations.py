"""Activations on the ledger, measured: what autograd saves for backward in a training step, by unit.

A stack of Linear + ReLU blocks (each block a unit) whose saved tensors are known by hand, in fp32 with a
local batch of B rows of width w:

    root       the input x (B x 7, saved by the first Linear), the head's output and the target (B x 1 each,
               saved by mse_loss)
    blocks.0   its Linear's input (the first Linear's output, B x w) and its ReLU's output (B x w)
    blocks.k   its ReLU's output only: its Linear's input is blocks.k-1's ReLU output, counted there once

Parameters (the units' gathered views) are model state and never counted. The budget's figure must be exactly
that, at stages 2 and 3 and with every block checkpointed, measured on the run and predicted by tracing its first
batch under fake tensors.
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


def expected_by_unit(checkpointed: bool = False) -> dict[str, int]:
    """Bytes by unit (the module docstring); with every block checkpointed, a block keeps only its input and the
    head's input (the last block's output) is saved by the head, in the root unit."""
    rows = BATCH * FLOAT
    if checkpointed:
        return {"root": rows * (7 + WIDTH + 1 + 1), **{f"blocks.{k}": rows * WIDTH for k in range(DEPTH)}}
    units = {"root": rows * (7 + 1 + 1), "blocks.0": rows * 2 * WIDTH}
    units.update({f"blocks.{k}": rows * WIDTH for k in range(1, DEPTH)})
    return units


def measured_by_stage(stages: list[int], directory: str) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(4 * BATCH, 7, generator=g), torch.randn(4 * BATCH, 1, generator=g))
    out = {}
    for stage, checkpointed in [*((s, False) for s in stages), (3, True)]:
        budget = ShardLabBudget(step_peak=True)
        strategy = ShardLabStrategy(
            stage=stage, unit_classes=[Block], sanity_every_n_steps=0, activation_checkpointing=checkpointed
        )
        root = f"{directory}/stage{stage}" + ("-checkpointed" if checkpointed else "")
        trainer = L.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=strategy,
            max_steps=2,
            callbacks=[budget],
            default_root_dir=root,
            enable_checkpointing=False,
            **QUIET,
        )
        trainer.fit(Stack(), DataLoader(data, batch_size=BATCH))
        report = budget.reports[trainer.global_rank]
        out[f"{stage}{'-checkpointed' if checkpointed else ''}"] = {
            **report["activations_measured"],
            "step_peak": report["step_peak_measured"],
            "predicted": report["activations_predicted"],
        }
    return out


def test_saved_activations_by_unit_are_what_autograd_keeps(tmp_path: Path) -> None:
    kwargs = {"stages": [2, 3], "directory": str(tmp_path)}
    ranks = run_ranks("tests.test_activations:measured_by_stage", 2, kwargs, timeout=120)
    for rank, by_stage in enumerate(ranks):
        assert sorted(by_stage) == ["2", "3", "3-checkpointed"], by_stage
        for stage, measured in by_stage.items():
            checkpointed = stage.endswith("checkpointed")
            expected = expected_by_unit(checkpointed)
            assert measured["by_unit"] == expected, (rank, stage, measured)
            assert measured["total"] == sum(expected.values())
            # the budget's prediction: the first batch traced under fake tensors, nothing run for real
            assert measured["predicted"]["by_unit"] == expected, (rank, stage, measured["predicted"])
            assert measured["checkpointed"] == ([f"blocks.{k}" for k in range(DEPTH)] if checkpointed else [])
            # the first step, profiled: each phase's peak of live tensors; at the end of forward every saved
            # activation is alive beside the parameters
            peaks = measured["step_peak"]
            assert list(peaks) == ["forward", "backward", "optimizer"], peaks
            assert peaks["forward"]["peak"] >= measured["total"], peaks
            assert peaks["forward"]["by_category"].get("activation", 0) > 0, peaks
    for stage in (2, 3):  # rank 0 drew every rank's stacked bar beside the JSON
        assert (tmp_path / f"stage{stage}" / "shardlab_budget.png").stat().st_size > 0
