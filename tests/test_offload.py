"""Offload: ``offload='disk'`` against ``offload='none'``, bit for bit, and what it takes off the process.

One 2-rank run serves the matrix: stages 1, 2 and 3, each with AdamW and SGD with momentum (fp32, OddNet) and
with AdamW under bf16-mixed (GroupedGPT: tied embedding, a frozen block, two param groups, a warm-up), each
trained 10 steps with and without disk offload from the same weights on the same batches: every loss and
the final weights equal bit for bit. In the same runs: the optimizer state and the masters that move live in
the tier's files (and only they), the files hold what the layout needs, ``offload_dir`` holds no file once
training ends, and the budget names each category's tier. The stage 3 AdamW run saves a checkpoint after 5
steps; resumed with disk offload, and without it, each ends on the uninterrupted run's weights bit for bit
(and resumed at stage 1 with disk offload, on them at fp32 tolerance).
Fabric's front door (stage 3, micro-batches, clipping, a LambdaLR made after setup) equals its run without
offload bit for bit too.

A second pair of runs (a 33M-parameter stack built on the meta device, stage 3, AdamW) measures the process:
anonymous resident memory (RssAnon) drops by at least 80 % of the offloaded bytes, and under a cap on the
process's private memory (RLIMIT_DATA) that the run without offload cannot fit in, the offloaded run trains.
"""

from __future__ import annotations

import copy
import gc
import io
import os
import resource
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from rich.console import Console
from torch import nn
from torch.testing import assert_close

from lightning_shardlab import Comm, ShardLabBudget, ShardLabConfig, ShardLabStrategy, shard_model, shard_optimizer
from lightning_shardlab import fabric as shardlab_fabric
from lightning_shardlab.offload import setup_offload
from tests.helpers.launch import run_ranks
from tests.helpers.reference import FP32
from tests.models import GroupedGPT, OrderedData, RegressionNet, WideBlocks, regression_dataset, token_dataset
from tests.test_checkpoint import QUIET
from tests.test_fabric import QUIET as FABRIC_QUIET
from tests.test_fabric import _batches as fabric_batches
from tests.test_fabric import _objects as fabric_objects
from tests.test_fabric import _train as fabric_train

STEPS, GLOBAL_BATCH, WORLD = 5, 8, 2  # per epoch; two epochs: 10 steps
SLACK = 1.25  # storage I/O per step, measured, over the files' pages: writing them twice would be 2
RECIPES = {
    "adamw": (lambda: RegressionNet("adamw"), "32-true"),
    "sgd momentum": (lambda: RegressionNet("sgd"), "32-true"),
    "bf16-mixed adamw": (GroupedGPT, "bf16-mixed"),
}


class Tiers(Callback):
    """After each step: which tensors live in the tier's files, and whether offload_dir holds files."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.seen: list[dict[str, Any]] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        sharded = trainer.strategy.sharded
        offload = sharded.offload
        optimizer = trainer.optimizers[0]
        state = [t for s in optimizer.state.values() for k, t in s.items() if k != "step" and t.numel()]
        self.seen.append(
            {
                "state_in_files": all(offload.holds(t) for t in state) and bool(state),
                "masters_in_files": [offload.holds(fp.master) for fp in sharded.flat_params],
                "moves": [offload.moves_master(fp) for fp in sharded.flat_params],
                "file_bytes": offload.files.nbytes,
                "page_bytes": offload.files.page_bytes,
                "allocated": offload.files.allocated_bytes,
            }
        )


def _fit(name: str, stage: int, offload: str, tmp: str, callbacks: list, **kwargs: Any) -> L.Trainer:
    model_fn, precision = RECIPES[name]
    data = token_dataset(GLOBAL_BATCH * STEPS) if "bf16" in name else regression_dataset(GLOBAL_BATCH * STEPS)
    model = kwargs.pop("model")
    strategy = ShardLabStrategy(stage=stage, offload=offload, offload_dir=f"{tmp}/offload", unit_bucket_params=0)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=strategy,
        precision=precision,
        max_epochs=2,
        enable_checkpointing=False,
        callbacks=callbacks,
        default_root_dir=tmp,
        **QUIET,
    )
    trainer.fit(model, OrderedData(data, GLOBAL_BATCH // WORLD), **kwargs)
    return trainer


class SaveAfterFirstEpoch(Callback):
    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_epoch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.current_epoch == 0:
            trainer.save_checkpoint(self.path)


def _fabric_run(offload: str, tmp: str) -> dict:
    """Fabric's front door, stage 3: TinyGPT, AdamW, a LambdaLR made after setup, micro-batches, clipping."""
    strategy = shardlab_fabric.ShardLabStrategy(stage=3, offload=offload, offload_dir=f"{tmp}/offload")
    fabric = L.Fabric(devices=WORLD, strategy=strategy, **FABRIC_QUIET)
    fabric.launch()
    model, optimizers, schedules = fabric_objects(fabric, 3, "tiny_gpt")
    batches = fabric_batches(WORLD, fabric.global_rank)
    record = fabric_train(fabric, model, optimizers, schedules, batches, range(4), "tiny_gpt")
    return {**record, "weights": fabric.strategy.full_state_dict(model)}


