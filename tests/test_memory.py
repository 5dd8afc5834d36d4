"""Memory per stage, between steps, for fp32 AdamW (the ZeRO table).

stage 3: 4P/N parameters + 4P/N gradients + 8P/N Adam moments = 16P/N
stage 2: 4P full parameters + 4P/N gradient shard + 8P/N moments
stage 1: the same between steps (full gradients exist only during backward; they are reduced into the
         shard and freed, so stage 1 holds less than the table's 4P + 4P + 8P/N)
Counted from the live tensor storages the rank holds (every CPU tensor reachable from Python, views
once), not by asking the package.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_shardlab import ShardLabStrategy
from tests.helpers.counting import live_cpu_bytes
from tests.helpers.launch import run_ranks
from tests.models import OrderedData, TinyGPT, token_dataset


class MeasureBetweenSteps(L.Callback):
    """The bytes of the tensors alive between steps that were not alive before the run (``baseline``): a
    process that ran other tests first holds what they left (caches, datasets), and none of it is this run's."""

    def __init__(self, exclude: list[torch.Tensor], baseline: int) -> None:
        self.exclude, self.baseline = exclude, baseline
        self.bytes: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        del outputs, batch  # the step's own tensors are not model state
        self.bytes.append(live_cpu_bytes(self.exclude) - self.baseline)


def measure(world_size: int, stage: int = 3, precision: str = "32-true") -> dict:
    baseline = live_cpu_bytes()
    torch.manual_seed(0)
    model = TinyGPT(vocab=61, block_size=8, n_layer=3, n_embd=48, n_head=4)
    params = sum(p.numel() for p in model.parameters())  # tied weights once
    data = token_dataset(8 * world_size, vocab=61, block_size=8)
    callback = MeasureBetweenSteps(exclude=list(data.tensors), baseline=baseline)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=ShardLabStrategy(stage=stage),
        max_steps=3,
        precision=precision,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[callback],
    )
    trainer.fit(model, OrderedData(data, 2))
    padding = sum(fp.layout.padding for fp in trainer.strategy.sharded.flat_params)
    return {"params": params, "padding": padding, "bytes": callback.bytes}


def expected_bytes(p: int, n: int, stage: int, precision: str = "32-true") -> float:
    """The ZeRO table: weights w, gradients g, master m, Adam moments 8 bytes per parameter."""
    w, g, m = (2, 2, 4) if precision == "bf16-mixed" else (4, 4, 0)  # fp32: the weights are the master
    if stage == 3:
        return (w + g + m + 8) * p / n
    return w * p + (g + m + 8) * p / n


@pytest.mark.parametrize(("stage", "world_size"), [(3, 2), (3, 4), (2, 2), (2, 4), (1, 2), (1, 4)])
def test_model_state_per_rank_follows_the_zero_table(stage: int, world_size: int) -> None:
    reports = run_ranks(
        "tests.test_memory:measure", world_size, {"world_size": world_size, "stage": stage}, timeout=180
    )
    for report in reports:
        expected = expected_bytes(report["params"], world_size, stage)
        slack = 0.02 * expected + 8 * report["padding"]  # 2%, plus the padding in the param and grad buffers
        for measured in report["bytes"][1:]:  # from the second step on, every state exists
            assert abs(measured - expected) <= slack, (measured, expected, slack)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_mixed_holds_the_seeds_16_bytes_per_parameter_over_n(stage: int) -> None:
    """2 B bf16 compute copy + 2 B bf16 gradient + 4 B fp32 master + 8 B fp32 moments (stage 3: / N)."""
    reports = run_ranks(
        "tests.test_memory:measure", 2, {"world_size": 2, "stage": stage, "precision": "bf16-mixed"}, timeout=180
    )
    for report in reports:
        expected = expected_bytes(report["params"], 2, stage, "bf16-mixed")
        slack = 0.02 * expected + 16 * report["padding"]
        for measured in report["bytes"][1:]:
            assert abs(measured - expected) <= slack, (measured, expected, slack)
