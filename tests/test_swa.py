"""Lightning's ``StochasticWeightAveraging`` under the shardlab strategy, against the same callback under ``ddp``.

One 2-rank job: a CNN with batch norm (SGD with momentum, an epoch StepLR that SWA swaps for SWALR), 4 epochs,
averaging from the second with 2 epochs of cosine annealing (SWALR takes the learning rate from 0.1 to
``swa_lrs``), then the batch-norm pass (one more epoch, forward only) and the average swapped in at the end. Under
DDP and at stages 1, 2 and 3 (the callback turned into ``ShardLabSWA`` in place): every step's loss, the learning
rates SWALR set, and the final weights and batch-norm statistics equal DDP's. At stages 2 and 3 a run resumed from
the checkpoint of epoch 2 (mid-averaging: the average, ``n_averaged`` and SWALR's state inside) ends on the
uninterrupted run's weights. ShardLabEMA and SWA together are refused on every rank.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, StochasticWeightAveraging
from torch.testing import assert_close

from lightning_shardlab import ShardLabStrategy, ShardLabSWA
from tests.helpers.launch import run_ranks
from tests.helpers.reference import FP32
from tests.models import OrderedData, TinyCNN, image_dataset

EPOCHS, STEPS_PER_EPOCH, BATCH = 4, 2, 3


class LearningRates(L.Callback):
    def __init__(self) -> None:
        self.lrs: list[float] = []

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])


def _fit(strategy: Any, tmp: Path | None = None, ckpt: str | None = None) -> dict[str, Any]:
    torch.manual_seed(0)
    model = TinyCNN()
    swa = StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=2, annealing_epochs=2)
    lrs = LearningRates()
    saving = [ModelCheckpoint(dirpath=tmp, every_n_epochs=1, save_top_k=-1)] if tmp is not None else []
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_epochs=EPOCHS, callbacks=[swa, lrs, *saving],
        logger=False, enable_checkpointing=bool(saving), enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, limit_val_batches=0,
    )  # fmt: skip
    data = OrderedData(image_dataset(2 * BATCH * STEPS_PER_EPOCH), BATCH)
    trainer.fit(model, data, ckpt_path=ckpt)
    sharded = isinstance(trainer.strategy, ShardLabStrategy)
    state = trainer.strategy.full_state_dict() if sharded else model.state_dict()
    return {
        "losses": model.losses,
        "lrs": lrs.lrs,
        "state": state,
        "class": type(swa).__name__,
        "epoch": trainer.current_epoch,
    }


def _same(got: dict[str, Any], want: dict[str, Any], where: str, rank: int) -> None:
    if rank == 0:
        assert list(got["state"]) == list(want["state"]), where
        for key, value in want["state"].items():
            assert_close(got["state"][key], value, **FP32, msg=lambda m, k=key: f"{k}: {where}\n{m}")


def swa_runs(stages: list[int], resumed: list[int], tmp: str) -> dict[str, Any]:
    rank = int(os.environ["RANK"])
    ddp = _fit("ddp")
    report: dict[str, Any] = {"ddp": {k: ddp[k] for k in ("lrs", "class", "epoch")}}
    for stage in stages:
        ours = _fit(ShardLabStrategy(stage=stage), Path(tmp) / str(stage))
        where = f"stage {stage}, rank {rank}"
        assert len(ours["losses"]) == len(ddp["losses"]), where  # the batch-norm pass has no backward, no loss kept
        assert_close(torch.stack(ours["losses"]), torch.stack(ddp["losses"]), **FP32, msg=lambda m: f"{where}\n{m}")
        _same(ours, ddp, where, rank)
        report[stage] = {k: ours[k] for k in ("lrs", "class", "epoch")}
        if stage in resumed:
            saved = sorted((Path(tmp) / str(stage)).glob("epoch=2-*.ckpt"))
            assert len(saved) == 1, saved
            again = _fit(ShardLabStrategy(stage=stage), ckpt=str(saved[0]))
            _same(again, ours, f"resumed from {saved[0].name}, {where}", rank)
            report[stage]["resumed_lrs"] = again["lrs"]
    report["with_ema"] = refused_with_ema()
    return report


def test_stochastic_weight_averaging_equals_ddp_at_every_stage_and_resumes(tmp_path: Path) -> None:
    kwargs = {"stages": [1, 2, 3], "resumed": [2, 3], "tmp": str(tmp_path)}
    for report in run_ranks("tests.test_swa:swa_runs", 2, kwargs, timeout=300):
        ddp = report["ddp"]
        assert ddp["class"] == "StochasticWeightAveraging" and ddp["lrs"][0] == 0.1 and ddp["lrs"][-1] == 0.05, ddp
        for stage in (1, 2, 3):
            ours = report[stage]
            assert ours["class"] == ShardLabSWA.__name__, ours  # the user's object, turned into the sharded twin
            assert ours["lrs"] == ddp["lrs"] and ours["epoch"] == ddp["epoch"], (stage, ours, ddp)
            if stage in (2, 3):
                assert ours["resumed_lrs"] == ddp["lrs"][-len(ours["resumed_lrs"]) :], ours
        # two averages of one model (ShardLabEMA and SWA) are refused on every rank, in the same launch
        assert "['ShardLabEMA', 'ShardLabSWA'] each keep an average" in report["with_ema"], report["with_ema"]


def refused_with_ema() -> str:
    from lightning_shardlab import ShardLabEMA

    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="shardlab", max_epochs=1, logger=False, enable_checkpointing=False,
        callbacks=[ShardLabEMA(), StochasticWeightAveraging(swa_lrs=0.1)], enable_progress_bar=False,
    )  # fmt: skip
    try:
        trainer.fit(TinyCNN(), OrderedData(image_dataset(8), 2))
    except ValueError as err:
        return str(err)
    return "not refused"
