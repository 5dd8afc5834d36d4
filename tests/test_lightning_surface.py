"""The Lightning surface a DDP user touches, under Lightning's ``ddp`` and under shardlab at stages 1, 2 and 3.

One 2-rank job runs every case below once per strategy, on the same initial model and the same data, and returns
what the user's script would see: the final weights (rank 0), the metrics logged (``self.log(..., sync_dist=True)``
through ``CSVLogger``, row by row), the callbacks' own results (a checkpoint callback's files, best scores and the
weights in its best file; the epoch ``EarlyStopping`` stopped at; the learning rates ``LearningRateMonitor`` logged;
a summary's parameter counts), the tuner's suggestions and the loops' return values. The test compares each
strategy's against DDP's (fp32 tolerance), case by case, and names the case and the key that differ.

    callbacks        ModelCheckpoint (monitor + save_top_k + save_last; every_n_train_steps), EarlyStopping,
                     LearningRateMonitor, LambdaCallback, Timer, ModelSummary, RichModelSummary, TQDMProgressBar,
                     ThroughputMonitor, DeviceStatsMonitor, SpikeDetection, CSVLogger, sync_dist
    schedule         GradientAccumulationScheduler with a user's BaseFinetuning subclass, RichProgressBar; the
                     reference is DDP with every parameter in its reducer (``ReducesFrozenDDP`` says why)
    pruning          ModelPruning, structured (ln_structured along dim 0) on chosen weights
    on_exception     OnExceptionCheckpoint after a step that raises on every rank, through a TorchCheckpointIO
                     subclass (shardlab's default with a user's plugin: one file per checkpoint, written through
                     it, as under DDP); the file loads in a plain process
    async_io         AsyncCheckpointIO around a TorchCheckpointIO subclass; fit resumes from the last file
    tuner            Tuner.lr_find (its curve and suggestion, the weights it restores), then fit;
                     Tuner.scale_batch_size and BatchSizeFinder refuse distributed strategies alike
    lr_finder        the LearningRateFinder callback
    samplers         a user's DistributedSampler subclass and a user's BatchSampler
    loops            validate, test and predict without fit (and BasePredictionWriter)
"""

from __future__ import annotations

import copy
import csv
import os
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import (
    BaseFinetuning,
    BasePredictionWriter,
    BatchSizeFinder,
    Checkpoint,
    DeviceStatsMonitor,
    EarlyStopping,
    GradientAccumulationScheduler,
    LambdaCallback,
    LearningRateFinder,
    LearningRateMonitor,
    ModelCheckpoint,
    ModelPruning,
    ModelSummary,
    OnExceptionCheckpoint,
    ProgressBar,
    RichModelSummary,
    RichProgressBar,
    SpikeDetection,
    ThroughputMonitor,
    Timer,
    TQDMProgressBar,
)
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.tuner import Tuner
from torch import Tensor, nn
from torch.testing import assert_close
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, SequentialSampler, TensorDataset

from lightning_shardlab import ShardLabStrategy
from tests.helpers.launch import run_ranks
from tests.helpers.reference import FP32

STRATEGIES = ("ddp", "stage 1", "stage 2", "stage 3")


class SurfaceNet(L.LightningModule):
    """A stem, a two-layer ``backbone`` and a head (odd widths: shards end inside tensors); SGD with momentum and a
    step schedule; every loss logged with ``sync_dist=True``. ``lr`` and ``batch_size`` are what the tuner sets."""

    def __init__(self, lr: float = 0.05, batch_size: int = 2, fail_at_step: int = -1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.lr, self.batch_size = lr, batch_size
        self.stem = nn.Linear(5, 9)
        self.backbone = nn.Sequential(nn.Linear(9, 7), nn.Tanh(), nn.Linear(7, 9))
        self.head = nn.Linear(9, 2)
        self.train_data = self.val_data = dataset(16)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.backbone(torch.tanh(self.stem(x)))))

    def _loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        if self.global_step == self.hparams.fail_at_step:
            raise RuntimeError("the step that fails on purpose")
        loss = self._loss(batch)
        self.log("train_loss", loss, sync_dist=True, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("test_loss", self._loss(batch), sync_dist=True)
        self.log("test_max", self._loss(batch), sync_dist=True, reduce_fx="max")

    def predict_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self(batch[0])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_data, batch_size=self.batch_size)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_data, batch_size=2)

    test_dataloader = predict_dataloader = val_dataloader

    def configure_optimizers(self) -> dict[str, Any]:
        trainable = [p for p in self.parameters() if p.requires_grad]
        optimizer = torch.optim.SGD(trainable, lr=self.lr, momentum=0.9)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.7)}


