"""The CUDA paths: NCCL with one rank per GPU, ranks sharing one GPU through gloo, and offload='cpu'.

Marked ``gpu``: skipped, with that reason, on machines without CUDA (see conftest.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.launch import free_port, run_commands, run_ranks

pytestmark = pytest.mark.gpu


def test_one_rank_on_one_gpu_matches_the_reference() -> None:
    (report,) = run_ranks("tests.test_trainer:gpt_parity", 1, {"world_size": 1, "accelerator": "cuda"}, timeout=300)
    assert report["world_size"] == 1


def test_two_ranks_sharing_one_gpu_pass_stage3_parity(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    run_commands(
        [[sys.executable, "-m", "tests.test_launchers", "proxy_cuda", str(out)]],
        timeout=300,
        env={"MASTER_PORT": str(free_port())},
    )
    assert json.loads(out.read_text())["world_size"] == 2


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL with one rank per GPU needs 2 GPUs")
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_nccl_one_rank_per_gpu_matches_the_reference(stage: int) -> None:
    run_ranks("tests.test_trainer:gpt_parity", 2, {"world_size": 2, "stage": stage, "accelerator": "cuda"}, timeout=300)


@pytest.mark.parametrize("ranks", [1, 2], ids=["one rank", "two ranks sharing the GPU"])
def test_cpu_offload_on_a_gpu_matches_the_reference(ranks: int) -> None:
    """offload='cpu': masters and optimizer state in pinned host memory, the step on the CPU, the compute
    shards copied back; losses and weights still equal the unsharded reference."""
    kwargs = {"world_size": ranks, "accelerator": "cuda", "devices": 1, "offload": "cpu", "ranks_per_device": ranks}
    (report, *_) = run_ranks("tests.test_trainer:gpt_parity", ranks, kwargs, timeout=300)
    assert report["world_size"] == ranks and report["masters_pinned_on_host"]


def time_on_one_gpu(out: str) -> dict:
    """A fit of the tiny GPT on one GPU with ShardLabBudget: what its time side reports."""
    import io

    import lightning as L
    from rich.console import Console

    from lightning_shardlab import ShardLabBudget, ShardLabStrategy
    from tests.models.gpt import OrderedData, TinyGPT, token_dataset

    torch.manual_seed(0)
    budget = ShardLabBudget(Console(file=io.StringIO()))
    trainer = L.Trainer(
        accelerator="cuda", devices=1, strategy=ShardLabStrategy(stage=3, unit_bucket_params=0), max_steps=8,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, default_root_dir=out, callbacks=[budget], limit_val_batches=0,
    )  # fmt: skip
    trainer.fit(TinyGPT(vocab=61, block_size=8, n_layer=3, n_embd=48, n_head=4), OrderedData(token_dataset(16), 1))
    return budget.reports[0]


def test_the_time_side_reads_the_devices_clock_on_a_gpu(tmp_path: Path) -> None:
    """On a GPU the step clock's entries get the device's seconds (CUDA events on the compute stream,
    comm/step_clock.py's DeviceMarks): the parts still add up to the step, and the units computed on it."""
    from lightning_shardlab.budget.measured.step_time import ADDITIVE

    (report,) = run_ranks("tests.test_gpu:time_on_one_gpu", 1, {"out": str(tmp_path)}, timeout=300)
    measured = report["time_measured"]
    assert abs(sum(measured[k] for k in ADDITIVE) - measured["step"]) <= 0.05 * measured["step"], measured
    assert measured["forward"] > 0 and measured["backward"] > 0, measured
    assert {"blocks.0", "blocks.1", "blocks.2"} <= set(report["time_by_unit"]), report["time_by_unit"]
