"""The fewer-bytes options in a Trainer run, and what the run reports about them (docs/slow_links.md).

- the budget's tables by hand: the residuals' memory shown only where one is kept, the options' error combined over
  ranks (absent with the defaults);
- one Trainer run on 2 ranks with ``reduce_dtype='int8'`` and ``gather_dtype='int8'``, sampled by
  ``ShardLabBudget(error_every=2)`` and watched by ``ShardLabVitals`` on every step, resumed from its checkpoint:
  the weights and the error-feedback residuals equal the uninterrupted run's bit for bit (so neither callback's
  exact reductions changed what trained); the budget's JSON has the error per sampled step and the residuals'
  memory; its option-savings table is the plan's arithmetic (``option_savings``) on the link the run probed for
  its own time prediction; the vitals' error curves are positive and small on every logged step, and equal the
  budget's figures where both measured the same thing (one sample, joined by both).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from rich.console import Console

from lightning_shardlab import ShardLabBudget, ShardLabStrategy, ShardLabVitals
from lightning_shardlab.sharding.reduce_sample import EXACT_LABEL as EXACT
from tests.helpers.launch import run_ranks
from tests.models import OrderedData, TinyGPT, token_dataset

# ---- the budget's tables, by hand ----


def test_memory_table_shows_error_feedback_only_where_a_residual_is_kept() -> None:
    from lightning_shardlab.budget.tables import memory_table

    def table_of(residual: int) -> str:
        memory = {"params": 1 << 20, "grads": 1 << 20, "master": 0, "optimizer_state": 2 << 20, "padding": 0}
        memory["error_feedback"] = residual
        gathered = {**memory, "gathered_peak": 0}
        report = {"rank": 0, "stage": 3, "world_size": 2, "precision": "32-true", "process_peak_bytes": 0}
        console = Console(width=250, record=True)
        console.print(memory_table([{**report, "memory_measured": gathered, "memory_predicted": gathered}]))
        return console.export_text()

    assert "error_feedback" not in table_of(0)  # the defaults' table, as it was
    shown = table_of(3 << 20)
    assert "error_feedback" in shown and "3.00 (3.00)" in shown and "7.00 (7.00)" in shown, shown  # in model state


def test_option_error_is_combined_over_ranks_by_hand_and_absent_by_default() -> None:
    from lightning_shardlab.budget.measured.option_error import option_error
    from lightning_shardlab.budget.tables import option_error_table
    from lightning_shardlab.sharding.packing_error import combine

    figures = combine([{"u": [9.0, 100.0, 2.0]}, {"u": [16.0, 300.0, 3.0]}])
    assert figures == {"u": {"max_abs": 3.0, "rel_l2": 0.25}}  # sqrt(25 / 400)
    assert option_error([{"rank": 0}, {"rank": 1}]) == {}  # the defaults: nothing in the JSON, no table
    sums = [{"gather": {}, "reduce": [(1, {"u": [1.0, 4.0, 1.0]})], "reduce_every": 50}] * 2
    reduce = option_error([{"option_error_sums": s} for s in sums])["reduce"]
    assert reduce == {"every": 50, "steps": [1], "by_step": [{"u": {"max_abs": 1.0, "rel_l2": 0.5}}]}
    console = Console(width=250, record=True)
    console.print(option_error_table({"gather": figures, "reduce": reduce}))
    shown = console.export_text()
    assert "int8 gathers" in shown and "packed reduction" in shown and "1, one in 50" in shown, shown
    assert "0.25" in shown and "0.5" in shown, shown
    with pytest.raises(ValueError, match=r"error_every=0.*integer >= 1.*HINT"):
        ShardLabBudget(error_every=0)


# ---- a Trainer run with both int8 options: resumed exactly, and reported ----


def _fit(epochs: int, seed: int, callbacks: list, ckpt_path: str | None = None, root: str = ".") -> L.Trainer:
    torch.manual_seed(seed)
    model = TinyGPT()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ShardLabStrategy(stage=3, reduce_dtype="int8", gather_dtype="int8", quant_block_size=64),
        max_epochs=epochs,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        callbacks=callbacks,
        default_root_dir=root,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        use_distributed_sampler=False,
    )
    trainer.fit(model, OrderedData(token_dataset(8), 2), ckpt_path=ckpt_path)
    return trainer


def _savings_by_hand(trainer: L.Trainer, savings: dict) -> list[dict]:
    """The plan's rows (``option_savings``, its defaults) on the link the report names, for this one-group run."""
    from lightning_shardlab.budget.predicted.option_savings import option_savings
    from lightning_shardlab.budget.predicted.zero_table import Interconnect, Links

    sharded, link = trainer.strategy.sharded, Interconnect(**savings["link"])
    units = {u.name: [fp.layout for fp in u.flat_params] for u in sharded.forward_order}
    return option_savings(units, sharded.config, None, Links(link, link, group=2))