def dataset(n: int, seed: int = 7) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 5, generator=g)
    return TensorDataset(x, torch.stack([x[:, 0] * x[:, 1], x[:, 2].sin()], 1) + 0.1 * torch.randn(n, 2, generator=g))


# ---- what a run returns ----


def weights(trainer: L.Trainer, model: L.LightningModule) -> dict[str, Tensor]:
    """The whole module's state dict on rank 0 (a collective under shardlab), {} elsewhere."""
    if isinstance(trainer.strategy, ShardLabStrategy):
        state = trainer.strategy.full_state_dict()
    else:
        state = model.state_dict() if trainer.global_rank == 0 else {}
    return {k: v.detach().cpu().clone() for k, v in state.items()}


def csv_rows(trainer: L.Trainer, logger: CSVLogger, drop: tuple[str, ...] = ()) -> list[dict[str, str]]:
    """metrics.csv as rows on rank 0 (which writes it), without the columns that measure time or the machine."""
    if trainer.global_rank != 0:
        return []
    with open(Path(logger.log_dir) / "metrics.csv") as f:
        return [{k: v for k, v in row.items() if not any(d in k for d in drop)} for row in csv.DictReader(f)]


def checkpoints(folder: Path) -> list[str]:
    """The checkpoints in ``folder`` by name (a sharded one's shard directory beside it is part of it)."""
    return sorted(name for name in os.listdir(folder) if ".shards-" not in name)


def plain(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in sorted(metrics.items())}


def trainer_for(
    strategy: str, root: Path, ddp: Any = "ddp", shardlab: dict[str, Any] | None = None, **kwargs: Any
) -> L.Trainer:
    """A Trainer on 2 CPU ranks: ``ddp`` for "ddp", else shardlab at the stage named, with ``shardlab`` options."""
    stage = None if strategy == "ddp" else int(strategy.split()[1])
    options = {
        "accelerator": "cpu",
        "devices": 2,
        "strategy": ddp if stage is None else ShardLabStrategy(stage=stage, **(shardlab or {})),
        "default_root_dir": str(root),
        "logger": False,
        "enable_checkpointing": any(isinstance(c, Checkpoint) for c in kwargs.get("callbacks", [])),
        "enable_progress_bar": any(isinstance(c, ProgressBar) for c in kwargs.get("callbacks", [])),
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        **kwargs,
    }
    return L.Trainer(**options)


# ---- the cases: each takes a fresh copy of the initial model and a folder of its own ----


