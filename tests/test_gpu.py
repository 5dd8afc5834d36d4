"""The CUDA paths: NCCL with one rank per GPU, and alone on one GPU with real collectives; ranks sharing one GPU
through gloo (against the unsharded reference, and against Lightning's DDP sharing it too: whole-tensor optimizers,
fp16's loss scale); offload='cpu'; the device's clock; a steady step that makes no synchronising CUDA call.

Marked ``gpu``: skipped, with that reason, on machines without CUDA (see conftest.py).
"""

from __future__ import annotations

import json
import sys
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import lightning as L
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


def every_stage(target: str, **kwargs: Any) -> list[Any]:
    """``target(stage=s, **kwargs)`` for stages 1, 2, 3 in turn, in one launch: what each returned."""
    import importlib

    module, name = target.split(":")
    fn = getattr(importlib.import_module(module), name)
    return [fn(stage=stage, **kwargs) for stage in (1, 2, 3)]


def test_a_2x2_hybrid_layout_of_four_ranks_sharing_one_gpu_matches_the_reference() -> None:
    """Two shard groups of two, four ranks on one device (the proxy: gloo, staged through host memory), stages
    1-3 in one launch."""
    kwargs = {"world_size": 4, "accelerator": "cuda", "devices": 1, "ranks_per_device": 4, "shard_group_size": 2}
    (reports, *_) = run_ranks(
        "tests.test_gpu:every_stage", 4, {"target": "tests.test_trainer:gpt_parity", **kwargs}, timeout=600
    )
    assert all(r["replicas"] == 2 and r["shard_group"] == [0, 1] for r in reports), reports


def test_bf16_mixed_on_two_ranks_sharing_one_gpu_matches_the_same_recipe_and_nears_ddp() -> None:
    """precision="bf16-mixed" through the Trainer on the GPU against the same recipe unsharded (on CPU), and near
    Lightning's DDP in bf16-mixed sharing the GPU too (another recipe: autocast on fp32 weights), stages 1-3 in one
    launch."""
    kwargs = {"target": "tests.test_mixed_precision:trainer_bf16_mixed", "world_size": 2, "accelerator": "cuda"}
    run_ranks("tests.test_gpu:every_stage", 2, kwargs, timeout=600)


def test_muon_and_adafactor_on_two_ranks_sharing_one_gpu_match_ddp_sharing_it() -> None:
    """Whole-tensor optimizers (Muon with AdamW, Adafactor) at stages 1-3 against Lightning's DDP, both with two
    ranks on the GPU (DDP's over gloo with CUDA tensors, its gradients averaged in shardlab's order): losses and
    gradient norms to fp32 tolerance, weights bit for bit, each matrix orthogonalised once per batch in the world."""
    kwargs = {"world_size": 2, "stages": [1, 2, 3], "names": ["muon_adamw_manual", "adafactor"]}
    reports = run_ranks(
        "tests.test_ddp_parity:ddp_parity", 2, {**kwargs, "accelerator": "cuda", "ranks_per_device": 2}, timeout=600
    )
    for stage in (1, 2, 3):
        counts = [report[("muon_adamw_manual", f"stage {stage}")][1] for report in reports]
        assert sum(counts) == 12 * 6 and all(counts), (stage, counts)


def test_fp16_on_two_ranks_sharing_one_gpu_skips_and_scales_as_ddp_sharing_it(tmp_path: Path) -> None:
    """16-mixed with CUDA's GradScaler at stages 1-3 against Lightning's DDP, both with two ranks on the GPU: an
    overflow on one rank skips the step on both and halves the scale as DDP's does; the weights near DDP's."""
    from tests.test_mixed_precision import check_fp16_against_ddp

    kwargs = {"stages": [1, 2, 3], "tmp": str(tmp_path), "accelerator": "cuda", "ranks_per_device": 2}
    check_fp16_against_ddp(
        run_ranks("tests.test_mixed_precision:fp16_overflow_skips_on_every_rank", 2, kwargs, timeout=300)
    )


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
    trainer.fit(
        TinyGPT(vocab=61, block_size=8, n_layer=3, n_embd=48, n_head=4),
        OrderedData(token_dataset(16, vocab=61, block_size=8), 1),
    )
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


# ---- no host waits in a steady step, and NCCL on one GPU ----


