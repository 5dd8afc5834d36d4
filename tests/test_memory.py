"""Memory: between steps each rank holds 16P/N bytes of model state for fp32 AdamW at stage 3.

4P/N parameters + 4P/N gradients + 8P/N Adam moments, counted from the live tensor storages the rank
holds (every CPU tensor reachable from Python, views once), not by asking the package.
"""

from __future__ import annotations

import os

import lightning as L
import pytest
import torch

from lightning_shardlab import ShardLabStrategy
from tests.counting import live_cpu_bytes
from tests.launch import run_ranks
from tests.models import TinyGPT, loader, token_dataset


class MeasureBetweenSteps(L.Callback):
    def __init__(self, exclude: list[torch.Tensor]) -> None:
        self.exclude = exclude
        self.bytes: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        del outputs, batch  # the step's own tensors are not model state
        self.bytes.append(live_cpu_bytes(self.exclude))


def measure(world_size: int, stage: int = 3) -> dict:
    torch.manual_seed(0)
    model = TinyGPT(vocab=61, block_size=8, n_layer=3, n_embd=48, n_head=4)
    params = sum(p.numel() for p in model.parameters())  # tied weights once
    data = token_dataset(8 * world_size, vocab=61, block_size=8)
    callback = MeasureBetweenSteps(exclude=list(data.tensors))
    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=ShardLabStrategy(stage=stage), max_steps=3,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False, callbacks=[callback])
    trainer.fit(model, loader(data, 2, world_size, int(os.environ["RANK"])))
    padding = sum(fp.layout.padding for fp in trainer.strategy.sharded.flat_params)
    return {"params": params, "padding": padding, "bytes": callback.bytes}


@pytest.mark.parametrize("world_size", [2, 4])
def test_stage3_holds_16P_over_N_bytes_between_steps(world_size: int) -> None:
    for report in run_ranks("tests.test_memory:measure", world_size, {"world_size": world_size}, timeout=180):
        p, n = report["params"], world_size
        expected = 4 * p / n + 4 * p / n + 8 * p / n  # parameters + gradients + Adam moments (ZeRO-3)
        slack = 0.02 * expected + 8 * report["padding"]  # 2%, plus the padding in the param and grad shards
        for measured in report["bytes"][1:]:  # from the second step on, every state exists
            assert abs(measured - expected) <= slack, (measured, expected, slack)