class Summaries:
    """What ``ModelSummary`` and ``RichModelSummary`` computed (each calls ``summarize`` with it)."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []

    def record(self, cls: type) -> Any:
        seen = self.seen

        class Recording(cls):
            @staticmethod
            def summarize(summary_data, total_parameters, trainable_parameters, model_size, *args, **kwargs):  # noqa: ANN001, ANN205
                seen.append(
                    {"rows": summary_data, "total": total_parameters, "trainable": trainable_parameters}
                    | {"size": round(model_size, 6)}
                )

        return Recording(max_depth=2)


def case_callbacks(model: SurfaceNet, strategy: str, root: Path) -> dict[str, Any]:
    best = ModelCheckpoint(dirpath=root / "best", monitor="val_loss", save_top_k=2, save_last=True)
    steps = ModelCheckpoint(dirpath=root / "steps", every_n_train_steps=3, save_top_k=-1)
    stopping = EarlyStopping(monitor="val_loss", min_delta=10.0, patience=2)  # stops after the third epoch
    outputs: list[float] = []
    record = LambdaCallback(on_train_batch_end=lambda t, m, out, b, i: outputs.append(float(out["loss"])))
    timer, summaries = Timer(), Summaries()
    logger = CSVLogger(root, name="csv", version=0)
    callbacks = [best, steps, stopping, LearningRateMonitor("step"), record, timer]
    callbacks += [summaries.record(ModelSummary), summaries.record(RichModelSummary), TQDMProgressBar()]
    callbacks += [ThroughputMonitor(batch_size_fn=lambda b: b[0].size(0), window_size=2)]
    callbacks += [DeviceStatsMonitor(cpu_stats=True), SpikeDetection(warmup=2, atol=50.0)]
    trainer = trainer_for(strategy, root, max_epochs=6, callbacks=callbacks, logger=logger, log_every_n_steps=1)
    trainer.fit(model)
    best_weights = {}
    if trainer.global_rank == 0:
        loaded = SurfaceNet.load_from_checkpoint(best.best_model_path, map_location="cpu")
        best_weights = {k: v.clone() for k, v in loaded.state_dict().items()}
    return {
        "weights": weights(trainer, model),
        "best files": checkpoints(root / "best"),
        "step files": checkpoints(root / "steps"),
        "best score": float(best.best_model_score),
        "top k": {Path(k).name: float(v) for k, v in best.best_k_models.items()},
        "best weights": best_weights,
        "stopped epoch": stopping.stopped_epoch,
        "global step": trainer.global_step,
        "outputs": outputs,
        "timer counted": timer.time_elapsed("train") > 0,
        "summaries": summaries.seen,
        "progress bar": plain(trainer.progress_bar_metrics),
        "callback metrics": plain(trainer.callback_metrics),
        "csv": csv_rows(trainer, logger, drop=("_per_sec", "time", "DeviceStats")),
        "csv columns": sorted({k for row in csv_rows(trainer, logger) for k in row}),
    }


class FreezeBackbone(BaseFinetuning):
    """A user's finetuning: the backbone frozen, then trained from epoch 1 in a group of its own at a tenth of the
    learning rate."""

    def freeze_before_training(self, pl_module: L.LightningModule) -> None:
        self.freeze(pl_module.backbone)

    def finetune_function(self, pl_module: L.LightningModule, epoch: int, optimizer: torch.optim.Optimizer) -> None:
        if epoch == 1:
            self.unfreeze_and_add_param_group(pl_module.backbone, optimizer, lr=0.005, initial_denom_lr=1.0)


class ReducesFrozenDDP(DDPStrategy):
    """Lightning's DDP with its reducer built over every parameter, the frozen ones too (unused while frozen): the
    reference for a backbone frozen at setup and trained later. Lightning's own DDP builds its reducer over the
    parameters that require a gradient at setup, so the gradients of a backbone unfrozen later are never averaged
    and the ranks' backbones drift apart; shardlab averages them, as this reference does."""

    def __init__(self) -> None:
        super().__init__(find_unused_parameters=True)

    def _setup_model(self, model: nn.Module) -> Any:
        frozen = [p for p in model.parameters() if not p.requires_grad]
        for p in frozen:
            p.requires_grad_(True)
        try:
            return super()._setup_model(model)
        finally:
            for p in frozen:
                p.requires_grad_(False)


def case_schedule(model: SurfaceNet, strategy: str, root: Path) -> dict[str, Any]:
    accumulate = GradientAccumulationScheduler({0: 1, 1: 2, 2: 4})
    callbacks = [accumulate, FreezeBackbone(), RichProgressBar()]
    trainer = trainer_for(strategy, root, ReducesFrozenDDP(), max_epochs=3, callbacks=callbacks, limit_val_batches=0)
    trainer.fit(model)
    return {"weights": weights(trainer, model), "global step": trainer.global_step}


def case_pruning(model: SurfaceNet, strategy: str, root: Path) -> dict[str, Any]:
    pruning = ModelPruning(
        "ln_structured",
        amount=0.25,
        pruning_dim=0,
        pruning_norm=1,
        parameters_to_prune=[(model.stem, "weight"), (model.backbone[2], "weight")],
        use_global_unstructured=False,
        verbose=0,
    )
    trainer = trainer_for(strategy, root, max_epochs=2, callbacks=[pruning], limit_val_batches=0)
    trainer.fit(model)
    return {"weights": weights(trainer, model)}


class CountingIO(TorchCheckpointIO):
    """A user's checkpoint IO: Lightning's, counting what it is asked to save."""

    def __init__(self) -> None:
        super().__init__()
        self.saved: list[str] = []

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        # shardlab's full file goes through the plugin under a temporary name, renamed once complete
        self.saved.append(Path(path).name.split(".tmp-")[0])
        super().save_checkpoint(checkpoint, path, storage_options)


