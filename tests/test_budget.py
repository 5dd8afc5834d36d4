"""The budget: the ledger's figures against independent counts, predictions against runs, and the plan."""

from __future__ import annotations

import gc
import io
import json
import weakref
from collections import Counter
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from rich.console import Console

from lightning_shardlab import ShardLabBudget, ShardLabStrategy
from lightning_shardlab.budget.measured.memory import MEMORY_CATEGORIES, measure_memory
from lightning_shardlab.budget.predicted.plan import plan_model
from lightning_shardlab.budget.predicted.zero_table import INTERCONNECTS
from lightning_shardlab.cli.plan import main as plan_main
from lightning_shardlab.core.config import ShardLabConfig, Stage
from lightning_shardlab.sharding.owners import (
    Geometry,
    Owned,
    assign_owners,
    gather_counts,
    pieces_of,
    return_counts,
    sent_by_rank,
)
from lightning_shardlab.sharding.policy import plan_units
from tests.helpers.counting import live_cpu_bytes
from tests.helpers.launch import run_ranks
from tests.models import MuonGPT, OrderedData, TinyGPT, token_dataset

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
    """2x2: hybrid sharding, two shard groups of 2; the plan's traffic per group kind is the ledger's (3 steps: the
    warm-up and two of the steady state, whose traffic per step is compared)."""
    options = {"shard_group_size": group, "unit_bucket_params": 0}
    results = run_ranks(
        "tests.test_budget:budget_run",
        world_size,
        {"world_size": world_size, "stage": 3, "out": str(tmp_path), "steps": 3, **options},
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


@pytest.mark.parametrize(("precision", "element"), [("64-true", 8), ("32-true", 4), ("bf16-true", 2)])
def test_plan_of_a_true_precision_counts_its_own_elements(
    precision: str, element: int, capsys: pytest.CaptureFixture
) -> None:
    """A true precision keeps parameters, gradients and AdamW's two moments in its own element (budget/predicted/
    plan.py's ``ELEMENT_BYTES``): 4 x element bytes a parameter, sharded over 8 ranks at stage 3; its all-gathers
    and reduce-scatters move elements of that size. From a count and from a model's layout alike."""
    plan_main(["--params", "1e9", "--world-size", "8", "--stage", "3", "--precision", precision, "--json"])
    plan = json.loads(capsys.readouterr().out)
    memory = plan["memory_per_rank"]
    assert memory["params"] == memory["grads"] == pytest.approx(element * 1e9 / 8) and memory["master"] == 0
    assert memory["optimizer_state"] == pytest.approx(2 * element * 1e9 / 8)
    assert plan["unsharded_bytes"] == pytest.approx(4 * element * 1e9)
    model = ["--model", "lightning_shardlab.examples.gpt.GPT", "--init-args", '{"n_layer": 1, "n_embd": 32}']
    plan_main([*model, "--world-size", "2", "--stage", "2", "--precision", precision, "--json"])
    layout = json.loads(capsys.readouterr().out)
    assert layout["unsharded_bytes"] == pytest.approx(4 * element * layout["params"], rel=1e-3)  # + AdamW's steps


def test_plan_from_a_yaml_config(capsys: pytest.CaptureFixture) -> None:
    config = Path(__file__).parents[1] / "configs" / "gpt_pretrain_cpu.yaml"
    plan_main(["--config", str(config), "--world-size", "4", "--json"])
    plan = json.loads(capsys.readouterr().out)
    assert plan["world_size"] == 4 and plan["stage"] == 2 and plan["params"] > 0  # the config says shardlab_stage_2


def whole_tensor_budget_run(world_size: int, stages: list[int], out: str, batches: int = 3) -> dict:
    """MuonGPT (Muon on the blocks' matrices, AdamW on the rest; a unit per block) under the budget at each of
    ``stages``: every rank's report, and the tables rank 0 printed."""
    reports, printed = {}, {}
    for stage in stages:
        torch.manual_seed(0)
        budget = ShardLabBudget(Console(file=io.StringIO(), width=400))
        strategy = ShardLabStrategy(stage=stage, transport="builtin", sanity_every_n_steps=0, unit_bucket_params=0)
        trainer = L.Trainer(
            accelerator="cpu",
            devices=world_size,
            strategy=strategy,
            max_steps=2 * batches,  # Lightning counts each optimizer's steps: Muon's and AdamW's
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            use_distributed_sampler=False,
            default_root_dir=str(Path(out) / str(stage)),
            callbacks=[budget],
            limit_val_batches=0,
        )
        trainer.fit(MuonGPT(), OrderedData(token_dataset(2 * batches * world_size), 2))
        assert budget.reports is not None
        reports[stage] = budget.reports[trainer.global_rank]
        printed[stage] = budget.console.file.getvalue()
    return {"reports": reports, "printed": printed}


def test_whole_tensor_owners_hold_and_send_what_is_predicted_and_planned(tmp_path: Path) -> None:
    """Muon beside AdamW on 2 ranks, stages 3 and 2: each rank's optimizer state (Muon's of the matrices it owns,
    AdamW's of its slices of the rest) and its all-to-alls per step, measured, are the prediction and the plan's
    exactly; the budget prints them per rank."""
    results = run_ranks(
        "tests.test_budget:whole_tensor_budget_run",
        2,
        {"world_size": 2, "stages": [3, 2], "out": str(tmp_path)},
        timeout=240,
    )
    with torch.device("meta"):
        model = MuonGPT()
    plans = {
        stage: plan_model(
            model,
            ShardLabConfig(stage=Stage(stage), unit_bucket_params=0),
            2,
            "32-true",
            "muon",
            INTERCONNECTS["nvlink"],
            "MuonGPT",
        )
        for stage in (3, 2)
    }
    for rank, result in enumerate(results):
        for stage, plan in plans.items():
            report, planned = result["reports"][stage], plan.whole_tensor["per_rank"][rank]
            where = f"rank {rank}, stage {stage}"
            measured, predicted = report["memory_measured"], report["memory_predicted"]
            assert measured == predicted, where
            assert measured["optimizer_state"] == plan.per_rank[rank]["optimizer_state"], where
            (muon,) = report["whole_tensor"]
            assert muon["state_bytes_measured"] == muon["state_bytes_predicted"] == planned["state_bytes"], where
            assert muon["owned_numel"] == planned["owned_numel"] and muon["owned"] == planned["owned_params"], where
            sent, expected = report["comm_per_step"]["all_to_all"], report["comm_predicted_per_step"]
            assert (sent["calls"], sent["bytes"]) == (expected["all_to_all_calls"], expected["all_to_all_bytes"]), where
            # Lightning counts Muon's step and AdamW's, two per batch; the plan counts training steps
            assert 2 * sent["calls"] == plan.whole_tensor["calls_per_step"] == 2, where
            assert 2 * sent["bytes"] == planned["gather_bytes"] + planned["return_bytes"], where
        # stage 3 gathers the values with the gradient pieces; stage 2 (fp32) holds them whole already
        stage_3, stage_2 = (plans[s].whole_tensor["per_rank"][rank] for s in (3, 2))
        assert stage_3["gather_bytes"] == 2 * stage_2["gather_bytes"] > 0
        assert stage_3["return_bytes"] == stage_2["return_bytes"] > 0
    printed = results[0]["printed"][3]
    assert "whole-tensor optimizers" in printed and "all_to_all" in printed
    for result in results:
        muon = result["reports"][3]["whole_tensor"][0]
        assert f"{muon['owned']} of {muon['params']}" in printed and f"{muon['owned_numel']:,} of" in printed


def _adafactor_state(shape: torch.Size) -> int:
    """fp32 row and column statistics of a matrix (the whole second moment of a vector), and a step."""
    numel = shape.numel()
    return 4 * (numel // shape[-1] + numel // shape[-2] if len(shape) >= 2 else numel) + 4


@pytest.mark.parametrize("optimizer", ["muon", "adafactor"])
def test_plan_of_a_whole_tensor_optimizer_from_a_count_is_the_1_over_w_ideal(
    optimizer: str, capsys: pytest.CaptureFixture
) -> None:
    """70e9 parameters on 8 shard groups of 8, stage 3, bf16-mixed: one fp32 value of state per element (an
    upper bound for Adafactor without shapes) over W owners; per step each rank sends the owners its 1/G piece
    of every gradient and value it holds, and each owner its 1/G to the W - 1 other holders."""
    p, w, g = 70e9, 64, 8
    plan_main([*f"--params {p} --world-size {w} --shard-group-size {g} --optimizer {optimizer} --json".split()])
    plan = json.loads(capsys.readouterr().out)
    plan_main([*f"--params {p} --world-size {w} --shard-group-size {g} --json".split()])
    adamw = json.loads(capsys.readouterr().out)
    state = 4 * p + (4 if optimizer == "adafactor" else 0)
    assert plan["memory_per_rank"]["optimizer_state"] == pytest.approx(state / w)
    assert plan["memory_per_rank"]["master"] == adamw["memory_per_rank"]["master"]
    assert plan["unsharded_bytes"] == pytest.approx(adamw["unsharded_bytes"] - 8 * p + state)
    sent = 4 * p * (2 * (g - 1) / g + (w - 1) / g) / w
    assert plan["traffic"]["all_to_all_calls"] == 2
    assert plan["traffic"]["all_to_all_bytes"] == pytest.approx(sent)
    assert plan["whole_tensor"]["fullest_rank"]["across_bytes"] == pytest.approx(4 * p * (w // g - 1) / w)
    assert plan["link_seconds"]["inter"] > adamw["link_seconds"]["inter"]  # the returns to other groups
    plan_main([*f"--params {p} --world-size {w} --optimizer {optimizer}".split()])
    assert "1/W" in capsys.readouterr().out


@pytest.mark.parametrize("optimizer", ["muon", "adafactor"])
def test_plan_of_a_whole_tensor_optimizer_on_a_model_is_its_owners_arithmetic(optimizer: str) -> None:
    """A real layout, 2 shard groups of 2, stage 3: the state of each parameter by the optimizer that holds it
    (Muon: the matrices inside blocks, one momentum per element; AdamW the rest, two moments per element and a
    step counter per parameter on every rank, its shards in each group; Adafactor: every parameter), balanced
    over the owners; the values
    travel with the gradient pieces; every holder in the other group gets the new values whole."""
    w, g = 4, 2
    with torch.device("meta"):
        model = TinyGPT(**GPT)
    config = ShardLabConfig(stage=Stage.PARAMETERS, unit_bucket_params=0, shard_group_size=g)
    plan = plan_model(model, config, w, "32-true", optimizer, INTERCONNECTS["nvlink"], "TinyGPT")
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if optimizer == "muon":
        whole = [p for n, p in named if n.startswith("blocks.") and p.ndim >= 2]
        rest = [p for n, p in named if not (n.startswith("blocks.") and p.ndim >= 2)]
        total = 4 * sum(p.numel() for p in whole)
        beside = 8 * (w // g) * sum(p.numel() for p in rest) + 4 * len(rest) * w  # each group holds it all
    else:
        whole, beside = [p for _, p in named], 0
        total = sum(_adafactor_state(p.shape) for p in whole)
    owners = plan.whole_tensor
    assert owners["params"] == len(whole) and owners["numel"] == sum(p.numel() for p in whole)
    assert owners["state_bytes_total"] == total
    assert sum(r["optimizer_state"] for r in plan.per_rank) == total + beside
    owned = [r["owned_numel"] for r in owners["per_rank"]]
    assert sum(owned) == owners["numel"]
    assert max(owned) - min(owned) <= max(p.numel() for p in whole)  # largest first, each to the least loaded
    gathered = sum(r["gather_bytes"] for r in owners["per_rank"])
    returned = sum(r["return_bytes"] for r in owners["per_rank"])
    across = sum(r["across_bytes"] for r in owners["per_rank"])
    assert across == 4 * (w // g - 1) * owners["numel"]
    assert returned == across + gathered // 2  # in its own group an owner returns what it gathered
    assert plan.traffic["all_to_all_calls"] == 2
    assert plan.traffic["all_to_all_bytes"] == max(r["gather_bytes"] + r["return_bytes"] for r in owners["per_rank"])


def test_plan_says_which_parameters_muon_steps(capsys: pytest.CaptureFixture) -> None:
    init = json.dumps({"n_layer": 12})
    plan_main(
        [
            "--model",
            "lightning_shardlab.examples.gpt.GPT",
            "--init-args",
            init,
            "--world-size",
            "8",
            "--optimizer",
            "muon",
        ]
    )
    out = capsys.readouterr().out
    assert "Muon steps the parameters of 2+ dimensions inside units other than the root" in out
    assert "AdamW the rest" in out and "all-to-all per step: 2 calls" in out
    with pytest.raises(SystemExit, match="offload"):
        plan_main(["--params", "1e9", "--world-size", "8", "--optimizer", "muon", "--offload", "cpu"])
    with pytest.raises(SystemExit, match="HINT: one of"):
        plan_main(["--params", "1e9", "--world-size", "8", "--optimizer", "lion"])


@pytest.mark.parametrize(("world_size", "group"), [(4, 2), (6, 3), (8, 1)])
def test_the_plans_exchanges_are_what_each_rank_of_a_run_sends(world_size: int, group: int) -> None:
    """Hybrid layouts no test launches: the plan's one pass over the owners (``sent_by_rank``) gives each rank
    what the run's exchanges send it (``gather_counts``, ``return_counts``), and which of it leaves its group."""
    with torch.device("meta"):
        model = TinyGPT(**GPT)
    units = plan_units(model, ShardLabConfig(stage=Stage.PARAMETERS, unit_bucket_params=0), group).layouts()
    held = [(lay, slot) for lays in units.values() for lay in lays for slot in lay.slots]
    owners = assign_owners([(slot.name, slot.numel) for _, slot in held], world_size)
    geo = Geometry(world_size, group)
    for travel in (True, False):
        entries = [Owned(s.name, s.shape, owners[s.name], pieces_of(lay, s), travel) for lay, s in held]
        sent = sent_by_rank(entries, geo)
        for rank in range(world_size):
            returned = return_counts(entries, geo, rank)[0]
            assert sent["gather"][rank] == sum(gather_counts(entries, geo, rank)[0])
            assert sent["return"][rank] == sum(returned)
            assert sent["across"][rank] == sum(
                n for r, n in enumerate(returned) if geo.group_of(r) != geo.group_of(rank)
            )
