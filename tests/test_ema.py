"""ShardLabEMA against Lightning's EMAWeightAveraging under DDP, on the same batches.

1. Stages 1-3 on 2 ranks, a CNN with BatchNorm (buffers are averaged too), SGD with momentum and a
   StepLR: validation runs on the average (its losses match DDP's every time), and after fit the weights
   are the average (as Lightning's callback leaves them).
2. A sharded checkpoint saved at 2 ranks, stage 3, resumes at 4 ranks, stage 2 (a full checkpoint written
   there loads at 1 rank, stage 1): the average continues exactly as DDP's uninterrupted one, with an
   update every 2 steps; ``shardlab consolidate`` writes the average under ``ema_state_dict``.
Lightning's own weight averaging, and users' subclasses of it, run sharded too
(tests/test_weight_averaging_subclasses.py).
"""

from __future__ import annotations

import copy
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import EMAWeightAveraging
from torch.testing import assert_close

from lightning_shardlab import ShardLabEMA, ShardLabStrategy
from lightning_shardlab.checkpoint.consolidate import consolidated_checkpoint
from tests.helpers.launch import run_ranks
from tests.helpers.reference import FP32
from tests.models import OrderedData, RegressionNet, TinyCNN, image_dataset, regression_dataset


class ValidatedCNN(TinyCNN):
    def __init__(self) -> None:
        super().__init__()
        self.val_losses: list[torch.Tensor] = []

    def validation_step(self, batch, batch_idx: int) -> None:  # noqa: ANN001
        x, y = batch
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        self.val_losses.append(F.cross_entropy(self.head(h.mean((2, 3))), y).detach().clone())


def _trainer(strategy: object, callbacks: list, world_size: int, **kwargs: object) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=strategy,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=callbacks,
        **kwargs,
    )


def ema_parity(stages: list[int]) -> dict:
    torch.manual_seed(0)
    initial = ValidatedCNN()
    data = OrderedData(image_dataset(24), 2)
    loops = {
        "max_steps": 6,
        "val_check_interval": 2,
        "limit_val_batches": 1,
        "num_sanity_val_steps": 0,
        "enable_checkpointing": False,
    }
    reference = copy.deepcopy(initial)
    _trainer("ddp", [EMAWeightAveraging(decay=0.8)], 2, **loops).fit(reference, data)
    ref_state = reference.state_dict()
    report = {}
    for stage in stages:
        model = copy.deepcopy(initial)
        trainer = _trainer(ShardLabStrategy(stage=stage), [ShardLabEMA(decay=0.8)], 2, **loops)
        trainer.fit(model, data)
        where = f"stage {stage}, rank {trainer.global_rank}"
        assert_close(torch.stack(model.losses), torch.stack(reference.losses), **FP32, msg=lambda m: f"{where}\n{m}")
        assert len(model.val_losses) == len(reference.val_losses) == 3, where
        assert_close(
            torch.stack(model.val_losses),
            torch.stack(reference.val_losses),
            **FP32,
            msg=lambda m: f"validation on the average: {where}\n{m}",
        )
        averaged, current = trainer.strategy.full_state_dict(ema=True), trainer.strategy.full_state_dict()
        if trainer.global_rank == 0:
            assert list(averaged) == list(ref_state), where
            for key, value in ref_state.items():  # buffers included: BatchNorm statistics and their counts
                assert_close(averaged[key], value, **FP32, msg=lambda m, k=key: f"{k}: {where}\n{m}")
                assert torch.equal(current[key], averaged[key]), f"{key}: the average is applied at the end, {where}"
        report[stage] = len(model.val_losses)
    return report


def test_the_average_equals_ema_weight_averaging_under_ddp_at_every_stage() -> None:
    for report in run_ranks("tests.test_ema:ema_parity", 2, {"stages": [1, 2, 3]}, timeout=300):
        assert report == {1: 3, 2: 3, 3: 3}


# ---- resume at another world size and stage ----