def offload_matrix(tmp: str) -> dict:
    os.makedirs(f"{tmp}/offload", exist_ok=True)
    out: dict[str, Any] = {}
    for name, (model_fn, _) in RECIPES.items():
        torch.manual_seed(0)
        initial = model_fn()
        for stage in (1, 2, 3):
            runs = {}
            for offload in ("none", "disk"):
                model, tiers = copy.deepcopy(initial), Tiers(f"{tmp}/offload")
                save = stage == 3 and name == "adamw" and offload == "disk"
                budget = ShardLabBudget(console=Console(file=io.StringIO()))
                callbacks = [tiers, budget] if offload == "disk" else []
                callbacks += [SaveAfterFirstEpoch(f"{tmp}/ckpt")] if save else []
                trainer = _fit(name, stage, offload, tmp, callbacks, model=model)
                runs[offload] = {
                    "losses": torch.stack(model.losses),
                    "state": trainer.strategy.full_state_dict(),
                    "tiers": tiers.seen if offload == "disk" else None,
                    "budget": budget.reports[trainer.global_rank] if offload == "disk" else None,
                    "listed_after": sorted(os.listdir(f"{tmp}/offload")),
                }
            out[f"{name}, stage {stage}"] = runs
        if name == "adamw":
            out["fabric"] = {offload: _fabric_run(offload, tmp) for offload in ("none", "disk")}
            for stage, offload in ((3, "disk"), (3, "none"), (1, "disk")):
                model = copy.deepcopy(initial)
                _fit(name, stage, offload, tmp, [], model=model, ckpt_path=f"{tmp}/ckpt")
                out[f"resumed at stage {stage}, {offload}"] = model.trainer.strategy.full_state_dict()
    return out


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_disk_offload_equals_no_offload_bit_for_bit_and_keeps_the_state_in_files(tmp_path: Path) -> None:
    results = run_ranks("tests.test_offload:offload_matrix", WORLD, {"tmp": str(tmp_path)}, timeout=400)
    for rank, out in enumerate(results):
        for label in (k for k in out if "stage" in k and not k.startswith("resumed")):
            none, disk = out[label]["none"], out[label]["disk"]
            assert torch.equal(none["losses"], disk["losses"]), (rank, label)
            assert _same(none["state"], disk["state"]), (rank, label)
            assert len(disk["losses"]) == 2 * STEPS
            for seen in disk["tiers"]:
                assert seen["state_in_files"], (rank, label)
                assert seen["masters_in_files"] == seen["moves"], (rank, label)  # the masters that move, only
                assert seen["allocated"] >= seen["file_bytes"] > 0, (rank, label, seen)  # blocks reserved on disk
            mixed = "bf16" in label
            assert any(disk["tiers"][0]["moves"]) == mixed, label  # fp32: the master is the compute shard
            assert disk["listed_after"] == [], label
            budget = disk["budget"]
            assert budget["locations_measured"] == budget["locations_predicted"], (rank, label, budget)
            # every page of every file is written back once a step, and read back at most once. The count is the
            # kernel's (/proc/self/io, charged when a clean page is dirtied), so a page its flusher writes back
            # between two of the optimizer's passes over it is charged twice: a few pages above, never a second
            # write-back of the files (CI once measured one page more in 9 steps).
            io, pages = budget["storage_io_per_step"], disk["tiers"][-1]["page_bytes"]
            assert pages <= io["written"] <= SLACK * pages, (rank, label, io, pages)
            assert io["read"] <= SLACK * pages, (rank, label, io, pages)
            assert budget["tier_moves_predicted_per_step"]["down"] == disk["tiers"][-1]["file_bytes"], (rank, label)
        fabric = out["fabric"]
        assert (
            fabric["none"]["losses"] == fabric["disk"]["losses"] and fabric["none"]["norms"] == fabric["disk"]["norms"]
        )
        assert _same(fabric["none"]["weights"], fabric["disk"]["weights"]), rank
        uninterrupted = out["adamw, stage 3"]["disk"]["state"]
        assert _same(out["resumed at stage 3, disk"], uninterrupted), rank
        assert _same(out["resumed at stage 3, none"], uninterrupted), rank
        resharded = out["resumed at stage 1, disk"]  # stage 1 sums its reductions in another order: fp32 tolerance
        assert resharded.keys() == uninterrupted.keys()
        for key in resharded:
            assert_close(resharded[key], uninterrupted[key], **FP32, msg=key)


# ---- what offload takes off the process: a 33M-parameter stack, stage 3, fp32 AdamW ----

WIDE = {"width": 1024, "depth": 16}  # 16 blocks of 2.1M parameters, built on the meta device at setup


