"""Vital signs per rank: logged per rank to the Trainer's logger, a dashboard that marks the odd rank, and
numbers that equal an independent computation (the global gradient norm, the update ratio)."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger
from matplotlib.backends.backend_agg import FigureCanvasAgg
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_shardlab import ShardLabStrategy
from lightning_shardlab.sharding.reduce_sample import EXACT_LABEL
from lightning_shardlab.vitals.callback import ShardLabVitals
from lightning_shardlab.vitals.dashboard import (
    UNIT_SIGNALS,
    VitalsHistory,
    find_outliers,
    panel_grid,
    render_png,
    write_dashboard,
)
from tests.helpers.launch import run_ranks
from tests.models import OrderedData, TinyGPT, token_dataset
from tests.test_trainer import QUIET

LOUD_FROM = 10  # from this step on, rank 1's embeddings are 30 times too large


class LoudGPT(TinyGPT):
    """Rank 1 feeds its blocks activations 30x too large from step 10 on; records the strategy's global norm.
    Block 1 is frozen (its gradient and update panels have no data, and say why)."""

    def __init__(self) -> None:
        super().__init__(n_layer=2)
        self.global_norms: list[float] = []
        for p in self.blocks[1].parameters():
            p.requires_grad_(False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))  # (b, t, c)
        if self.global_rank == 1 and self.global_step >= LOUD_FROM:
            x = 30 * x
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.global_norms.append(float(self.trainer.strategy.grad_norm(2.0)))


def vitals_fit(out: str, steps: int = 20) -> dict:
    torch.manual_seed(0)
    vitals = ShardLabVitals(dashboard_dir=str(Path(out) / "dashboard"))
    model = LoudGPT()
    quiet = {k: v for k, v in QUIET.items() if k != "logger"}
    trainer = L.Trainer(
        accelerator="cpu",
        devices=3,
        strategy=ShardLabStrategy(stage=3, unit_bucket_params=0),  # a panel per block
        max_steps=steps,
        callbacks=[vitals],
        logger=CSVLogger(out, name="csv"),
        **quiet,
    )
    trainer.fit(model, OrderedData(token_dataset(steps * 2 * 3), 2))
    calls = trainer.strategy.sharded.comm.ledger.by_call
    return {
        "exact_reductions": sum(t.count for (_, _, label), t in calls.items() if label == EXACT_LABEL),
        "global_norms": model.global_norms,
        "paths": {k: str(v) for k, v in vitals.paths.items()},
        "signals": vitals.signals,
    }


@pytest.fixture(scope="module")
def vitals_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], Path]:
    out = tmp_path_factory.mktemp("vitals")
    return run_ranks("tests.test_vitals:vitals_fit", 3, {"out": str(out)}, timeout=180), out


def _metrics(out: Path) -> list[dict]:
    (path,) = out.glob("csv/version_*/metrics.csv")
    with path.open() as f:
        return [row for row in csv.DictReader(f) if row.get("vitals/loss/rank0")]


def test_every_rank_is_logged_to_the_trainers_logger(vitals_run: tuple[list[dict], Path]) -> None:
    reports, out = vitals_run
    rows = _metrics(out)
    assert len(rows) == 20
    signals = reports[0]["signals"]
    assert {"loss", "grad_norm_local", "act_std/blocks.0", "grad_norm_local/blocks.0", "act_mean/root"} <= set(signals)
    for signal in signals:
        for rank in range(3):
            if signal != "grad_norm_local/blocks.1":  # frozen
                assert rows[-1][f"vitals/{signal}/rank{rank}"], (signal, rank)
    for signal in ("grad_norm", "update_ratio/blocks.0", "update_ratio/root"):  # the same on every rank: once
        assert rows[-1][f"vitals/{signal}"] and f"vitals/{signal}/rank0" not in rows[-1], signal
    for rank in range(3):  # where each rank's time went: the step, and the part blocked on collectives
        step, blocked = (float(rows[-1][f"vitals/{k}/rank{rank}"]) for k in ("step_seconds", "comm_blocked_seconds"))
        assert 0 < blocked < step, (rank, step, blocked)
    losses = {rank: float(rows[-1][f"vitals/loss/rank{rank}"]) for rank in range(3)}
    assert len(set(losses.values())) == 3  # each rank's own loss, not an average


def test_gradient_norms_per_rank_overlap_and_the_global_one_equals_the_strategys(
    vitals_run: tuple[list[dict], Path],
) -> None:
    reports, out = vitals_run
    logged = [float(row["vitals/grad_norm"]) for row in _metrics(out)]
    assert logged == pytest.approx(reports[0]["global_norms"], rel=1e-5)
    for step, row in enumerate(_metrics(out)):
        own = [float(row[f"vitals/grad_norm_local/rank{r}"]) for r in range(3)]
        # the averaged gradient is no longer than the ranks' own ones on average (the triangle inequality)
        assert float(row["vitals/grad_norm"]) <= sum(own) / 3 * (1 + 1e-6)
        if step < LOUD_FROM:  # healthy: each rank's own gradient on its own data, of the same size
            assert max(own) / min(own) < 1.6, (step, own)


def test_dashboard_marks_the_rank_with_loud_activations(vitals_run: tuple[list[dict], Path]) -> None:
    reports, _ = vitals_run
    paths = {k: Path(v) for k, v in reports[0]["paths"].items()}
    assert all(not r["paths"] for r in reports[1:])  # rank 0 writes it
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = paths["html"].read_text()
    assert "data:image/png;base64," in page and "<h2>Outliers" in page
    data = json.loads(paths["json"].read_text())
    for unit in ("blocks.0", "blocks.1"):
        for kind in ("act_std", "act_absmax"):
            flagged = [(o["rank"], o["step"]) for o in data["outliers"] if o["signal"] == f"{kind}/{unit}"]
            assert flagged == [(1, step) for step in range(LOUD_FROM, 20)], (kind, unit, flagged)
    assert all(o["step"] >= LOUD_FROM for o in data["outliers"]), data["outliers"]  # no false alarm before
    assert data["reasons"] == {
        "grad_norm_local/blocks.1": "frozen: no gradient, no update",
        "update_ratio/blocks.1": "frozen: no gradient, no update",
    }
    assert set(data["global_signals"]) == {
        "grad_norm",
        "update_ratio/root",
        "update_ratio/blocks.0",
        "update_ratio/blocks.1",
    }
    # the defaults send every byte exactly: no option's error curve, no exact reduction beside them, no extra call
    assert not [s for s in data["signals"] if s.startswith("option_error")]
    assert all(r["exact_reductions"] == 0 for r in reports)


# ---- without communication: the update ratio, and the outlier rule ----


class TwoLayers(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 2)
        self.expected: list[dict[str, float]] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.b(torch.tanh(self.a(x))), y)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # plain SGD: the update is -lr * g, so |Δw| / |w| = lr |g| / |w| per child
        ratio = {}
        for name in ("a", "b"):
            params = list(getattr(self, name).parameters())
            g = math.sqrt(sum(float(p.grad.norm() ** 2) for p in params))
            w = math.sqrt(sum(float(p.detach().norm() ** 2) for p in params))
            ratio[name] = 0.1 * g / w
        self.expected.append(ratio)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_update_ratio_is_lr_grad_over_weight_for_sgd(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, vitals = TwoLayers(), ShardLabVitals(dashboard_dir=str(tmp_path))
    data = TensorDataset(torch.randn(12, 4), torch.randn(12, 2))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=6,
        callbacks=[vitals],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(data, batch_size=2))
    history = np.stack(vitals.rows)[:, 0]  # (steps, signals) of the one rank
    signals = [*vitals.signals, *vitals.global_signals]
    for name in ("a", "b"):
        logged = history[:, signals.index(f"update_ratio/{name}")]
        assert logged == pytest.approx([e[name] for e in model.expected], rel=1e-5)
    reasons = json.loads((tmp_path / "vitals.json").read_text())["reasons"]
    assert reasons["grad_norm_local/a"] == "not measured: this strategy reduces gradients before callbacks see them"


def _history(values: np.ndarray, signal: str = "loss") -> VitalsHistory:
    return VitalsHistory(list(range(values.shape[0])), [signal], values[:, :, None])


def test_outliers_name_the_odd_rank_and_a_nan() -> None:
    rng = np.random.default_rng(0)
    loss = 2.0 + 0.05 * rng.standard_normal((30, 4))
    loss[12, 2] = 3.5  # one spike on rank 2
    loss[20, 3] = math.nan  # a NaN loss on rank 3
    assert [(o.rank, o.step) for o in find_outliers(_history(loss))] == [(2, 12), (3, 20)]
    assert find_outliers(_history(2.0 + 0.05 * rng.standard_normal((30, 4)))) == []


def test_a_step_without_a_gradient_norm_is_not_an_outlier(tmp_path: Path) -> None:
    norm = np.full((10, 3), 1e-3)
    norm[4, :] = math.nan  # a micro-batch of gradient accumulation: no optimizer step, no norm
    history = _history(norm, "grad_norm_local/gates.0")
    assert find_outliers(history) == []
    paths = write_dashboard(history, tmp_path)
    assert paths["png"].exists() and json.loads(paths["json"].read_text())["outliers"] == []


@pytest.mark.parametrize(("n_units", "options"), [(1, False), (2, False), (5, False), (1, True), (2, True)])
def test_the_dashboard_fills_its_grid_and_no_title_is_cut(n_units: int, options: bool, tmp_path: Path) -> None:
    """Panels laid out by how many there are (one unit: a full 2 x 3 grid, not a column beside an empty
    half; a fewer-bytes option on: one more run-wide panel); every title inside the page and clear of its
    neighbours'."""
    units = [f"blocks.{i}" for i in range(n_units)]
    signals = ["loss", "grad_norm_local", "grad_norm"]
    signals += [f"{prefix}/{unit}" for prefix, _ in UNIT_SIGNALS for unit in units]
    curves = [f"option_error/{option}/{unit}" for option in ("gather", "reduce") for unit in units] if options else []
    values = np.abs(np.random.default_rng(0).standard_normal((6, 2, len(signals) + len(curves)))) + 0.1
    history = VitalsHistory(list(range(6)), signals + curves, values, global_signals=["grad_norm", *curves])
    fig = render_png(history, [], tmp_path / "vitals.png")
    rows, cols, cells = panel_grid(n_units, int(options))
    assert len(fig.axes) == len(cells) and sum(span for _, _, span in cells) == rows * cols  # no empty cell
    canvas = FigureCanvasAgg(fig)
    canvas.draw()  # the constrained layout, as saved
    renderer = canvas.get_renderer()
    boxes = [ax.title.get_window_extent(renderer) for ax in fig.axes]
    page = fig.bbox
    for ax, box in zip(fig.axes, boxes):
        assert page.x0 <= box.x0 and box.x1 <= page.x1 and box.y1 <= page.y1, ax.get_title()
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            assert not a.overlaps(b), (a, b)
    titles = [ax.get_title() for ax in fig.axes]
    assert any(t.startswith("fewer-bytes options") for t in titles) == options, titles
    if options:  # a curve per option and unit, a legend naming the units
        (panel,) = [ax for ax in fig.axes if ax.get_title().startswith("fewer-bytes options")]
        assert len(panel.get_lines()) == len(curves)
        assert {t.get_text() for t in panel.get_legend().get_texts()} == set(units)


def test_the_options_panel_says_why_it_has_no_curve(tmp_path: Path) -> None:
    signals = ["loss", "grad_norm_local", "grad_norm", "option_error/reduce/root"]
    values = np.full((3, 2, 4), 0.5)
    values[:, :, 3] = math.nan  # accumulation: no logged step reduced
    why = "no packed reduction ran in a logged step"
    history = VitalsHistory([0, 1, 2], signals, values, global_signals=signals[2:], reasons={signals[3]: why})
    fig = render_png(history, [], tmp_path / "vitals.png")
    (panel,) = [ax for ax in fig.axes if ax.get_title().startswith("fewer-bytes options")]
    assert [t.get_text() for t in panel.texts] == [why] and not panel.get_lines()