def case_on_exception(model: SurfaceNet, strategy: str, root: Path) -> dict[str, Any]:
    model.hparams.fail_at_step = 5
    io = CountingIO()
    callbacks = [OnExceptionCheckpoint(root)]
    # a user's plugin: shardlab's default format becomes one file per checkpoint, written through it, as under DDP
    trainer = trainer_for(strategy, root, max_epochs=3, callbacks=callbacks, plugins=[io], limit_val_batches=0)
    try:
        trainer.fit(model)
    except RuntimeError as error:
        raised = str(error)
    saved = {}
    if trainer.global_rank == 0:
        saved = SurfaceNet.load_from_checkpoint(root / "on_exception.ckpt", map_location="cpu").state_dict()
    return {"raised": raised, "saved weights": saved, "files": checkpoints(root), "io saved": io.saved}


def case_async_io(model: SurfaceNet, strategy: str, root: Path) -> dict[str, Any]:
    def fit(epochs: int, ckpt_path: str | None) -> L.Trainer:
        saver = ModelCheckpoint(dirpath=root, save_last=True, save_top_k=-1)
        io = AsyncCheckpointIO(CountingIO())
        trainer = trainer_for(strategy, root, max_epochs=epochs, callbacks=[saver], plugins=[io])
        trainer.fit(model, ckpt_path=ckpt_path)
        return trainer

    fit(2, None)
    trainer = fit(3, str(root / "last.ckpt"))
    files = checkpoints(root)
    return {"weights": weights(trainer, model), "files": files, "global step": trainer.global_step}


def _refusal(call: Callable[[], Any]) -> str:
    try:
        call()
    except Exception as error:  # noqa: BLE001  (the refusal is compared as text)
        return f"{type(error).__name__}: {error}"
    return "no error"


def case_tuner(model: SurfaceNet, strategy: str, root: Path) -> dict[str, Any]:
    trainer = trainer_for(strategy, root, max_epochs=2, limit_val_batches=0)
    tuner = Tuner(trainer)
    finder = tuner.lr_find(model, min_lr=1e-4, max_lr=1.0, num_training=6, early_stop_threshold=None)
    restored = weights(trainer, model)  # lr_find puts the initial weights back
    suggestion = finder.suggestion(skip_begin=1, skip_end=1)
    model.lr = suggestion
    trainer.fit(model)
    refusal = _refusal(lambda: Tuner(trainer_for(strategy, root)).scale_batch_size(model, max_trials=2))
    finder_callback = _refusal(lambda: trainer_for(strategy, root, callbacks=[BatchSizeFinder()]).fit(model))
    return {
        "lr": finder.results["lr"],
        "loss": finder.results["loss"],
        "suggestion": suggestion,
        "weights": weights(trainer, model),
        "scale_batch_size": refusal,
        "BatchSizeFinder": finder_callback,
        "restored": restored,
    }


def case_lr_finder(model: SurfaceNet, strategy: str, root: Path) -> dict[str, Any]:
    finder = LearningRateFinder(min_lr=1e-4, max_lr=1.0, num_training_steps=6, early_stop_threshold=None)
    trainer = trainer_for(strategy, root, max_epochs=1, callbacks=[finder], limit_val_batches=0)
    trainer.fit(model)
    return {"lr": model.lr, "loss": finder.optimal_lr.results["loss"], "weights": weights(trainer, model)}


class EveryOther(DistributedSampler):
    """A user's sampler: this rank's share, in reverse."""

    def __iter__(self):  # noqa: ANN204
        return reversed(list(super().__iter__()))


class Pairs(BatchSampler):
    """A user's batch sampler: pairs of consecutive indices, the last pair first."""

    def __iter__(self):  # noqa: ANN204
        return reversed(list(super().__iter__()))


def case_samplers(model: SurfaceNet, strategy: str, root: Path) -> dict[str, Any]:
    data = dataset(16, seed=8)
    trainer = trainer_for(strategy, root, max_epochs=1, limit_val_batches=0)
    custom = DataLoader(data, batch_size=2, sampler=EveryOther(data, shuffle=False))
    trainer.fit(model, train_dataloaders=custom)
    first = weights(trainer, model)
    trainer = trainer_for(strategy, root, max_epochs=1, limit_val_batches=0)
    batches = DataLoader(data, batch_sampler=Pairs(SequentialSampler(data), 2, drop_last=False))
    trainer.fit(model, train_dataloaders=batches)
    return {"sampler weights": first, "batch sampler weights": weights(trainer, model)}