def _status(field: str) -> int:
    """Bytes of ``field`` (RssAnon: anonymous resident memory; VmData: private writable address space)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


class Memory(Callback):
    """Measures the process; with ``cap``, limits its private memory (RLIMIT_DATA) to what it holds when setup
    starts (torch, Lightning, the process group: no model yet) plus ``cap`` bytes."""

    def __init__(self, cap: int | None) -> None:
        self.cap, self.rss_anon, self.vm_data = cap, [], []

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.baseline = _status("VmData")
        if self.cap is not None:
            resource.setrlimit(resource.RLIMIT_DATA, (self.baseline + self.cap, resource.RLIM_INFINITY))

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.rss_anon.append(_status("RssAnon"))
        self.vm_data.append(_status("VmData") - self.baseline)


def memory_run(tmp: str, offload: str, cap: int | None = None) -> dict:
    os.makedirs(f"{tmp}/offload", exist_ok=True)
    torch.manual_seed(0)
    memory = Memory(cap)
    strategy = ShardLabStrategy(stage=3, offload=offload, offload_dir=f"{tmp}/offload")
    trainer = L.Trainer(
        accelerator="cpu", devices=WORLD, strategy=strategy, max_steps=3, callbacks=[memory],
        enable_checkpointing=False, default_root_dir=tmp, **QUIET,
    )  # fmt: skip
    trainer.fit(WideBlocks(**WIDE), OrderedData(regression_dataset(GLOBAL_BATCH * 3), GLOBAL_BATCH // WORLD))
    offload_ = trainer.strategy.sharded.offload
    return {
        "rss_anon": memory.rss_anon,
        "vm_data": memory.vm_data,
        "offloaded": offload_.files.nbytes if offload_ is not None else 0,
    }


CAP = 200 * 2**20  # private memory allowed past the baseline: less than stage 3 holds without offload here
EXACT_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536"}  # glibc unmaps freed blocks at once: memory shows what lives


def plain_then_disk(tmp: str) -> tuple[dict, dict]:
    """``memory_run`` without offload, then with disk offload under ``CAP`` in the same processes: whatever the first
    run leaves resident counts against the second (its drop from the first is only smaller for it)."""
    environ = dict(os.environ)
    plain = memory_run(f"{tmp}/none", "none")
    os.environ.update(environ)  # as the kept world's worker does between jobs: the fit's teardown drops some
    gc.collect()
    return plain, memory_run(f"{tmp}/disk", "disk", CAP)


def test_disk_offload_takes_the_state_off_the_process_and_trains_under_a_memory_cap(tmp_path: Path) -> None:
    runs = run_ranks("tests.test_offload:plain_then_disk", WORLD, {"tmp": str(tmp_path)}, timeout=300, env=EXACT_MALLOC)
    for rank, (none, disk) in enumerate(runs):
        state = 8 * (16 * 2 * (1024 * 1024 + 1024) + 7 * 1024 + 1024 + 2 * 1024 + 3 * 1024 + 3) // WORLD
        assert abs(disk["offloaded"] - state) < 4096 * 40, (disk["offloaded"], state)  # AdamW's 8 B per element
        assert len(disk["rss_anon"]) == 3 and min(none["vm_data"]) > CAP, none  # without offload: over the cap
        drop = none["rss_anon"][-1] - disk["rss_anon"][-1]
        assert drop >= 0.8 * disk["offloaded"], (rank, drop, disk["offloaded"])


# ---- the engine's own loop, one process: what the chunked step refuses ----


def _plain_loop(offload: str, directory: Path, steps: int = 3) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
    config = ShardLabConfig(stage=1, offload=offload, offload_dir=str(directory))
    sharded = shard_model(module, config, Comm(rank=0, world_size=1, device=torch.device("cpu")))
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    shard_optimizer(optimizer, sharded)
    setup_offload(sharded, [optimizer], config, local_ranks=1)
    x, y = torch.randn(4, 5, generator=torch.Generator().manual_seed(1)), torch.randn(4, 3)
    for _ in range(steps):
        torch.nn.functional.mse_loss(module(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return module, optimizer


def test_the_chunked_step_refuses_what_it_would_silently_skip(tmp_path: Path) -> None:
    plain, _ = _plain_loop("none", tmp_path)
    offloaded, optimizer = _plain_loop("disk", tmp_path)
    assert type(optimizer).__name__ == "SGD" and isinstance(optimizer, torch.optim.SGD)  # its own name kept
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), offloaded.parameters()))
    with pytest.raises(ValueError, match="the added param group of SGD holds a tensor of shape \\(3,\\)"):
        optimizer.add_param_group({"params": [nn.Parameter(torch.zeros(3))]})  # refused at once, not skipped
    module = nn.Linear(2, 2)
    config = ShardLabConfig(offload="disk", offload_dir=str(tmp_path))
    sharded = shard_model(module, config, Comm(rank=0, world_size=1, device=torch.device("cpu")))
    replaced = torch.optim.SGD(module.parameters(), lr=0.1)
    shard_optimizer(replaced, sharded)
    replaced.step = lambda closure=None: None  # e.g. a monkeypatch of the user's: chunks would bypass it
    with pytest.raises(ValueError, match="SGD.step was replaced on the optimizer itself"):
        setup_offload(sharded, [replaced], config, local_ranks=1)
