"""What Lightning users do around and after ``fit``, against Lightning ``ddp`` on the same batches, at every stage.

One 2-rank job runs, for DDP and for shardlab at stages 1, 2 and 3, the same life of one module object:

    Trainer 1: fit 3 steps (LearningRateMonitor on two param groups), test, predict
    Trainer 2: a new Trainer fits the same object 3 more steps (its optimizer and loops new, as under DDP)

Every step's loss, the test and predict outputs, the final weights, the learning rates logged and their keys
(``lr-AdamW/pg1``: the optimizer keeps its class's name) equal DDP's. What user code sees of its optimizer (class
name and qualname, ``isinstance``, repr, ``defaults``) is its own. Handed to Lightning's ``ddp`` after a shardlab fit,
a module continues as DDP's own does at stages 1 and 2; left sharded at stage 3, its ``state_dict()`` is refused
naming ``full_state_dict()``, and DDP's setup refuses it on every rank, naming the ways to get the weights.
"""

from __future__ import annotations

import copy
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.loggers import Logger
from torch import Tensor
from torch.testing import assert_close

from lightning_shardlab import ShardLabStrategy
from tests.helpers.launch import run_ranks
from tests.helpers.reference import FP32
from tests.models import OrderedData, RegressionNet, regression_dataset

STEPS, BATCH = 3, 2


class Recorder(Logger):
    """Every metric logged, by key, in order (what a dashboard or ``ModelCheckpoint(monitor=...)`` reads)."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics: dict[str, list[float]] = {}

    @property
    def name(self) -> str:
        return "recorder"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        for key, value in metrics.items():
            self.metrics.setdefault(key, []).append(float(value))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


class TwoGroups(RegressionNet):
    """Two param groups with their own learning rates, a cosine schedule, test and predict steps."""

    def configure_optimizers(self) -> Any:
        blocks = list(self.net.blocks.parameters())
        rest = [p for n, p in self.net.named_parameters() if not n.startswith("blocks.")]
        optimizer = torch.optim.AdamW([{"params": rest}, {"params": blocks, "lr": 3e-3}], lr=1e-2, weight_decay=0.1)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, 8)}

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("test_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def predict_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self.net(batch[0])


def _trainer(strategy: Any, logger: Logger | bool = False, callbacks: list | None = None) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=STEPS, logger=logger, callbacks=callbacks or [],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, limit_val_batches=0,
    )  # fmt: skip


def _optimizer_seen(trainer: L.Trainer) -> dict[str, Any]:
    optimizer = trainer.optimizers[0]
    return {
        "name": type(optimizer).__name__,
        "qualname": type(optimizer).__qualname__,
        "module": type(optimizer).__module__,
        "isinstance": isinstance(optimizer, torch.optim.AdamW),
        "repr": repr(optimizer),
        "defaults": copy.deepcopy(optimizer.defaults),
    }


def _life(model: TwoGroups, strategy: Any) -> dict[str, Any]:
    """Fit, test and predict with one Trainer, then fit the same object again with a new one."""
    data = OrderedData(regression_dataset(STEPS * BATCH * 2), BATCH)
    recorder = Recorder()
    first = _trainer(strategy(), recorder, [LearningRateMonitor()])
    first.fit(model, data)
    seen = _optimizer_seen(first)
    tested = first.test(model, data, verbose=False)[0]["test_loss"]
    predicted = torch.cat(first.predict(model, data.train_dataloader()))
    _trainer(strategy()).fit(model, data)
    state = first.strategy.full_state_dict() if isinstance(first.strategy, ShardLabStrategy) else model.state_dict()
    lrs = {k: v for k, v in recorder.metrics.items() if k.startswith("lr-")}
    return {"losses": torch.stack(model.losses), "test": tested, "predict": predicted, "state": state, "lrs": lrs,
            "optimizer": seen}  # fmt: skip


def handed_to_ddp(initial: TwoGroups, stage: int) -> Any:
    """Fitted by shardlab, then by Lightning's ``ddp``: at stages 1-2 (every rank holds the whole parameters) it
    continues as DDP does; at stage 3 the error DDP's setup meets."""
    model = copy.deepcopy(initial)
    data = OrderedData(regression_dataset(STEPS * BATCH * 2), BATCH)
    _trainer(ShardLabStrategy(stage=stage)).fit(model, data)
    if stage < 3:
        _trainer("ddp").fit(model, data)
        return model.state_dict()
    with pytest.raises(
        RuntimeError, match=r"while it is sharded \(stage 3\).*call trainer.strategy.full_state_dict\(\)"
    ):
        model.state_dict()  # on every rank at once: a clear refusal naming full_state_dict(), not a hang
    with pytest.raises(RuntimeError) as refused:
        _trainer("ddp").fit(model, data)
    return str(refused.value)