class Written(BasePredictionWriter):
    def __init__(self) -> None:
        super().__init__("epoch")
        self.written: list[Tensor] = []

    def write_on_epoch_end(self, trainer, pl_module, predictions, batch_indices) -> None:  # noqa: ANN001
        self.written = [torch.cat(predictions), torch.tensor(batch_indices)]


def case_loops(model: SurfaceNet, strategy: str, root: Path) -> dict[str, Any]:
    writer = Written()
    trainer = trainer_for(strategy, root, callbacks=[writer])
    validated = trainer.validate(model, verbose=False)
    tested = trainer.test(model, verbose=False)
    predicted = trainer.predict(model)
    return {"validate": validated, "test": tested, "predict": predicted, "written": writer.written}


CASES = {
    "callbacks": case_callbacks,
    "schedule": case_schedule,
    "pruning": case_pruning,
    "on_exception": case_on_exception,
    "async_io": case_async_io,
    "tuner": case_tuner,
    "lr_finder": case_lr_finder,
    "samplers": case_samplers,
    "loops": case_loops,
}


def surface(root: str, cases: list[str], strategies: list[str]) -> dict[str, dict[str, Any]]:
    """Every case under every strategy on this rank: case -> strategy -> what it returned (or the error's text)."""
    torch.manual_seed(0)
    initial = SurfaceNet()
    results: dict[str, dict[str, Any]] = {}
    for name in cases:
        for strategy in strategies:
            folder = Path(root) / name / strategy.replace(" ", "_")
            results.setdefault(name, {})
            try:
                results[name][strategy] = CASES[name](copy.deepcopy(initial), strategy, folder)
            except Exception:  # noqa: BLE001
                results[name][strategy] = f"ERROR {traceback.format_exc()}"
    return results


# ---- comparing ----


def differences(expected: Any, actual: Any, where: str) -> list[str]:
    """Where ``actual`` differs from ``expected``, beyond fp32 tolerance for numbers and tensors."""
    if isinstance(expected, dict) and isinstance(actual, dict):
        if list(expected) != list(actual) and sorted(map(str, expected)) != sorted(map(str, actual)):
            return [f"{where}: keys {list(expected)} != {list(actual)}"]
        return [d for k in expected for d in differences(expected[k], actual.get(k), f"{where}.{k}")]
    if isinstance(expected, (list, tuple)) and isinstance(actual, (list, tuple)):
        if len(expected) != len(actual):
            return [f"{where}: {len(expected)} items != {len(actual)}"]
        return [d for i, (e, a) in enumerate(zip(expected, actual)) for d in differences(e, a, f"{where}[{i}]")]
    if isinstance(expected, (Tensor, float)) and isinstance(actual, (Tensor, float)):
        try:
            assert_close(torch.as_tensor(actual), torch.as_tensor(expected), **FP32)
        except AssertionError as error:
            return [f"{where}: {str(error).splitlines()[0]}"]
        return []
    return [] if expected == actual else [f"{where}: {expected!r} != {actual!r}"]


def table(reports: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, list[str]]]:
    """case -> strategy -> its differences from DDP on any rank (empty: equal)."""
    out: dict[str, dict[str, list[str]]] = {}
    for rank, report in enumerate(reports):
        for name, by_strategy in report.items():
            reference = by_strategy["ddp"]
            for strategy, result in by_strategy.items():
                found = out.setdefault(name, {}).setdefault(strategy, [])
                if isinstance(result, str) and result.startswith("ERROR"):
                    found.append(f"rank {rank}: {result}")
                elif strategy != "ddp":
                    found += [f"rank {rank}: {d}" for d in differences(reference, result, name)]
    return out


def test_lightning_surface_equals_ddp_at_every_stage(tmp_path: Path) -> None:
    reports = run_ranks(
        "tests.test_lightning_surface:surface",
        2,
        {"root": str(tmp_path), "cases": list(CASES), "strategies": list(STRATEGIES)},
        timeout=300,
    )
    assert [sorted(report) for report in reports] == [sorted(CASES)] * 2
    failures = {(c, s): d for c, by in table(reports).items() for s, d in by.items() if d}
    assert not failures, "\n".join(f"{c} / {s}:\n  " + "\n  ".join(d) for (c, s), d in failures.items())
