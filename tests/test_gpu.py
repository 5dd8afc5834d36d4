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