class AverageAtEpochEnd(L.Callback):
    """The DDP reference's average after the first epoch (what the sharded run saves)."""

    def __init__(self, ema: EMAWeightAveraging) -> None:
        self.ema, self.first_epoch = ema, None

    def on_train_epoch_end(self, trainer, pl_module) -> None:  # noqa: ANN001
        if self.first_epoch is None:
            self.first_epoch = {k: v.clone() for k, v in self.ema._average_model.module.state_dict().items()}


def _ema() -> ShardLabEMA:
    return ShardLabEMA(decay=0.7, every_n_steps=2, apply_at_end=False)


def resume_first_epoch(ckpt: str) -> dict:
    """2 ranks: the DDP reference for two epochs, then shardlab stage 3 for one epoch, saved sharded."""
    torch.manual_seed(0)
    initial = RegressionNet("sgd")
    data = OrderedData(regression_dataset(16), 2)
    reference, ema = copy.deepcopy(initial), EMAWeightAveraging(decay=0.7, update_every_n_steps=2)
    probe = AverageAtEpochEnd(ema)
    _trainer("ddp", [ema, probe], 2, max_epochs=2, enable_checkpointing=False).fit(reference, data)
    model = copy.deepcopy(initial)
    trainer = _trainer(ShardLabStrategy(stage=3), [_ema()], 2, max_epochs=1, enable_checkpointing=False)
    trainer.fit(model, data)
    trainer.save_checkpoint(ckpt)
    averaged, current = trainer.strategy.full_state_dict(ema=True), trainer.strategy.full_state_dict()
    return {
        "reference_first_epoch": probe.first_epoch,
        "reference_final": reference.state_dict(),
        "averaged": averaged,
        "current": current,
    }


def resume_second_epoch(ckpt: str, stage: int, world_size: int, save: str | None) -> dict:
    """Resume the first run's checkpoint on ``world_size`` ranks at ``stage`` (same global batch)."""
    torch.manual_seed(1)  # another init: every value must come from the checkpoint
    model = RegressionNet("sgd")
    trainer = _trainer(
        ShardLabStrategy(stage=stage, state_dict_type="full"),
        [_ema()],
        world_size,
        max_epochs=2,
        enable_checkpointing=False,
    )
    trainer.fit(model, OrderedData(regression_dataset(16), 4 // world_size), ckpt_path=ckpt)
    if save:
        trainer.save_checkpoint(save)
    return {"averaged": trainer.strategy.full_state_dict(ema=True), "steps": trainer.global_step}


def test_the_average_resumes_at_another_world_size_and_stage(tmp_path: Path) -> None:
    sharded, full = tmp_path / "epoch1.ckpt", tmp_path / "epoch2.ckpt"
    first = run_ranks("tests.test_ema:resume_first_epoch", 2, {"ckpt": str(sharded)}, timeout=300)[0]
    for key, value in first["reference_first_epoch"].items():
        assert_close(first["averaged"][key], value, **FP32, msg=lambda m, k=key: f"{k} after epoch 1\n{m}")
    consolidated = consolidated_checkpoint(sharded)
    for key in first["current"]:  # the file holds both: the weights, and their average
        assert torch.equal(consolidated["state_dict"][key], first["current"][key]), key
        assert torch.equal(consolidated["ema_state_dict"][key], first["averaged"][key]), key
    second = run_ranks(
        "tests.test_ema:resume_second_epoch",
        4,
        {"ckpt": str(sharded), "stage": 2, "world_size": 4, "save": str(full)},
        timeout=300,
    )[0]
    assert second["steps"] == 8
    for key, value in first["reference_final"].items():
        assert_close(second["averaged"][key], value, **FP32, msg=lambda m, k=key: f"{k} after epoch 2\n{m}")
    third = run_ranks(
        "tests.test_ema:resume_second_epoch",
        1,
        {"ckpt": str(full), "stage": 1, "world_size": 1, "save": None},
        timeout=300,
    )[0]
    for key, value in second["averaged"].items():  # the full checkpoint's average, at 1 rank and stage 1
        assert torch.equal(third["averaged"][key], value), key