def after_fit(stages: list[int]) -> dict[str, Any]:
    torch.manual_seed(0)
    initial = TwoGroups()
    ddp = _life(copy.deepcopy(initial), lambda: "ddp")
    report: dict[str, Any] = {"ddp": {"optimizer": ddp["optimizer"], "lrs": ddp["lrs"]}}
    rank = torch.distributed.get_rank()
    for stage in stages:
        got = _life(copy.deepcopy(initial), lambda stage=stage: ShardLabStrategy(stage=stage))
        where = f"stage {stage}, rank {rank}"
        assert len(got["losses"]) == len(ddp["losses"]) == 2 * STEPS, where
        assert_close(got["losses"], ddp["losses"], **FP32, msg=lambda m: f"losses, {where}\n{m}")
        assert_close(got["test"], ddp["test"], **FP32, msg=lambda m: f"test, {where}\n{m}")
        assert_close(got["predict"], ddp["predict"], **FP32, msg=lambda m: f"predict, {where}\n{m}")
        if rank == 0:
            assert list(got["state"]) == list(ddp["state"]), where
            for key, value in ddp["state"].items():
                assert_close(got["state"][key], value, **FP32, msg=lambda m, k=key: f"{k}, {where}\n{m}")
        report[stage] = {"optimizer": got["optimizer"], "lrs": got["lrs"]}
        handed = handed_to_ddp(initial, stage)
        if stage == 3:
            report["handed_over"] = handed
        elif rank == 0:
            for key, value in ddp["state"].items():
                assert_close(handed[key], value, **FP32, msg=lambda m, k=key: f"{k}, handed to ddp, {where}\n{m}")
    report["ddp_backbone_drift"] = ddp_backbone_across_ranks()
    return report


def test_a_module_lives_on_after_fit_as_under_ddp_at_every_stage() -> None:
    reports = run_ranks("tests.test_after_fit:after_fit", 2, {"stages": [1, 2, 3]}, timeout=300)
    for report in reports:
        ddp = report["ddp"]
        assert ddp["optimizer"]["name"] == "AdamW" and ddp["optimizer"]["repr"].startswith("AdamW (")
        assert sorted(ddp["lrs"]) == ["lr-AdamW/pg1", "lr-AdamW/pg2"], ddp["lrs"]
        for stage in (1, 2, 3):
            assert report[stage]["optimizer"] == ddp["optimizer"], stage
            assert report[stage]["lrs"] == ddp["lrs"], stage  # the same keys, the same values at the same steps
        refused = report["handed_over"]
        assert "left sharded" in refused and "DDPStrategy" in refused, refused
        for way in (
            "full_state_dict()",
            "load_from_checkpoint",
            "shardlab consolidate",
            "with the same shardlab options",
        ):
            assert way in refused, (way, refused)


# ---- where Lightning's ddp is not the reference ----


def ddp_backbone_across_ranks() -> float:
    """Lightning ``ddp`` with ``BackboneFinetuning``: the largest difference of the backbone's weights between the
    two ranks after 3 epochs. DDP's reducer knows only the parameters that required grad when it was built, so the
    backbone unfrozen at epoch 1 is never averaged: each rank trains it on its own gradients."""
    from tests.models.midrun import MidRunNet, callbacks, midrun_dataset

    torch.manual_seed(0)
    model = MidRunNet("finetune")
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_epochs=3, callbacks=callbacks("finetune"), logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(model, OrderedData(midrun_dataset(8 * 3), 4))
    mine = torch.cat([p.detach().flatten() for p in model.backbone.parameters()])
    both = [torch.empty_like(mine) for _ in range(2)]
    torch.distributed.all_gather(both, mine)
    return (both[0] - both[1]).abs().max().item()