def resume_with_residuals(tmp: str) -> dict:
    """Worker: 2 epochs straight (the budget and the vitals watching), against 1 epoch saved and resumed to 2 (other
    initial weights)."""

    def weights_and_residuals(trainer: L.Trainer) -> tuple[dict, dict]:
        sharded = trainer.strategy.sharded
        state = {k: v.clone() for k, v in trainer.strategy.full_state_dict().items()}
        return state, {fp.layout.name: fp.residual.clone() for fp in sharded.flat_params if fp.residual is not None}

    console = Console(width=250, record=True)
    budget = ShardLabBudget(console=console, error_every=2)  # samples its reduction's error: steps 0 and 2 of 4
    vitals = ShardLabVitals(dashboard_dir=str(Path(tmp) / "vitals"))  # every step: joins the budget's two samples
    trainer = _fit(2, 0, [budget, vitals], root=tmp)
    straight = weights_and_residuals(trainer)
    saved = (budget.reports or [{}])[0].get("option_savings")  # rank 0's
    by_hand = _savings_by_hand(trainer, saved) if saved else None
    saver = ModelCheckpoint(dirpath=tmp, save_last=True, save_top_k=0)
    _fit(1, 0, [saver])
    resumed = weights_and_residuals(_fit(2, 123, [], ckpt_path=saver.last_model_path))
    return {
        "straight": straight,
        "resumed": resumed,
        "rank": int(os.environ["RANK"]),
        "budget": budget.reports,
        "printed": console.export_text(),
        "by_hand": by_hand,
    }


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], Path]:
    tmp = tmp_path_factory.mktemp("packed_reports")
    return run_ranks("tests.test_packed_reports:resume_with_residuals", 2, {"tmp": str(tmp)}, timeout=240), tmp


def test_error_feedback_residual_resumes_exactly(resumed: tuple[list[dict], Path]) -> None:
    reports, tmp = resumed
    for report in reports:
        (_, residuals), (_, residuals_r) = report["straight"], report["resumed"]
        assert residuals and residuals.keys() == residuals_r.keys()
        assert all(torch.equal(residuals[k], residuals_r[k]) for k in residuals), report["rank"]
    straight, again = reports[0]["straight"][0], reports[0]["resumed"][0]
    assert straight.keys() == again.keys() and all(torch.equal(straight[k], again[k]) for k in straight)
    # ... though the straight run was sampled for its reduction's error: the budget's JSON and tables have it
    everyone = reports[0]["budget"]
    error = json.loads((tmp / "shardlab_budget.json").read_text())[0]["option_error"]
    assert error["reduce"]["every"] == 2 and error["reduce"]["steps"] == [1, 3], error
    for figures in error["reduce"]["by_step"]:
        assert figures and all(0 < f["rel_l2"] < 0.1 for f in figures.values()), figures  # by unit
    assert error["gather"] and all(0 < f["rel_l2"] < 0.1 for f in error["gather"].values()), error
    for r in everyone:
        measured, predicted = r["memory_measured"]["error_feedback"], r["memory_predicted"]["error_feedback"]
        assert measured == predicted > 0, (measured, predicted)  # the residuals' memory, in the budget
        pred = r["comm_predicted_per_step"]  # the sampled exact calls stay out of the predicted figures
        assert r["comm_per_step"]["reduce_scatter"]["bytes"] == pred["reduce_scatter_bytes"], r["comm_per_step"]
        assert any(EXACT in call for call in r["comm_per_step_by_unit"]), r["comm_per_step_by_unit"]


def test_budget_reports_each_options_time_saved_on_the_runs_own_link(resumed: tuple[list[dict], Path]) -> None:
    reports, tmp = resumed
    first = json.loads((tmp / "shardlab_budget.json").read_text())[0]
    savings = first["option_savings"]
    assert savings["link"]["name"] == first["time_predicted"]["basis"]["link"]  # the link the run probed for itself
    assert "this run's" in savings["link"]["name"] and savings["inter"] is None, savings
    by_hand = reports[0]["by_hand"]  # the plan's arithmetic on that link
    assert [row["option"] for row in savings["rows"]] == [row["option"] for row in by_hand]
    for row, expected in zip(savings["rows"], by_hand):
        assert row["bytes"] == expected["bytes"], (row, expected)
        for key in ("comm_seconds", "saved_seconds"):
            assert row[key] == pytest.approx(expected[key], rel=1e-12), (key, row, expected)
    (mine,) = [row for row in savings["rows"] if row["this_run"]]
    assert mine["option"] == "gather_dtype='int8' + reduce_dtype='int8'", savings["rows"]
    predicted = first["comm_predicted_per_step"]  # the run's own traffic, as its ledger measures it
    assert mine["bytes"] == predicted["all_gather_bytes"] + predicted["reduce_scatter_bytes"], (mine, predicted)
    assert all(row["saved_seconds"] > 0 for row in savings["rows"][1:]), savings["rows"]
    printed = reports[0]["printed"]
    assert "options per optimizer step on this run's link" in printed and "(this run)" in printed, printed
    assert not any(r["printed"] for r in reports[1:])  # rank 0 prints the tables


def test_vitals_draw_each_options_error_per_unit(resumed: tuple[list[dict], Path]) -> None:
    reports, tmp = resumed
    data = json.loads((tmp / "vitals" / "vitals.json").read_text())
    error = reports[0]["budget"][0]["option_error"]
    units = sorted(error["gather"])
    curves = [f"option_error/{option}/{unit}" for option in ("gather", "reduce") for unit in units]
    assert set(curves) <= set(data["global_signals"]) and data["steps"] == [0, 1, 2, 3], data["global_signals"]
    assert not [s for s in data["reasons"] if s.startswith("option_error")], data["reasons"]
    signals = data["signals"]
    for signal in curves:
        values = [step[r][signals.index(signal)] for step in data["values"] for r in range(2)]
        assert all(0 < v < 0.1 for v in values), (signal, values)  # int8 blocks of 64: small, never zero
    for unit in units:  # one sample of steps 0 and 2, joined by both: the same figures as the budget's
        reduce = [data["values"][step][0][signals.index(f"option_error/reduce/{unit}")] for step in (0, 2)]
        assert reduce == pytest.approx([f[unit]["rel_l2"] for f in error["reduce"]["by_step"]], rel=1e-9)
        last = data["values"][-1][0][signals.index(f"option_error/gather/{unit}")]  # as fit ended: the budget's
        assert last == pytest.approx(error["gather"][unit]["rel_l2"], rel=1e-9)
