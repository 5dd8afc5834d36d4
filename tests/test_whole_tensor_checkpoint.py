"""Whole-tensor optimizers' state in checkpoints: saved by each owner, resumed at another world size and stage.

Muon with AdamW (manual optimisation, two optimizers) and Adafactor alone, on the same global batches:

    2 ranks, stage 3, 2 epochs                         the uninterrupted run
    2 ranks, stage 3, 1 epoch -> saved (sharded)       its owners write owned-r-of-2.pt
    2 ranks, stage 2, resumed to epoch 2               the same reduction order as the uninterrupted run
    4 ranks, stage 2, resumed to epoch 2               owners assigned again, each reads what it owns now

Resumed at 2 ranks, the run ends on the uninterrupted one's weights and optimizer state within fp32's tolerance;
at 4 ranks Adafactor does too, and Muon (bf16 inside) within a bound said in ``_continues``. The saved checkpoint
consolidates into the torch format (each Muon matrix's momentum whole, Adafactor's row and column statistics),
and loads back at 4 ranks with the state each owner held at save time.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.testing import assert_close

from lightning_shardlab import ShardLabStrategy
from lightning_shardlab.checkpoint.consolidate import consolidated_checkpoint
from lightning_shardlab.checkpoint.describe import describe, render
from lightning_shardlab.checkpoint.format import shards_of
from tests.helpers.launch import run_ranks
from tests.helpers.reference import FP32
from tests.models import AdafactorGPT, MuonGPT, OrderedData, token_dataset
from tests.test_checkpoint import QUIET, snapshot

GLOBAL_BATCH, STEPS_PER_EPOCH = 12, 3
MUON_DRIFT = 0.1  # see _continues
MODELS = {"muon": MuonGPT, "adafactor": AdafactorGPT}


class AtStart(L.Callback):
    """The unsharded optimizer state as training starts (after a checkpoint was loaded)."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.at_start = snapshot(trainer)


