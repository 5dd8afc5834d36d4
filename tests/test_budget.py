"""The budget: the ledger's figures against independent counts, predictions against runs, and the plan."""

from __future__ import annotations

import gc
import json
import weakref
from collections import Counter
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist

from lightning_shardlab import ShardLabBudget, ShardLabStrategy
from lightning_shardlab.budget.measure import MEMORY_CATEGORIES, measure_memory
from lightning_shardlab.budget.plan import plan_model
from lightning_shardlab.budget.plan_command import main as plan_main
from lightning_shardlab.budget.predict import INTERCONNECTS
from lightning_shardlab.core.config import ShardLabConfig, Stage
from tests.helpers.counting import live_cpu_bytes
from tests.helpers.launch import run_ranks
from tests.models import OrderedData, TinyGPT, token_dataset

GPT = {"vocab": 61, "block_size": 8, "n_layer": 3, "n_embd": 48, "n_head": 4}


class IndependentCounts(L.Callback):
    """During training: the bytes torch.distributed's all-gathers and reduce-scatters were handed, counted by
    wrapping them; between steps: the live storages that were not alive before the run, next to what the
    ledger measures."""

    def __init__(self, exclude: list[torch.Tensor]) -> None:
        self.exclude, self.bytes, self.live, self.ledger = exclude, Counter(), [], []
        self.baseline = live_cpu_bytes(exclude)  # what the process held before (its earlier tests' leftovers)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        del outputs, batch
        if batch_idx == 0:
            self.start_counting()  # from the second step, as the budget does (the first is a warm-up)
            return
        self.live.append(live_cpu_bytes(self.exclude) - self.baseline)
        measured = measure_memory(trainer.strategy.sharded.flat_params, trainer.optimizers)
        self.ledger.append(sum(v for k, v in measured.items() if k != "padding"))

    def start_counting(self) -> None:
        self.originals = {n: getattr(dist, n) for n in ("all_gather_single", "reduce_scatter_single")}

        def wrap(kind: str, fn):  # noqa: ANN001, ANN202
            def counted(out, inp, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
                full = out if kind == "all_gather" else inp
                self.bytes[kind] += full.numel() * full.element_size()
                return fn(out, inp, *args, **kwargs)

            return counted

        dist.all_gather_single = wrap("all_gather", self.originals["all_gather_single"])
        dist.reduce_scatter_single = wrap("reduce_scatter", self.originals["reduce_scatter_single"])

    def on_train_end(self, trainer, pl_module) -> None:  # noqa: ANN001
        for name, fn in self.originals.items():
            setattr(dist, name, fn)


def budget_run(world_size: int, stage: int, out: str, steps: int = 6, **options: Any) -> dict:
    result, sharded = _budget_fit(world_size, stage, out, steps, **options)
    gc.collect()
    result["freed"] = sharded() is None  # nothing keeps a finished run's model alive (a process fits again)
    return result


def _budget_fit(world_size: int, stage: int, out: str, steps: int, **options: Any) -> tuple[dict, weakref.ref]:
    torch.manual_seed(0)
    data = token_dataset(6 * 2 * world_size, vocab=61, block_size=8)
    counts = IndependentCounts(exclude=list(data.tensors))
    budget = ShardLabBudget()  # it logs through its own collective: counted separately, under "budget"
    # parameter traffic only
    strategy = ShardLabStrategy(stage=stage, transport="builtin", sanity_every_n_steps=0, **options)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        default_root_dir=out,
        callbacks=[counts, budget],
        limit_val_batches=0,
    )
    trainer.fit(TinyGPT(**GPT), OrderedData(data, 2))
    trainer.strategy.barrier()  # rank 0 writes the file
    report = json.loads((Path(out) / "shardlab_budget.json").read_text())[trainer.global_rank]
    result = {"report": report, "wrapped_bytes": dict(counts.bytes), "live": counts.live, "ledger": counts.ledger}
    return result, weakref.ref(trainer.strategy.sharded)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_ledger_equals_independent_counts_and_its_predictions(stage: int, tmp_path: Path) -> None:
    for result in run_ranks(
        "tests.test_budget:budget_run", 2, {"world_size": 2, "stage": stage, "out": str(tmp_path)}, timeout=180
    ):
        report = result["report"]
        steps = report["optimizer_steps"]
        assert result["freed"]  # the finished run's sharded model died with it (a process that fits again)
        # memory: the ledger's model state is what is alive in the process (Lightning's few scalars aside)
        for live, ledger in zip(result["live"], result["ledger"]):
            assert ledger <= live <= ledger + 4096, (live, ledger)
        # and what the layout predicts, category by category, exactly
        assert report["memory_measured"] == report["memory_predicted"]
        # communication: the ledger's bytes are what torch.distributed was handed
        for kind in ("all_gather", "reduce_scatter"):
            assert report["comm_per_step"][kind]["bytes"] * steps == result["wrapped_bytes"][kind]
            assert report["comm_per_step"][kind]["bytes"] == report["comm_predicted_per_step"][f"{kind}_bytes"]
        assert 0 < report["comm_share_of_step"] < 1


