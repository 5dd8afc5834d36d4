"""Models larger than a rank: built on the meta device, materialised a module at a time."""

from __future__ import annotations

import gc
import json
import os
import resource
from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_shardlab import ShardLabStrategy
from tests.helpers.launch import run_ranks
from tests.models import OrderedData, WideBlocks, regression_dataset

QUIET = dict(
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    use_distributed_sampler=False,
    num_sanity_val_steps=0,
)


class Probe(WideBlocks):
    def configure_model(self) -> None:
        super().configure_model()
        self.built_on_meta = all(p.is_meta for p in self.parameters())


def eager_equals_meta(world_size: int, stage: int) -> dict:
    """configure_model under the strategy builds on meta; setup materialises; values = eager from the same seed."""
    L.seed_everything(7, verbose=False)
    model = Probe(width=24, depth=3)
    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=ShardLabStrategy(stage=stage), **QUIET)
    trainer.validate(model, OrderedData(regression_dataset(4 * world_size), 2), verbose=False)
    state = trainer.strategy.full_state_dict()
    torch.manual_seed(7)
    eager = WideBlocks(width=24, depth=3)
    eager.configure_model()
    if trainer.global_rank != 0:
        return {}
    assert model.built_on_meta
    return {
        "equal": {k: torch.equal(v, state[k]) for k, v in eager.state_dict().items()},
        "keys": sorted(state) == sorted(eager.state_dict()),
    }


@pytest.mark.parametrize("stage", [1, 3])
def test_meta_init_equals_an_eager_init_from_the_same_seed(stage: int) -> None:
    report = run_ranks("tests.test_meta_init:eager_equals_meta", 2, {"world_size": 2, "stage": stage}, timeout=120)[0]
    assert report["keys"] and report["equal"] and all(report["equal"].values()), report["equal"]


def vm_data() -> int:
    """Bytes of this process's private data mappings: what RLIMIT_DATA caps (heap and anonymous mmaps)."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmData"))


# glibc: one arena and a fixed mmap threshold, so freed tensors go back to the system and VmData follows
# the tensors alive instead of the allocator's high-water mark
MALLOC = {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}
CAP_MB = 250


def train_under_cap(stage: int, width: int = 1280, depth: int = 8) -> dict:
    """Cap this process's data memory at what it uses before fit + CAP_MB, then build and train the model."""
    world = int(os.environ["WORLD_SIZE"])
    L.seed_everything(0, verbose=False)
    model = WideBlocks(width=width, depth=depth)  # shapes only: configure_model runs inside fit, on meta
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=ShardLabStrategy(stage=stage),
        max_steps=2,
        limit_val_batches=0,
        **QUIET,
    )
    cap = vm_data() + CAP_MB * 2**20
    resource.setrlimit(resource.RLIMIT_DATA, (cap, resource.getrlimit(resource.RLIMIT_DATA)[1]))
    trainer.fit(model, OrderedData(regression_dataset(2 * 4 * world), 4))
    resource.setrlimit(resource.RLIMIT_DATA, (resource.getrlimit(resource.RLIMIT_DATA)[1],) * 2)  # the cap lifted
    return {"params": sum(p.numel() for p in model.parameters()), "steps": trainer.global_step}


def stage_3_then_stage_1(out: str) -> None:
    """``train_under_cap`` at stage 3, its report written to ``out/rank{RANK}.json``, then at stage 1 in the same
    processes (each under its own cap: what it uses before its fit + CAP_MB)."""
    environ = dict(os.environ)
    report = train_under_cap(3)
    os.environ.update(environ)  # as the kept world's worker does between jobs: the fit's teardown drops some
    Path(out, f"rank{os.environ['RANK']}.json").write_text(json.dumps(report))
    torch.distributed.barrier()  # every rank's report is written before any rank can fail
    gc.collect()
    train_under_cap(1)


def test_a_model_larger_than_the_cap_trains_at_stage_3_and_not_at_stage_1(tmp_path: Path) -> None:
    """One launch: stage 3 trains its 2 steps under the cap on every rank, then stage 1 runs out of memory."""
    with pytest.raises(AssertionError, match="can't allocate memory|out of memory|MemoryError"):
        run_ranks("tests.test_meta_init:stage_3_then_stage_1", 4, {"out": str(tmp_path)}, timeout=300, env=MALLOC)
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(4)]
    assert all(report["steps"] == 2 for report in reports), reports  # stage 3 trained under the cap
    full_adamw_state = 16 * reports[0]["params"]  # fp32: 4 B weights + 4 B grads + 8 B moments
    assert full_adamw_state > 1.5 * CAP_MB * 2**20  # the whole state is well over the cap
