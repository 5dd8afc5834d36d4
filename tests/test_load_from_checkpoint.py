"""``MyModule.load_from_checkpoint(trainer.checkpoint_callback.best_model_path)`` in a plain process, on what shardlab
writes by default, as Lightning users take a model out of training.

One 2-rank job fits the same TinyGPT (tied embeddings, hyperparameters saved) on the same batches under Lightning
``ddp`` and under shardlab at stages 1, 2 and 3, at stage 3 under bf16-mixed with ShardLabEMA, and with hybrid
sharding (two replica groups of one rank: only the first writes), with ``ModelCheckpoint(save_top_k=1,
save_last="link")``. No save gathers a parameter (``gather_full`` raises while saving). Then, in this process (no
process group, no strategy), ``TinyGPT.load_from_checkpoint`` of each best and last checkpoint gives DDP's weights
and hyperparameters, exactly the shards' values (read back by ``consolidated_checkpoint``, which reads only the
shards), with ``map_location`` and ``strict`` meaning what Lightning documents.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from unittest import mock

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.testing import assert_close

from lightning_shardlab import ShardLabEMA, ShardLabStrategy
from lightning_shardlab.checkpoint.consolidate import consolidated_checkpoint
from lightning_shardlab.checkpoint.format import shards_of
from lightning_shardlab.sharding.sharded_model import ShardedModel
from tests.helpers.launch import run_ranks
from tests.helpers.reference import FP32
from tests.models import OrderedData, TinyGPT, token_dataset

RUNS: dict[str, dict[str, Any]] = {
    "ddp": {},
    "stage 1": {"stage": 1},
    "stage 2": {"stage": 2},
    "stage 3": {"stage": 3},
    "stage 3 bf16-mixed ema": {"stage": 3},
    "stage 3 two replica groups": {"stage": 3, "shard_group_size": 1},
}


def _fit(name: str, tmp: Path) -> dict[str, Any]:
    torch.manual_seed(0)
    saver = ModelCheckpoint(dirpath=tmp / name, monitor="val_loss", save_top_k=1, save_last="link")
    callbacks: list[L.Callback] = [saver] + ([ShardLabEMA(decay=0.8)] if "ema" in name else [])
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp" if name == "ddp" else ShardLabStrategy(**RUNS[name]),
        precision="bf16-mixed" if "bf16" in name else "32-true",
        max_epochs=2,
        limit_val_batches=2,
        callbacks=callbacks,
        use_distributed_sampler=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = TinyGPT(n_embd=24, lr=1e-2)
    trainer.fit(model, OrderedData(token_dataset(16), 2))
    return {"best": saver.best_model_path, "last": saver.last_model_path}


def _no_gather(*args: Any, **kwargs: Any) -> None:
    raise AssertionError("a sharded save gathered a parameter")


def fit_everywhere(tmp: str) -> dict[str, Any]:
    with mock.patch.object(ShardedModel, "gather_full", _no_gather):  # stage 1-2 training gathers no flat param
        return {name: _fit(name, Path(tmp)) for name in RUNS}


class WithExtra(TinyGPT):
    """TinyGPT and one parameter more, which no checkpoint of TinyGPT holds."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.extra = nn.Parameter(torch.ones(3))


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("load_from_checkpoint")
    return run_ranks("tests.test_load_from_checkpoint:fit_everywhere", 2, {"tmp": str(tmp)}, timeout=300)[0]


def test_load_from_checkpoint_in_a_plain_process_gives_ddps_weights_at_every_stage(saved: dict[str, Any]) -> None:
    assert not torch.distributed.is_initialized()
    ddp = TinyGPT.load_from_checkpoint(saved["ddp"]["best"], map_location="cpu")
    for name, paths in saved.items():
        if name == "ddp":
            continue
        best, last = Path(paths["best"]), Path(paths["last"])
        assert shards_of(best) is not None and last.is_symlink(), name  # sharded, and save_last="link" works
        assert best.name == Path(saved["ddp"]["best"]).name, name  # the same epoch was the best
        model = TinyGPT.load_from_checkpoint(best, map_location="cpu")  # strict, Lightning's default
        assert dict(model.hparams) == dict(ddp.hparams), name
        assert model.lm_head.weight is model.wte.weight  # tied, as the class ties them
        state = model.state_dict()
        assert list(state) == list(ddp.state_dict()), name
        for key, value in ddp.state_dict().items():
            if "bf16" not in name:  # (bf16-mixed against DDP's: tests/test_mixed_precision.py)
                assert_close(state[key], value, **FP32, msg=lambda m, k=key: f"{name} {k}: {m}")
        # exactly the masters the shards hold (consolidated_checkpoint reads nothing but the shards)
        from_shards = consolidated_checkpoint(best)
        assert all(torch.equal(state[k], v) for k, v in from_shards["state_dict"].items()), name
        raw = torch.load(best, weights_only=True)
        assert "optimizer_states" not in raw and raw["epoch"] == from_shards["epoch"], name
        if "ema" in name:  # the averaged weights too, under the key a full checkpoint keeps them
            ema = from_shards["ema_state_dict"]
            assert all(torch.equal(raw["ema_state_dict"][k], v) for k, v in ema.items()), name
            assert not torch.equal(ema["wte.weight"], raw["state_dict"]["wte.weight"])
        # the link to the last checkpoint loads too
        assert set(TinyGPT.load_from_checkpoint(last).state_dict()) == set(state), name


def test_map_location_and_strict_mean_what_lightning_says(saved: dict[str, Any]) -> None:
    best = saved["stage 3"]["best"]
    seen: list[str] = []

    def where(storage: torch.UntypedStorage, location: str) -> torch.UntypedStorage:
        seen.append(location)
        return storage

    moved = TinyGPT.load_from_checkpoint(best, map_location=where)  # every storage passes through it
    assert seen and set(seen) == {"cpu"} and all(p.device.type == "cpu" for p in moved.parameters())
    on_meta = torch.load(best, map_location="meta", weights_only=True)  # what Lightning's loader hands on
    assert {t.device.type for t in on_meta["state_dict"].values()} == {"meta"}
    with pytest.raises(RuntimeError, match="Missing key.*extra"):
        WithExtra.load_from_checkpoint(best)
    loose = WithExtra.load_from_checkpoint(best, strict=False)
    assert torch.equal(loose.extra, torch.ones(3)) and torch.equal(loose.wte.weight, moved.wte.weight)