def test_a_single_step_run_reports_its_warm_up_step(tmp_path: Path) -> None:
    """The steady state leaves the first step out; with no other step, that step is what is reported."""
    kwargs = {"world_size": 2, "stage": 3, "out": str(tmp_path), "steps": 1, "unit_bucket_params": 0}  # blocks
    report = run_ranks("tests.test_budget:budget_run", 2, kwargs, timeout=180)[0]["report"]
    assert report["optimizer_steps"] == 1
    predicted = report["comm_predicted_per_step"]
    # no forward order yet: the unit that runs forward last is gathered again for its backward
    assert report["comm_per_step"]["all_gather"]["calls"] == predicted["all_gather_calls"] + 1
    assert report["comm_per_step"]["reduce_scatter"]["calls"] == predicted["reduce_scatter_calls"]


def test_stage_3_moves_about_one_and_a_half_times_the_bytes_of_stages_1_and_2(tmp_path: Path) -> None:
    """Theory: stages 1-2 move 2P per step (reduce-scatter + all-gather), stage 3 3P (all-gather twice)."""
    moved = {}
    for stage in (2, 3):
        out = tmp_path / str(stage)
        kwargs = {"world_size": 2, "stage": stage, "out": str(out), "unit_bucket_params": 0}  # a unit per block
        result = run_ranks("tests.test_budget:budget_run", 2, kwargs, timeout=180)[0]
        moved[stage] = sum(c["bytes"] for k, c in result["report"]["comm_per_step"].items() if k != "budget")
    # the root unit (embeddings, head) is gathered once per step, not twice, so a little under 1.5
    assert 1.3 < moved[3] / moved[2] <= 1.5


@pytest.mark.parametrize(("world_size", "group"), [(2, None), (4, 2)], ids=["2", "2x2"])
def test_plan_of_a_real_model_agrees_with_a_real_run(world_size: int, group: int | None, tmp_path: Path) -> None:
    """2x2: hybrid sharding, two shard groups of 2; the plan's traffic per group kind is the ledger's."""
    options = {"shard_group_size": group, "unit_bucket_params": 0}
    results = run_ranks(
        "tests.test_budget:budget_run",
        world_size,
        {"world_size": world_size, "stage": 3, "out": str(tmp_path), **options},
        timeout=240,
    )
    with torch.device("meta"):
        model = TinyGPT(**GPT)
    plan = plan_model(
        model,
        ShardLabConfig(stage=Stage.PARAMETERS, **options),
        world_size,
        "32-true",
        "adamw",
        INTERCONNECTS["nvlink"],
        "TinyGPT",
    )
    for rank, result in enumerate(results):
        measured = result["report"]["memory_measured"]
        assert {k: measured[k] for k in MEMORY_CATEGORIES} == plan.per_rank[rank]
        assert measured["gathered_peak"] == plan.gathered_peak
        for kind in ("all_gather", "reduce_scatter"):
            assert result["report"]["comm_per_step"][kind]["bytes"] == plan.traffic[f"{kind}_bytes"]
        by_scope = result["report"]["comm_per_step_by_scope"]
        assert set(plan.traffic["by_scope"]) == ({"shard", "replica"} if group else {"world"})
        for scope, kinds in plan.traffic["by_scope"].items():
            for kind, (calls, nbytes) in kinds.items():
                assert (by_scope[scope][kind]["calls"], by_scope[scope][kind]["bytes"]) == (calls, nbytes), scope


def test_plan_of_70b_on_64_ranks_is_the_seeds_arithmetic(capsys: pytest.CaptureFixture) -> None:
    plan_main(["--params", "70e9", "--world-size", "64", "--stage", "3"])
    out = capsys.readouterr().out
    assert "model state per rank" in out and "17.50 GB" in out  # 16 B x 70e9 / 64
    assert "1.12 TB" in out  # 16 B x 70e9 unsharded
    plan_main(["--params", "70e9", "--world-size", "64", "--stage", "3", "--json"])
    plan = json.loads(capsys.readouterr().out)
    assert sum(v for k, v in plan["memory_per_rank"].items() if k != "padding") == pytest.approx(17.5e9)
    assert plan["unsharded_bytes"] == pytest.approx(1.12e12)


def test_plan_from_a_yaml_config(capsys: pytest.CaptureFixture) -> None:
    config = Path(__file__).parents[1] / "configs" / "gpt_pretrain_cpu.yaml"
    plan_main(["--config", str(config), "--world-size", "4", "--json"])
    plan = json.loads(capsys.readouterr().out)
    assert plan["world_size"] == 4 and plan["stage"] == 2 and plan["params"] > 0  # the config says shardlab_stage_2
