"""Exact collective counts per optimizer step, counted by wrapping torch.distributed in the test.

Per flat parameter and step: stage 3 all-gathers a unit before its forward and again before its
backward, and reduce-scatters its gradient once. The root unit is gathered once for the whole step
(its parameters serve the whole step, as in torch's FSDP), so it has one all-gather; so has, from the
second step on, the unit that ran forward last (it stays gathered for its backward, which comes
next). With reshard_after_forward=False every unit is gathered once. Stages 1 and 2 reduce-scatter
once and all-gather the updated shards once after the optimizer step. Every stage adds one all-reduce
per optimizer step: which parameters got a gradient on any rank (find_unused_parameters, on by default).
Under the strategy, every collective is preceded by its verification header (one all_gather_into_tensor).
These count a unit per block (``unit_bucket_params=0``); buckets of small blocks: tests/test_buckets.py.
"""

from __future__ import annotations

import os

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from lightning_shardlab import ShardLabConfig, ShardLabStrategy, shard_model, shard_optimizer
from tests.helpers.counting import counting_collectives
from tests.helpers.launch import run_ranks
from tests.helpers.reference import init_from_env, shutdown
from tests.models import OddNet, regression_batches


def count_per_step(stage: int, reshard_after_forward: bool = True, steps: int = 3) -> dict:
    comm = init_from_env()
    torch.manual_seed(0)
    model = OddNet()
    # builtin: each all-gather / reduce-scatter is one torch.distributed call, countable by name
    config = ShardLabConfig(
        stage=stage, reshard_after_forward=reshard_after_forward, transport="builtin", unit_bucket_params=0
    )
    sharded = shard_model(model, config, comm)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    shard_optimizer(optimizer, sharded)
    per_step = []
    for x, y in regression_batches(steps, 2 * comm.world_size):
        with counting_collectives() as counts:
            optimizer.zero_grad()
            with sharded.step(keep_root_gathered=True):
                loss = F.mse_loss(model(x[:2]), y[:2])
            sharded.prepare_backward(loss)
            loss.backward()
            optimizer.step()
        per_step.append(dict(counts))
    layout = {"root": len(sharded.root.flat_params), "other": len(sharded.flat_params) - len(sharded.root.flat_params)}
    shutdown()
    return {"per_step": per_step, "flat_params": layout}


@pytest.mark.parametrize(
    ("stage", "reshard_after_forward"), [(3, True), (3, False), (2, True), (1, True)], ids=["3", "3-keep", "2", "1"]
)
def test_collectives_per_step(stage: int, reshard_after_forward: bool) -> None:
    reports = run_ranks(
        "tests.test_collective_counts:count_per_step",
        3,
        {"stage": stage, "reshard_after_forward": reshard_after_forward},
        timeout=120,
    )
    for report in reports:
        root, other = report["flat_params"]["root"], report["flat_params"]["other"]
        assert (root, other) == (1, 4)  # OddNet: the root unit and four block/gate units, all fp32
        for step, counts in enumerate(report["per_step"]):
            if stage == 3 and reshard_after_forward:
                gathers = root + 2 * other - (1 if step > 0 else 0)  # the last unit: once, from step 2
            elif stage == 3:
                gathers = root + other
            else:
                gathers = root + other  # once, after the optimizer step
            assert counts == {"all_gather_single": gathers, "reduce_scatter_single": root + other, "all_reduce": 1}, (
                step
            )


def test_world_size_one_issues_no_collective() -> None:
    for stage in (1, 2, 3):
        (report,) = run_ranks("tests.test_collective_counts:count_per_step", 1, {"stage": stage}, timeout=60)
        assert all(counts == {} for counts in report["per_step"])


class CountDuringTraining(L.Callback):
    def on_train_start(self, trainer, pl_module) -> None:  # noqa: ANN001
        self._ctx = counting_collectives()
        self.counts = self._ctx.__enter__()

    def on_train_end(self, trainer, pl_module) -> None:  # noqa: ANN001
        self._ctx.__exit__(None, None, None)


def count_with_accumulation(stage: int, accumulation: str, optimizer_steps: int = 3) -> dict:
    from tests.models import OrderedData, RegressionNet, regression_dataset

    torch.manual_seed(0)
    callback = CountDuringTraining()
    world = int(os.environ["WORLD_SIZE"])
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=ShardLabStrategy(
            stage=stage, accumulation=accumulation, transport="builtin", sanity_every_n_steps=0, unit_bucket_params=0
        ),  # parameter traffic only
        max_steps=optimizer_steps,
        accumulate_grad_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[callback],
    )

    class Quiet(RegressionNet):
        def on_before_optimizer_step(self, optimizer) -> None:  # noqa: ANN001
            pass  # no grad-norm logging: its all-reduce is the user's, not ours

    trainer.fit(Quiet(), OrderedData(regression_dataset(2 * 2 * optimizer_steps * world), 2))
    # Lightning itself broadcasts a SIGTERM flag before every batch; that one is not ours
    ours = {k: v for k, v in callback.counts.items() if k != "broadcast"}
    return {"counts": ours, "lightning_broadcasts": callback.counts["broadcast"], "steps": optimizer_steps}


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("accumulation", ["reduce", "defer"])
def test_collectives_per_step_with_gradient_accumulation(stage: int, accumulation: str) -> None:
    """Two micro-batches per optimizer step: 'reduce' reduce-scatters after each, 'defer' only after the last."""
    report = run_ranks(
        "tests.test_collective_counts:count_with_accumulation",
        2,
        {"stage": stage, "accumulation": accumulation},
        timeout=120,
    )[0]
    root, other, micro = 1, 4, 2  # OddNet's flat parameters; micro-batches per step
    reductions = (root + other) * (micro if accumulation == "reduce" else 1)
    steps = report["steps"]
    if stage == 3:  # every micro-batch but the first keeps its last unit gathered into backward
        all_gathers = micro * steps * (root + 2 * other) - (micro * steps - 1)
    else:
        all_gathers = (root + other) * steps
    ours = {"reduce_scatter_single": reductions * steps, "all_gather_single": all_gathers, "all_reduce": steps}
    # + one header per call, Lightning's SIGTERM broadcast's included (verified: trainer/loop_collectives.py)
    headers = sum(ours.values()) + report["lightning_broadcasts"]
    assert report["counts"] == {**ours, "all_gather_into_tensor": headers}
    assert report["lightning_broadcasts"] == micro * steps


def profiled_step() -> list[str]:
    """One stage 3 step under torch's profiler: the names of shardlab's labelled phases it recorded."""
    comm = init_from_env()
    torch.manual_seed(0)
    model = OddNet()
    sharded = shard_model(model, ShardLabConfig(stage=3, transport="builtin", unit_bucket_params=0), comm)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    shard_optimizer(optimizer, sharded)
    ((x, y),) = regression_batches(1, 2 * comm.world_size)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with sharded.step(keep_root_gathered=True):
            loss = F.mse_loss(model(x[:2]), y[:2])
        sharded.prepare_backward(loss)
        loss.backward()
        optimizer.step()
    shutdown()
    return sorted({e.name for e in prof.events() if e.name.startswith("shardlab::")})


def test_every_collective_and_phase_is_labelled_in_the_profiler() -> None:
    names = run_ranks("tests.test_collective_counts:profiled_step", 2, {}, timeout=120)[0]
    for label in (
        "all_gather (blocks.0[float32])",
        "reduce_scatter (blocks.0[float32])",
        "all_gather (root[float32])",
        "pre_backward (blocks.0)",
        "post_backward (blocks.0)",
    ):
        assert f"shardlab::{label}" in names, names
