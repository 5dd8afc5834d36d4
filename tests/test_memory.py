"""Memory per stage, between steps, for fp32 AdamW (the ZeRO table, DESIGN.md section 3).

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
from tests.counting import live_cpu_bytes
from tests.launch import run_ranks
from tests.models import OrderedData, TinyGPT, token_dataset


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
    trainer.fit(model, OrderedData(data, 2))
    padding = sum(fp.layout.padding for fp in trainer.strategy.sharded.flat_params)
    return {"params": params, "padding": padding, "bytes": callback.bytes}


def expected_bytes(p: int, n: int, stage: int) -> float:
    if stage == 3:
        return 4 * p / n + 4 * p / n + 8 * p / n
    return 4 * p + 4 * p / n + 8 * p / n


@pytest.mark.parametrize(("stage", "world_size"), [(3, 2), (3, 4), (2, 2), (2, 4), (1, 2), (1, 4)])
def test_model_state_per_rank_follows_the_zero_table(stage: int, world_size: int) -> None:
    reports = run_ranks("tests.test_memory:measure", world_size, {"world_size": world_size, "stage": stage}, timeout=180)
    for report in reports:
        expected = expected_bytes(report["params"], world_size, stage)
        slack = 0.02 * expected + 8 * report["padding"]  # 2%, plus the padding in the param and grad buffers
        for measured in report["bytes"][1:]:  # from the second step on, every state exists
            assert abs(measured - expected) <= slack, (measured, expected, slack)
