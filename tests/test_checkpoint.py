"""Checkpoints through Lightning: exact resume, and the file is a plain Lightning checkpoint."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_shardlab import ShardLabStrategy
from tests.launch import run_ranks
from tests.models import OrderedData, TinyGPT, token_dataset

QUIET = dict(logger=False, enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
             num_sanity_val_steps=0, limit_val_batches=0)


def _fit(world_size: int, stage: int, epochs: int, seed: int, ckpt_path: str | None = None,
         save_to: str | None = None) -> dict:
    torch.manual_seed(seed)
    model = TinyGPT(optimizer="adamw")
    data = token_dataset(4 * 2 * world_size)
    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=ShardLabStrategy(stage=stage),
                        max_epochs=epochs, enable_checkpointing=False, **QUIET)
    trainer.fit(model, OrderedData(data, 2), ckpt_path=ckpt_path)
    if save_to:
        trainer.save_checkpoint(save_to)
    return trainer.strategy.full_state_dict()


def resume_exact(world_size: int, stage: int, tmp: str) -> dict:
    straight = _fit(world_size, stage, epochs=4, seed=0)
    path = str(Path(tmp) / "half.ckpt")
    _fit(world_size, stage, epochs=2, seed=0, save_to=path)
    resumed = _fit(world_size, stage, epochs=4, seed=123, ckpt_path=path)  # other init: the checkpoint must win
    if not straight:
        return {}
    return {"equal": {k: torch.equal(v, resumed[k]) for k, v in straight.items()}, "state": straight}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_resume_equals_uninterrupted_run_bit_for_bit(stage: int, tmp_path: Path) -> None:
    report = run_ranks("tests.test_checkpoint:resume_exact", 2,
                       {"world_size": 2, "stage": stage, "tmp": str(tmp_path)}, timeout=240)[0]
    assert report["equal"] and all(report["equal"].values()), report["equal"]
    # the file is a plain Lightning checkpoint: it loads without the strategy, strictly
    plain = TinyGPT.load_from_checkpoint(tmp_path / "half.ckpt", map_location="cpu")
    assert set(plain.state_dict()) == set(report["state"])
