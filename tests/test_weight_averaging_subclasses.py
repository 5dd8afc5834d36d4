"""Users' subclasses of Lightning's weight averaging, under ``ddp`` and under shardlab at stages 1, 2 and 3.

One 2-rank job runs the same script under both strategies for each subclass:

- ``EveryOtherStep(WeightAveraging)``: ``should_update`` overridden (every 2nd step), torch's default rule (the
  running mean), buffers averaged: a CNN with batch norm, validated on the average every 2 steps.
- ``LateEMA(EMAWeightAveraging)``: ``should_update`` overridden (from step 2 on, and at epoch ends), same CNN.
- ``CountingSWA(StochasticWeightAveraging)``: its own ``on_train_epoch_end``, ``update_parameters`` and
  ``transfer_weights``, each calling ``super()`` and counting its calls.

Every loss, every validation loss (run on the average), the counts, and the weights and buffers the module holds
after fit (the average, applied) equal DDP's. Then, in the same job: a subclass whose own method reads the
averaged module (``self._average_model.module``) is refused on every rank naming that method, before fit; one
that hands the average to a helper that reads it is refused where the helper reads, naming the helper.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import EMAWeightAveraging, StochasticWeightAveraging, WeightAveraging
from torch.testing import assert_close

from lightning_shardlab import ShardLabStrategy
from tests.helpers.launch import run_ranks
from tests.helpers.reference import FP32
from tests.models import OrderedData, TinyCNN, image_dataset
from tests.test_ema import ValidatedCNN, _trainer


class EveryOtherStep(WeightAveraging):
    def should_update(self, step_idx: int | None = None, epoch_idx: int | None = None) -> bool:
        return step_idx is not None and step_idx % 2 == 1


class LateEMA(EMAWeightAveraging):
    def should_update(self, step_idx: int | None = None, epoch_idx: int | None = None) -> bool:
        return (step_idx is not None and step_idx >= 2) or epoch_idx is not None


class CountingSWA(StochasticWeightAveraging):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.calls: dict[str, list[int]] = {"epoch_end": [], "update": [], "transfer": []}

    def on_train_epoch_end(self, trainer: L.Trainer, *args: Any) -> None:
        super().on_train_epoch_end(trainer, *args)
        self.calls["epoch_end"].append(trainer.current_epoch)

    def update_parameters(self, average_model: Any, model: Any, n_averaged: Any, avg_fn: Any) -> None:
        super().update_parameters(average_model, model, n_averaged, avg_fn)
        self.calls["update"].append(int(n_averaged))

    def transfer_weights(self, src_pl_module: Any, dst_pl_module: Any) -> None:
        super().transfer_weights(src_pl_module, dst_pl_module)
        self.calls["transfer"].append(1)


class ReadsAverage(EMAWeightAveraging):
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_epoch_end(trainer, pl_module)
        self.norm = sum(p.norm() for p in self._average_model.module.parameters())


def average_norm(average: Any) -> torch.Tensor:
    return sum(p.norm() for p in average.module.parameters())


class HandsAverageOn(EMAWeightAveraging):
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.norm = average_norm(self._average_model)


def _averaging_fit(case: str, strategy: Any) -> dict[str, Any]:
    """One fit of ``case`` under ``strategy``: its losses, validation losses, callback record and final state."""
    torch.manual_seed(0)
    if case == "swa":
        model: Any = TinyCNN()
        callback: Any = CountingSWA(swa_lrs=0.05, swa_epoch_start=2, annealing_epochs=1)
        data, loops = OrderedData(image_dataset(12), 3), {"max_epochs": 3, "limit_val_batches": 0}
    else:
        model = ValidatedCNN()
        callback = EveryOtherStep() if case == "every_other" else LateEMA(decay=0.8)
        data = OrderedData(image_dataset(16), 2)
        loops = {"max_epochs": 2, "val_check_interval": 2, "limit_val_batches": 1, "num_sanity_val_steps": 0}
    trainer = _trainer(strategy, [callback], 2, enable_checkpointing=False, **loops)
    trainer.fit(model, data)
    sharded = isinstance(trainer.strategy, ShardLabStrategy)
    return {
        "losses": torch.stack(model.losses),
        "val_losses": torch.stack(model.val_losses) if getattr(model, "val_losses", None) else None,
        "record": callback.calls if case == "swa" else callback._latest_update_step,
        "class": type(callback).__name__,
        "state": trainer.strategy.full_state_dict() if sharded else model.state_dict(),
        "rank": trainer.global_rank,
    }


def _refusal(callback: L.Callback) -> str:
    trainer = _trainer(ShardLabStrategy(stage=3), [callback], 2, max_steps=2, enable_checkpointing=False)
    try:
        trainer.fit(TinyCNN(), OrderedData(image_dataset(8), 2))
    except ValueError as err:
        return str(err)
    return "not refused"


def subclasses_against_ddp(stages: list[int]) -> dict[str, Any]:
    report: dict[str, Any] = {}
    for case in ("every_other", "late_ema", "swa"):
        ddp = _averaging_fit(case, "ddp")
        for stage in stages:
            ours = _averaging_fit(case, ShardLabStrategy(stage=stage))
            where = f"{case}, stage {stage}, rank {ours['rank']}"
            assert ours["class"] == ddp["class"], where  # the user's class name, as under DDP
            assert ours["record"] == ddp["record"], f"{where}: {ours['record']} != {ddp['record']}"
            assert_close(ours["losses"], ddp["losses"], **FP32, msg=lambda m: f"losses, {where}\n{m}")
            if ddp["val_losses"] is not None:
                assert_close(
                    ours["val_losses"], ddp["val_losses"], **FP32, msg=lambda m: f"on the average, {where}\n{m}"
                )
            if ours["rank"] == 0:
                assert list(ours["state"]) == list(ddp["state"]), where
                for key, value in ddp["state"].items():  # the average, applied: weights and batch-norm buffers
                    assert_close(ours["state"][key], value, **FP32, msg=lambda m, k=key: f"{k}, {where}\n{m}")
        report[case] = ddp["record"]
    report["reads"] = _refusal(ReadsAverage(decay=0.9))
    report["hands_on"] = _refusal(HandsAverageOn(decay=0.9))
    return report


def test_weight_averaging_subclasses_run_sharded_with_ddp_numbers() -> None:
    for rank, report in enumerate(run_ranks("tests.test_weight_averaging_subclasses:subclasses_against_ddp", 2,
                                            {"stages": [1, 2, 3]}, timeout=300)):  # fmt: skip
        assert report["every_other"] == 8 and report["late_ema"] == 8, report  # the last update's step (of 8)
        assert report["swa"] == {"epoch_end": [0, 1, 2, 3], "update": [1, 2], "transfer": [1]}, report
        reads, hands_on = report["reads"], report["hands_on"]
        assert reads.startswith(f"[rank {rank}] ReadsAverage.on_train_epoch_end reads the whole averaged module"), reads
        assert "self._average_model.module" in reads and "HINT:" in reads, reads
        assert "average_norm reads the whole averaged module (self._average_model.module)" in hands_on, hands_on