def _fit(name: str, world_size: int, stage: int, epochs: int, ckpt: str | None = None) -> tuple[L.Trainer, AtStart]:
    torch.manual_seed(0 if ckpt is None else world_size)  # other initial weights when resuming: the checkpoint wins
    start = AtStart()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=ShardLabStrategy(stage=stage),
        max_epochs=epochs,
        enable_checkpointing=False,
        limit_val_batches=0,
        callbacks=[start],
        **QUIET,
    )
    data = OrderedData(token_dataset(GLOBAL_BATCH * STEPS_PER_EPOCH), GLOBAL_BATCH // world_size)
    trainer.fit(MODELS[name](), data, ckpt_path=ckpt)
    return trainer, start


def save_at_two(tmp: str) -> dict[str, Any]:
    """The uninterrupted runs, the first epochs saved, and each resumed at the same world size (stage 2)."""
    out: dict[str, Any] = {}
    for name in MODELS:
        whole, _ = _fit(name, 2, 3, 2)
        first, _ = _fit(name, 2, 3, 1)
        first.save_checkpoint(Path(tmp) / name)
        resumed, _ = _fit(name, 2, 2, 2, ckpt=str(Path(tmp) / name))
        out[name] = {"whole": snapshot(whole), "saved": snapshot(first), "resumed": snapshot(resumed)}
    return out


def resume_at_four(tmp: str) -> dict[str, Any]:
    out: dict[str, Any] = {"rank": int(os.environ["RANK"])}
    for name in MODELS:
        trainer, start = _fit(name, 4, 2, 2, ckpt=str(Path(tmp) / name))
        out[name] = {"loaded": start.at_start, "final": snapshot(trainer)}
    return out


def _same_state(actual: dict[str, Any], expected: dict[str, Any], where: str, exact: bool) -> None:
    """Weights and every optimizer's state: bit for bit (``exact``) or within fp32 tolerance."""

    def compare(got: Any, want: Any, msg: str) -> None:
        if exact:
            assert torch.equal(torch.as_tensor(got), torch.as_tensor(want)), msg
        else:
            assert_close(torch.as_tensor(got), torch.as_tensor(want), **FP32, msg=msg)

    assert list(actual["state"]) == list(expected["state"]), where
    for key, value in expected["state"].items():
        compare(actual["state"][key], value, f"{key}: {where}")
    for o, (got, want) in enumerate(zip(actual["optim"], expected["optim"], strict=True)):
        assert sorted(got["state"]) == sorted(want["state"]), f"optimizer {o}: {where}"
        for j, entries in want["state"].items():
            assert sorted(got["state"][j]) == sorted(entries), f"optimizer {o}, parameter {j}: {where}"
            for key, value in entries.items():
                compare(got["state"][j][key], value, f"optimizer {o}, parameter {j}, {key}: {where}")


def test_owned_state_saves_by_owner_and_resumes_at_another_world_size_and_stage(tmp_path: Path) -> None:
    saved = run_ranks("tests.test_whole_tensor_checkpoint:save_at_two", 2, {"tmp": str(tmp_path)}, timeout=300)[0]
    for name in MODELS:
        files = sorted(p.name for p in shards_of(tmp_path / name).iterdir())
        # the owners' files: both ranks own matrices (the plan balances sizes over the world)
        assert "owned-00000-of-00002.pt" in files and "owned-00001-of-00002.pt" in files, files
        full = consolidated_checkpoint(tmp_path / name)
        _same_state(
            {"state": full["state_dict"], "optim": full["optimizer_states"]}, saved[name]["saved"], name, exact=True
        )
        assert "whole on each parameter's owner" in render(describe(tmp_path / name)), name
    muon = consolidated_checkpoint(tmp_path / "muon")["optimizer_states"][0]
    matrices = [p for n, p in MuonGPT().named_parameters() if n.startswith("gpt.blocks.") and p.ndim == 2]
    assert [muon["state"][j]["momentum_buffer"].shape for j in range(len(matrices))] == [p.shape for p in matrices]
    adafactor = consolidated_checkpoint(tmp_path / "adafactor")["optimizer_states"][0]["state"]
    assert any(s["row_var"].ndim == 2 and s["col_var"].ndim == 2 for s in adafactor.values())

    for name in MODELS:
        # resumed at 2 ranks (stage 2): the same world size and reduction order as the uninterrupted run, so
        # the same kernels sum the same numbers and fp32's tolerance holds on any CPU
        _same_state(saved[name]["resumed"], saved[name]["whole"], f"{name}, resumed at 2 ranks", exact=False)

    resumed = run_ranks("tests.test_whole_tensor_checkpoint:resume_at_four", 4, {"tmp": str(tmp_path)}, timeout=300)
    rank0 = next(r for r in resumed if r["rank"] == 0)
    for name in MODELS:
        # loaded at 4 ranks, stage 2: each new owner holds what the old one saved, bit for bit
        _same_state(rank0[name]["loaded"], saved[name]["saved"], f"{name}, loaded", exact=True)
    # Adafactor's step is fp32 throughout: 4 ranks sum the gradients in another order, which moves the last
    # bits of each step and no more, so the resumed run ends on the uninterrupted one within fp32's tolerance
    _same_state(rank0["adafactor"]["final"], saved["adafactor"]["whole"], "adafactor, resumed at 4 ranks", False)
    _continues(rank0["muon"]["final"], saved["muon"], "muon, resumed at 4 ranks")


def _continues(final: dict[str, Any], runs: dict[str, Any], where: str) -> None:
    """The resumed epoch at another world size went where the uninterrupted one went.

    Muon orthogonalises each update in bf16 (Newton-Schulz, 8 significant bits). Another world size sums the
    gradient in another order, and a last-bit difference there can round a bf16 value one step (2^-8 of it)
    the other way; five Newton-Schulz iterations and three steps carry that into every weight. So the bound is
    not fp32's: each weight's distance to the uninterrupted run must be a small fraction (MUON_DRIFT) of how far
    the resumed epoch moved it. Measured: 0.010-0.024 of it under ATEN_CPU_CAPABILITY=default, whose kernels
    differ most from the saved run's, and 0.20-0.49 for a resume that lost Muon's momentum (the same steps in
    one process with the state cleared), so 0.1 tells them apart on any CPU.
    """
    for key, want in runs["whole"]["state"].items():
        moved = (want - runs["saved"]["state"][key]).abs().max().item()
        missed = (final["state"][key] - want).abs().max().item()
        assert missed <= MUON_DRIFT * moved + FP32["atol"], f"{key}: {where} missed by {missed:.2e}, moved {moved:.2e}"