class SyncsPerStep(L.Callback):
    """Per training step: the host reads the engine counted (comm/host_reads.py) and the synchronising CUDA calls
    torch saw (``torch.cuda.set_sync_debug_mode("warn")``), from the batch's start to its end."""

    def __init__(self) -> None:
        self.steps: list[tuple[dict[str, int], list[str]]] = []
        self._catching: Any = None

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        from lightning_shardlab.comm import host_reads

        self._before = Counter(host_reads.READS)
        self._catching = warnings.catch_warnings(record=True)
        self._caught = self._catching.__enter__()
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        from lightning_shardlab.comm import host_reads

        torch.cuda.set_sync_debug_mode("default")
        self._catching.__exit__(None, None, None)
        syncs = [str(w.message) for w in self._caught if "synchroniz" in str(w.message)]
        self.steps.append((dict(host_reads.READS - self._before), syncs))


def syncs_on_one_gpu(out: str) -> list[list[tuple[dict[str, int], list[str]]]]:
    """Stages 1-3 on one GPU with the default options, the budget and the guard (checks every 5 steps)."""
    import io

    from rich.console import Console

    from lightning_shardlab import ShardLabBudget, ShardLabSanity, ShardLabStrategy
    from tests.models.gpt import OrderedData, TinyGPT, token_dataset

    runs = []
    for stage in (1, 2, 3):
        torch.manual_seed(0)
        audit = SyncsPerStep()
        trainer = L.Trainer(
            accelerator="cuda", devices=1, strategy=ShardLabStrategy(stage=stage), max_steps=12, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            use_distributed_sampler=False, default_root_dir=f"{out}/{stage}", limit_val_batches=0,
            callbacks=[audit, ShardLabBudget(Console(file=io.StringIO())), ShardLabSanity(every_n_steps=5)],
        )  # fmt: skip
        trainer.fit(
            TinyGPT(vocab=61, block_size=8, n_layer=2, n_embd=32, n_head=4),
            OrderedData(token_dataset(24, vocab=61, block_size=8), 2),
        )
        runs.append(audit.steps)
    return runs


def test_a_steady_step_on_a_gpu_waits_for_nothing(tmp_path: Path) -> None:
    """Every step after the warm-up in which the engine counted no host read made no synchronising CUDA call,
    by torch's own account; and most steps are such steps (the guard reads at its check steps only)."""
    (runs,) = run_ranks("tests.test_gpu:syncs_on_one_gpu", 1, {"out": str(tmp_path)}, timeout=400)
    for stage, steps in zip((1, 2, 3), runs):
        steady = [(i, syncs) for i, (reads, syncs) in enumerate(steps) if i >= 2 and not reads]
        assert len(steady) >= len(steps) // 2, (stage, steps)
        assert all(not syncs for _, syncs in steady), (stage, [s for s in steady if s[1]][:2])


def nccl_alone() -> dict[str, bool]:
    """A world of one rank on an NCCL group that issues real collectives (the engine skips them at world size 1):
    the transports' all-gather and reduce-scatter, and the header exchange NCCL's verification launches beside
    each call on the gloo twin (comm/verify.py), none of them a host wait."""
    import torch.distributed as dist

    from lightning_shardlab.comm.call import CollectiveCall
    from lightning_shardlab.comm.ledger import Ledger
    from lightning_shardlab.comm.transport import Builtin
    from lightning_shardlab.comm.verify import HeaderExchange, Headers

    device = torch.device("cuda", 0)
    if not dist.is_initialized():
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
    nccl = dist.new_group(backend="nccl")
    exchange = HeaderExchange.open(Headers(0, 1), twin=dist.new_group(backend="gloo"), deferred=True)
    shard = torch.arange(8.0, device=device)
    gathered, reduced = torch.empty(8, device=device), torch.empty(8, device=device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        header, check = exchange.launch(CollectiveCall(0, "all_gather", "blocks.0", 8, "float32"), Ledger())
        works = [*Builtin.all_gather(gathered, shard, nccl, 0, 1).works]
        works += Builtin.reduce_scatter_sum(reduced, shard * 2, nccl, 0, 1).works
        header.wait()
        check()
        for work in works:
            work.wait()  # the compute stream waits for NCCL's; the host does not
    finally:
        torch.cuda.set_sync_debug_mode("default")
    out = {"gathered": torch.equal(gathered.cpu(), shard.cpu()), "reduced": torch.equal(reduced.cpu(), 2 * shard.cpu())}
    dist.destroy_process_group()
    return out


def test_nccl_on_one_gpu_issues_real_collectives_without_a_host_wait() -> None:
    (report,) = run_ranks("tests.test_gpu:nccl_alone", 1, {}, timeout=120)
    assert all(report.values()), report
