"""Checkpoints through Lightning: exact resume, ModelCheckpoint's life cycle, validate/test(ckpt_path=...).

Sharded (the default, a directory) at stages 1, 2 and 3, and full (one plain Lightning file). Helpers
here are shared by tests/test_checkpoint_*.py.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import Tensor

from lightning_shardlab import ShardLabStrategy
from lightning_shardlab.checkpoint.describe import describe
from lightning_shardlab.checkpoint.format import shards_of
from lightning_shardlab.checkpoint.save_load import full_optimizer_state
from tests.helpers.launch import run_ranks
from tests.models import OrderedData, TinyCNN, TinyGPT, image_dataset, token_dataset

QUIET = dict(
    logger=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    use_distributed_sampler=False,
    num_sanity_val_steps=0,
)


# ---- helpers shared by the checkpoint tests ----


class RankTally(Callback):
    """Per-rank side state: every rank counts its batches (the same everywhere) and sums its own tokens
    (different on every rank). Resuming on the same world size must give every rank its own sum back."""

    def __init__(self) -> None:
        self.batches, self.token_sum = 0, 0

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.batches += 1
        self.token_sum += int(batch[0].sum())

    def state_dict(self) -> dict[str, int]:
        return {"batches": self.batches, "token_sum": self.token_sum}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self.batches, self.token_sum = state_dict["batches"], state_dict["token_sum"]


class Snapshot(Callback):
    """Gathers the weights and optimizer state when training starts (i.e. right after a checkpoint loaded)."""

    def __init__(self) -> None:
        self.at_start: dict[str, Any] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.at_start = snapshot(trainer)


def snapshot(trainer: L.Trainer) -> dict[str, Any]:
    """Collective: the unsharded weights and optimizer states (the torch format) on rank 0, {} elsewhere."""
    strategy = trainer.strategy
    state = strategy.full_state_dict()
    optim = [full_optimizer_state(opt, strategy.sharded) for opt in strategy.optimizers]
    # a copy: scalar state (Adam's step) may be the live tensor, which later steps increment in place
    return copy.deepcopy({"state": state, "optim": optim}) if trainer.global_rank == 0 else {}


def differences(a: Any, b: Any, where: str = "") -> list[str]:
    """Where two nested structures are not bit-for-bit equal (tensors: same dtype, shape and bits)."""
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        same = isinstance(a, Tensor) and isinstance(b, Tensor) and a.dtype == b.dtype and torch.equal(a, b)
        return [] if same else [where]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{where} keys {sorted(map(str, set(a) ^ set(b)))[:5]}"]
        return [d for k in a for d in differences(a[k], b[k], f"{where}[{k!r}]")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where} length"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def complete_checkpoints(directory: Path) -> dict[str, bool]:
    """Every checkpoint in a ModelCheckpoint directory: name -> complete (a full file; a model file whose shard
    directory has its COMPLETE marker). A shard directory that no model file names is an entry of its own (a
    leftover: never complete)."""
    named = {shards_of(p) for p in directory.iterdir()} - {None}
    found = {}
    for p in directory.iterdir():
        if p.resolve() not in named:
            shards = shards_of(p)
            found[p.name] = (shards / "COMPLETE").is_file() if shards else p.is_file() or (p / "COMPLETE").is_file()
    return found


# ---- exact resume ----


def _fit(
    world_size: int,
    stage: int,
    epochs: int,
    seed: int,
    state_dict_type: str,
    callbacks: list,
    ckpt_path: str | None = None,
    optimizer: str = "adamw",
    precision: str = "32-true",
) -> tuple[L.Trainer, TinyGPT]:
    torch.manual_seed(seed)
    model = TinyGPT(optimizer=optimizer)
    data = token_dataset(4 * 2 * world_size)
    strategy = ShardLabStrategy(stage=stage, state_dict_type=state_dict_type)
    saving = any(isinstance(c, ModelCheckpoint) for c in callbacks)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=strategy,
        max_epochs=epochs,
        precision=precision,
        enable_checkpointing=saving,
        callbacks=callbacks,
        limit_val_batches=2,
        **QUIET,
    )
    trainer.fit(model, OrderedData(data, 2), ckpt_path=ckpt_path)
    return trainer, model


def resume_exact(
    world_size: int, stage: int, state_dict_type: str, optimizer: str, precision: str, link_last: bool, tmp: str
) -> dict:
    """4 epochs straight vs 2 epochs, ModelCheckpoint (top-1 by val_loss + last, a copy or a link), resume to 4
    from last (its path, or ``ckpt_path="last"``); then validate and test from the best on a fresh model."""
    rank, tmp_dir = int(os.environ["RANK"]), Path(tmp)
    tally = RankTally()
    run = dict(state_dict_type=state_dict_type, optimizer=optimizer, precision=precision)
    straight_trainer, _ = _fit(world_size, stage, 4, seed=0, callbacks=[tally], **run)
    straight = snapshot(straight_trainer)

    class ListAtEpochStart(Callback):  # what ModelCheckpoint has written when the second epoch starts
        listing: list[str] = []

        def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            if trainer.current_epoch == 1:
                ListAtEpochStart.listing = sorted(os.listdir(tmp_dir / "ckpts"))

    saver = ModelCheckpoint(
        dirpath=tmp_dir / "ckpts", monitor="val_loss", save_top_k=1, save_last="link" if link_last else True
    )
    half_trainer, _ = _fit(world_size, stage, 2, seed=0, callbacks=[RankTally(), saver, ListAtEpochStart()], **run)
    half_trainer.save_checkpoint(tmp_dir / "explicit.ckpt")  # trainer.save_checkpoint, the same state as last
    resumed_tally = RankTally()
    finder = (
        [ModelCheckpoint(dirpath=tmp_dir / "ckpts", save_top_k=0)] if link_last else []
    )  # finds "last", saves nothing
    resumed_trainer, _ = _fit(
        world_size,
        stage,
        4,
        seed=123,
        callbacks=[resumed_tally, *finder],  # other initial weights
        ckpt_path="last" if link_last else saver.last_model_path,
        **run,
    )
    resumed = snapshot(resumed_trainer)

    torch.manual_seed(7)
    evaluator = L.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=ShardLabStrategy(stage=stage),
        precision=precision,
        limit_val_batches=2,
        limit_test_batches=2,
        enable_checkpointing=False,
        **QUIET,
    )
    data = OrderedData(token_dataset(4 * 2 * world_size), 2)
    val = evaluator.validate(TinyGPT(), data, ckpt_path=saver.best_model_path, verbose=False)[0]["val_loss"]
    test = evaluator.test(TinyGPT(), data, ckpt_path=saver.best_model_path, verbose=False)[0]["test_loss"]
    return {
        "rank": rank,
        "tally": (tally.batches, tally.token_sum),
        "resumed_tally": (resumed_tally.batches, resumed_tally.token_sum),
        "differences": differences(straight, resumed),
        "state": straight.get("state"),
        "best": saver.best_model_path,
        "best_score": float(saver.best_model_score),
        "last": saver.last_model_path,
        "resumed_from": resumed_trainer.ckpt_path,
        "listing_epoch_1": ListAtEpochStart.listing,
        "val": val,
        "test": test,
    }


@pytest.mark.parametrize(
    ("stage", "state_dict_type", "optimizer", "precision", "link_last"),
    [
        (1, "sharded", "adamw", "32-true", False),
        (2, "sharded", "sgd", "32-true", True),
        pytest.param(3, "sharded", "adamw", "32-true", False, marks=pytest.mark.quick),
        (3, "sharded", "adamw", "bf16-mixed", False),
        (3, "full", "sgd", "32-true", True),
    ],
)
def test_resume_equals_uninterrupted_run_bit_for_bit(
    stage: int, state_dict_type: str, optimizer: str, precision: str, link_last: bool, tmp_path: Path
) -> None:
    kwargs = {
        "world_size": 2,
        "stage": stage,
        "state_dict_type": state_dict_type,
        "optimizer": optimizer,
        "precision": precision,
        "link_last": link_last,
        "tmp": str(tmp_path),
    }
    reports = run_ranks("tests.test_checkpoint:resume_exact", 2, kwargs, timeout=300)
    first = reports[0]
    assert first["state"] and first["differences"] == [], first["differences"]  # weights, moments, steps
    # per-rank side state: each rank resumed with its own token sum (rank 0's would be wrong on rank 1)
    assert reports[0]["tally"][1] != reports[1]["tally"][1]
    for report in reports:
        assert report["resumed_tally"] == report["tally"], report
    # ModelCheckpoint: epoch 0 was written, then removed when epoch 1 scored better; best and last remain
    best, last = Path(first["best"]), Path(first["last"])
    assert best.name.startswith("epoch=1") and last.name == "last.ckpt"
    assert any(name.startswith("epoch=0") for name in first["listing_epoch_1"])
    names = complete_checkpoints(tmp_path / "ckpts")
    assert names == {best.name: True, last.name: True}, names  # nothing else: no leftovers, no epoch 0
    assert (shards_of(best) is not None, shards_of(last) is not None) == ((state_dict_type == "sharded",) * 2)
    assert last.is_symlink() == link_last and Path(first["resumed_from"]) == last
    # validate / test from the best checkpoint on a fresh model: exactly the score it was chosen by
    for report in reports:
        assert report["val"] == report["best_score"] and report["test"] == report["best_score"]
    # either format's path is a torch file that Lightning loads strictly without the strategy
    plain = TinyGPT.load_from_checkpoint(tmp_path / "explicit.ckpt", map_location="cpu")
    assert set(plain.state_dict()) == set(first["state"])


# ---- buffers: per-rank side state that the strategy itself knows how to reshard ----


class BuffersAtStart(Callback):
    buffers: dict[str, Tensor] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        BuffersAtStart.buffers = {k: v.detach().clone() for k, v in pl_module.named_buffers()}


def _fit_cnn(world_size: int, epochs: int, seed: int, ckpt_path: str | None = None) -> L.Trainer:
    torch.manual_seed(seed)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=ShardLabStrategy(stage=2),
        max_epochs=epochs,
        enable_checkpointing=False,
        limit_val_batches=0,
        callbacks=[BuffersAtStart()],
        **QUIET,
    )
    trainer.fit(TinyCNN(), OrderedData(image_dataset(12), 6 // world_size), ckpt_path=ckpt_path)
    return trainer


def batchnorm_save_and_resume(tmp: str) -> dict:
    trainer = _fit_cnn(2, 1, seed=0)
    trainer.save_checkpoint(Path(tmp) / "bn")
    saved = {k: v.detach().clone() for k, v in trainer.lightning_module.named_buffers()}
    _fit_cnn(2, 2, seed=1, ckpt_path=str(Path(tmp) / "bn"))
    return {"saved": saved, "loaded": BuffersAtStart.buffers}


def batchnorm_load(tmp: str) -> dict:
    _fit_cnn(1, 2, seed=1, ckpt_path=str(Path(tmp) / "bn"))
    return {"loaded": BuffersAtStart.buffers}


def test_batchnorm_statistics_are_kept_per_rank(tmp_path: Path) -> None:
    """Each rank's BatchNorm statistics drift apart between the buffer broadcasts of training steps: a
    checkpoint keeps every rank's, gives each its own back on the same world size, and rank 0's (what the
    next step would broadcast) on another, because the run broadcast buffers."""
    two = run_ranks("tests.test_checkpoint:batchnorm_save_and_resume", 2, {"tmp": str(tmp_path)}, timeout=180)
    assert differences(two[0]["saved"]["blocks.0.bn.running_mean"], two[1]["saved"]["blocks.0.bn.running_mean"])
    for report in two:
        assert differences(report["loaded"], report["saved"]) == []
    rank_state = describe(tmp_path / "bn")["rank_state"]
    assert "checkpoint['state_dict']['blocks.0.bn.running_mean']" in rank_state
    assert not any("num_batches_tracked" in entry for entry in rank_state)  # the same on every rank
    (one,) = run_ranks("tests.test_checkpoint:batchnorm_load", 1, {"tmp": str(tmp_path)}, timeout=120)
    assert differences(one["loaded"], two[0]["saved"]) == []
