"""Ranks started from this process (``start_method`` spawn / fork): what a ``ddp_spawn`` or ``ddp_notebook`` run
gives back, a ``shardlab_spawn`` or ``shardlab_notebook`` run gives back.

The pytest process is the notebook's kernel here: each ``trainer.fit``/``validate``/``test``/``predict`` starts
its 2 ranks and joins them. Forked ranks cost a fraction of a second, so the behaviours (return values, logged
metrics, the checkpoint callback's best path and score, early stopping decided across ranks, predictions, the
whole weights after fit, stages 1-3) are compared with Lightning's ``ddp_notebook`` run of the same calls; one
``shardlab_spawn`` fit (the ranks import torch and Lightning: seconds) checks that what is pickled there and
sent back here is the same.
"""

from __future__ import annotations

import copy
import json
import multiprocessing
import os
import pickle
import signal
import time
from pathlib import Path
from typing import Any
from unittest import mock

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import BasePredictionWriter, EarlyStopping, ModelCheckpoint
from torch import Tensor
from torch.multiprocessing.spawn import ProcessContext
from torch.testing import assert_close

import lightning_shardlab
from lightning_shardlab import ShardLabBudget, ShardLabSanity, ShardLabVitals
from lightning_shardlab import fabric as shardlab_fabric
from lightning_shardlab.common.distributed import NAMES, START_PREFIXES
from lightning_shardlab.common.process_start import refuse_unpicklable
from tests.helpers.launch import ROOT, free_port
from tests.helpers.reference import FP32
from tests.models import OrderedData, RegressionNet, regression_dataset

LOCAL_BATCH, SAMPLES = 2, 12  # 3 steps per epoch on 2 ranks


class SpawnNet(RegressionNet):
    """RegressionNet with what the behaviours read: a validation loss (synced), a per-rank wish to stop (rank 1
    wants to from epoch 1 on, so only a decision taken across ranks stops rank 0), test and predict steps, and at
    the end of fit each step's loss and gradient norm where the main process can read them (callback_metrics)."""

    def on_validation_epoch_start(self) -> None:
        self.epoch_val: list[Tensor] = []

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.epoch_val.append(loss.detach())
        self.log("val_loss", loss, sync_dist=True)
        self.log("wants_stop", float(self.global_rank == 1 and self.current_epoch >= 1))

    def on_validation_epoch_end(self) -> None:  # what val_loss is at each epoch's end, kept for the main process
        mean = self.trainer.strategy.reduce(torch.stack(self.epoch_val).mean(), reduce_op="mean")
        self.__dict__.setdefault("val_losses", []).append(mean)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("test_loss", F.mse_loss(self.net(x), y), sync_dist=True)

    def predict_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self.net(batch[0])

    def on_fit_end(self) -> None:
        self.trainer.callback_metrics["losses"] = torch.stack(self.losses)
        self.trainer.callback_metrics["grad_norms"] = torch.stack(self.grad_norms)
        self.trainer.callback_metrics["val_losses"] = torch.stack(self.val_losses)


class PredictionFiles(BasePredictionWriter):
    """Each rank writes its predictions and their sample indices (ranks started by spawn or fork return none:
    Lightning's own way to gather them)."""

    def __init__(self, root: Path) -> None:
        super().__init__("epoch")
        self.root = root

    def write_on_epoch_end(self, trainer: L.Trainer, module: Any, predictions: Any, batch_indices: Any) -> None:
        torch.save((predictions, batch_indices), self.root / f"predictions{trainer.global_rank}.pt")


def _gathered(root: Path) -> Tensor:
    """Both ranks' predictions in the order of the samples."""
    rows = {}
    for rank in range(2):
        predictions, indices = torch.load(root / f"predictions{rank}.pt")
        for batch, batch_indices in zip(predictions, indices[0]):
            rows.update(zip(batch_indices, batch))
    return torch.stack([rows[i] for i in sorted(rows)])


def _trainer(strategy: str, root: Path, monkeypatch: pytest.MonkeyPatch, **kwargs: Any) -> L.Trainer:
    monkeypatch.setenv("MASTER_PORT", str(free_port()))  # each launch on a port of its own
    return L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
        default_root_dir=root,
        **{"max_epochs": 4, **kwargs},
    )


def _calls(
    strategy: str, initial: SpawnNet, root: Path, monkeypatch: pytest.MonkeyPatch, every: bool, also: tuple = ()
) -> dict:
    """fit (checkpoints, early stopping, the callbacks ``also``), then validate, test from the best checkpoint,
    predict and a fit resumed from the best checkpoint; what each call returns and what this process holds after
    it."""
    model = copy.deepcopy(initial)
    data = OrderedData(regression_dataset(SAMPLES), LOCAL_BATCH)
    checkpoint = ModelCheckpoint(dirpath=root / strategy, monitor="val_loss", save_top_k=2)
    stopping = EarlyStopping(monitor="wants_stop", mode="max", stopping_threshold=0.5)
    trainer = _trainer(strategy, root, monkeypatch, callbacks=[checkpoint, stopping, *also])
    out: dict[str, Any] = {"fit": trainer.fit(model, data), "state": copy.copy(trainer.state)}
    out["metrics"] = dict(trainer.callback_metrics)
    out["weights"] = {k: v.clone() for k, v in model.state_dict().items()}
    out["best"] = (Path(checkpoint.best_model_path).name, checkpoint.best_model_score)
    out["top_k"] = sorted((Path(p).name, float(s)) for p, s in checkpoint.best_k_models.items())
    out["stopped_epoch"] = stopping.stopped_epoch
    out["procs"] = list(trainer.strategy.launcher.procs)
    if every:
        out["validate"] = _trainer(strategy, root, monkeypatch).validate(model, data)
        tested = _trainer(strategy, root, monkeypatch, callbacks=[copy.copy(checkpoint)])
        tested.checkpoint_callback.best_model_path = checkpoint.best_model_path
        out["test"] = tested.test(model, data, ckpt_path="best")
        where = root / f"{strategy}-predictions"
        where.mkdir()
        predictor = _trainer(strategy, root, monkeypatch, callbacks=[PredictionFiles(where)])
        out["predict"] = (predictor.predict(model, data, return_predictions=False), _gathered(where))
        resumed = _trainer(strategy, root, monkeypatch, enable_checkpointing=False)
        resumed.fit(model, data, ckpt_path=checkpoint.best_model_path)  # epochs 2 and 3 (no callback stops it)
        out["resumed"] = {k: v for k, v in resumed.callback_metrics.items() if k in ("losses", "val_losses")}
        out["resumed_weights"] = {k: v.clone() for k, v in model.state_dict().items()}
    return out


def _same_numbers(got: dict, want: dict, where: str) -> None:
    for key in ("losses", "grad_norms", "val_losses"):
        assert_close(got["metrics"][key], want["metrics"][key], **FP32, msg=lambda m: f"{key}, {where}: {m}")
    assert set(got["metrics"]) == set(want["metrics"]), where
    assert list(got["weights"]) == list(want["weights"]), where
    for key, value in want["weights"].items():
        assert_close(got["weights"][key], value, **FP32, msg=lambda m, k=key: f"{k}, {where}: {m}")


_BEFORE: set = set()  # the children this process had before the test: other tests' (a forkserver, a pool) stay


@pytest.fixture(autouse=True)
def _children_before() -> None:
    _BEFORE.clear()
    _BEFORE.update(multiprocessing.active_children())


def _new_children() -> list:
    """The child processes this test started that are still running (none may be left)."""
    return [p for p in multiprocessing.active_children() if p not in _BEFORE]


def test_notebook_runs_give_back_what_ddp_notebook_gives_at_every_stage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    initial = SpawnNet()
    want = _calls("ddp_notebook", initial, tmp_path, monkeypatch, every=True)
    assert len(want["metrics"]["losses"]) == 6  # rank 1's wish stopped both ranks after 2 epochs of 3 steps
    for name in ("shardlab_notebook_stage_1", "shardlab_notebook_stage_2", "shardlab_notebook"):
        got = _calls(name, initial, tmp_path, monkeypatch, every=name == "shardlab_notebook")
        _same_numbers(got, want, name)  # the same steps: early stopping decided across ranks as DDP does
        assert got["fit"] is None and got["state"] == want["state"], name
        assert got["best"][0] == want["best"][0], name  # what Lightning's launcher sends back for DDP too
        # and what it does not (ddp_notebook's stay unset here): the scores and the early stopping's state
        val_losses = got["metrics"]["val_losses"].tolist()
        assert float(got["best"][1]) == pytest.approx(min(val_losses), rel=1e-6), name
        assert sorted(s for _, s in got["top_k"]) == pytest.approx(sorted(val_losses)[:2], rel=1e-6), name
        assert got["stopped_epoch"] == 1 and want["stopped_epoch"] == 0, name
        assert all(p.exitcode == 0 and not p.is_alive() for p in got["procs"]), name
    for call in ("validate", "test"):  # lists of one dict: the synced metrics
        assert got[call] == [pytest.approx(metrics, rel=1e-5) for metrics in want[call]], call
    assert got["predict"][0] is None is want["predict"][0]  # returned by no spawn-based strategy
    assert len(got["predict"][1]) == len(want["predict"][1]) == SAMPLES  # every rank's, gathered
    assert_close(got["predict"][1], want["predict"][1], **FP32)
    assert len(got["resumed"]["losses"]) == 6  # resumed after epoch 1 (the best): 2 epochs of 3 steps
    for key in ("resumed", "resumed_weights"):
        assert_close(got[key], want[key], **FP32, msg=lambda m, k=key: f"{k}: {m}")
    assert _new_children() == []


def test_a_spawned_fit_sends_back_the_same_as_a_forked_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    initial = SpawnNet()
    forked = _calls("shardlab_notebook", initial, tmp_path, monkeypatch, every=False)
    budget = ShardLabBudget()
    spawned = _calls("shardlab_spawn", initial, tmp_path, monkeypatch, every=False, also=(budget,))
    _same_numbers(spawned, forked, "spawn")
    # the budget went pickled (its console stayed here); spawned rank 0 wrote its JSON, and every rank's figures
    # came back (the notebook's test shows its tables, the timeline and the dashboard under fork)
    assert [r["rank"] for r in budget.reports] == [0, 1], budget.reports
    assert json.loads((tmp_path / "shardlab_budget.json").read_text()) == json.loads(json.dumps(budget.reports))
    assert spawned["best"][0] == forked["best"][0] and spawned["stopped_epoch"] == forked["stopped_epoch"] == 1
    assert spawned["top_k"] == forked["top_k"] and spawned["best"][1] == forked["best"][1]
    assert spawned["state"] == forked["state"]


class _Dies(SpawnNet):
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        if self.global_rank == 1 and batch_idx == 1:
            os._exit(3)  # as the out-of-memory killer would end it: no traceback, no Python cleanup
        return super().training_step(batch, batch_idx)


def test_a_rank_that_dies_is_named_and_no_rank_is_left(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trainer = _trainer("shardlab_notebook", tmp_path, monkeypatch, enable_checkpointing=False)
    with pytest.raises(Exception) as failed:
        trainer.fit(_Dies(), OrderedData(regression_dataset(SAMPLES), LOCAL_BATCH))
    text = str(failed.value) + "".join(getattr(failed.value, "__notes__", []))
    assert "[rank 1]" in text and "exit code 3" in text and "HINT" in text, text
    assert all(not p.is_alive() for p in trainer.strategy.launcher.procs)
    assert _new_children() == []


class _Hangs(SpawnNet):
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        if self.global_rank == 1 and batch_idx == 1:
            time.sleep(600)  # hangs in Python: rank 0 waits for it in the next collective
        return super().training_step(batch, batch_idx)


def test_a_rank_that_hangs_is_named_and_no_rank_is_left(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The guard's watchdog ends a hang in forked ranks as in launched ones: the call raises, naming the rank and
    the collective, within collective_timeout_s + poll_s + grace_s and the join, and no rank is left running."""
    watch = ShardLabSanity(collective_timeout_s=2.0, poll_s=0.2, grace_s=1.0)
    trainer = _trainer("shardlab_notebook", tmp_path, monkeypatch, enable_checkpointing=False, callbacks=[watch])
    started = time.monotonic()
    with pytest.raises(Exception) as failed:
        trainer.fit(_Hangs(), OrderedData(regression_dataset(SAMPLES), LOCAL_BATCH))
    assert time.monotonic() - started < 60
    text = str(failed.value) + "".join(getattr(failed.value, "__notes__", []))
    assert "missing: rank 1" in text and "collective_timeout_s=2" in text and "HINT" in text, text
    assert all(not p.is_alive() for p in trainer.strategy.launcher.procs)
    assert _new_children() == []


class _Slow(SpawnNet):
    def on_fit_start(self) -> None:
        time.sleep(120)  # still training when the kernel is interrupted


def test_an_interrupted_kernel_leaves_no_rank_running(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning kills only the ranks a script launcher started on KeyboardInterrupt; ours are killed too."""
    handler = signal.getsignal(signal.SIGINT)
    trainer = _trainer("shardlab_notebook", tmp_path, monkeypatch, enable_checkpointing=False)
    try:
        with mock.patch.object(ProcessContext, "join", side_effect=KeyboardInterrupt), pytest.raises(SystemExit):
            trainer.fit(_Slow(), OrderedData(regression_dataset(SAMPLES), LOCAL_BATCH))
    finally:
        signal.signal(signal.SIGINT, handler)  # Lightning ignores SIGINT after an interrupt
    assert [p.exitcode for p in trainer.strategy.launcher.procs] == [-signal.SIGKILL] * 2
    assert _new_children() == []


class _Configured(SpawnNet):
    """A layer built by configure_model, in the ranks only: this process's module builds it too, then loads it."""

    def configure_model(self) -> None:
        if not hasattr(self, "head"):
            self.head = torch.nn.Linear(3, 3)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.mse_loss(self.head(self.net(x)), y)
        self.losses.append(loss.detach())
        return loss

    def on_fit_end(self) -> None:
        super().on_fit_end()
        with self.trainer.strategy.gathered_params():
            self.trainer.callback_metrics["head"] = self.head.weight.detach().clone()


def test_a_layer_built_in_configure_model_comes_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _Configured()
    trainer = _trainer("shardlab_notebook", tmp_path, monkeypatch, enable_checkpointing=False, max_epochs=1)
    trainer.fit(model, OrderedData(regression_dataset(SAMPLES), LOCAL_BATCH))
    assert not model.head.weight.is_meta and torch.equal(model.head.weight, trainer.callback_metrics["head"])


class UsersScaler(torch.amp.GradScaler):
    """A user's GradScaler subclass: the strategy's scaler class is made at run time in front of it."""


def test_the_precision_plugin_and_its_scaler_travel_pickled() -> None:
    """Spawn pickles the trainer: the plugin's and the scaler's classes, made at run time under Lightning's and the
    user's names (common/precision.py, common/grad_scaler.py), are rebuilt where they are loaded."""
    plugin = lightning_shardlab.ShardLabPrecision("16-mixed", norm_type=3.0, scaler=UsersScaler("cpu", init_scale=8.0))
    loaded = pickle.loads(pickle.dumps(plugin))
    assert type(loaded) is type(plugin) and type(loaded).__name__ == "MixedPrecision" and loaded.norm_type == 3.0
    assert type(loaded.scaler) is type(plugin.scaler) and isinstance(loaded.scaler, UsersScaler)
    assert loaded.scaler._init_scale == 8.0 and loaded.scaler.main_params.__self__ is loaded  # the cycle kept


def test_refused_before_any_rank_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    class Local(SpawnNet):  # a class inside a function: spawn cannot send it
        pass

    trainer = _trainer("shardlab_spawn", tmp_path, monkeypatch)
    with pytest.raises(ValueError, match=r"the LightningModule `Local`.*does not pickle.*HINT: .*top level"):
        trainer.fit(Local(), OrderedData(regression_dataset(SAMPLES), LOCAL_BATCH))
    assert trainer.strategy.launcher.procs == [] and _new_children() == []

    # fork after CUDA was initialised: refused for CUDA ranks (a CPU run forks as it likes)
    strategy = lightning_shardlab.ShardLabStrategy(start_method="fork")
    strategy.parallel_devices = [torch.device("cuda", 0), torch.device("cuda", 1)]
    strategy.cluster_environment = trainer.strategy.cluster_environment
    strategy._configure_launcher()
    with mock.patch("torch.cuda.is_initialized", return_value=True):
        with pytest.raises(RuntimeError, match=r"initialised CUDA already.*HINT: restart the kernel"):
            strategy.launcher.launch(print, trainer=None)
    assert strategy.launcher.procs == []
    with pytest.raises(ValueError, match=r"`start_method='thread'` is invalid.*'popen', 'spawn', 'fork'"):
        lightning_shardlab.ShardLabStrategy(start_method="thread")

    # what the strategy's own callbacks hold travels: the budget's console (a lock) stays here, its settings go
    budget = pickle.loads(pickle.dumps(ShardLabBudget(json_name="b.json", timeline=True)))
    assert (budget.json_name, budget.draw_timeline) == ("b.json", True) and budget.console is not None
    refuse_unpicklable("spawn", [("the vitals", ShardLabVitals(every_n_steps=3)), ("the budget", ShardLabBudget())])

    # in a notebook, only forked ranks can run: the others are refused when the Trainer is made, naming ours
    with mock.patch("lightning_shardlab.common.process_start._IS_INTERACTIVE", True):
        for name in ("shardlab", "shardlab_spawn_stage_2"):
            with pytest.raises(ValueError, match=r"notebook.*HINT: use strategy='shardlab_notebook'"):
                _trainer(name, tmp_path, monkeypatch)
        assert _trainer("shardlab_notebook", tmp_path, monkeypatch).strategy.config.start_method == "fork"


def _fabric_train(fabric: L.Fabric, steps: int) -> dict:
    torch.manual_seed(0)
    model = RegressionNet().net
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.05))
    x, y = regression_dataset(2 * fabric.world_size).tensors
    mine = slice(2 * fabric.global_rank, 2 * fabric.global_rank + 2)  # the same batch every step: the loss falls
    losses = []
    for _ in range(steps):
        loss = F.mse_loss(model(x[mine]), y[mine])
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(fabric.all_reduce(loss.detach(), reduce_op="mean")))
    return {"rank": fabric.global_rank, "losses": losses, "start": fabric.strategy.config.start_method}


def test_fabric_launches_a_function_on_forked_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy="shardlab_notebook")
    out = fabric.launch(_fabric_train, 4)
    assert out["rank"] == 0 and out["start"] == "fork" and len(out["losses"]) == 4  # rank 0's return value
    assert out["losses"][-1] < out["losses"][0]

    def local(fabric: L.Fabric) -> None: ...

    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    spawned = L.Fabric(accelerator="cpu", devices=2, strategy="shardlab_spawn")
    with pytest.raises(ValueError, match=r"the function `.*local` .*does not pickle"):
        spawned.launch(local)


def test_the_start_methods_are_registered_with_every_stage_name() -> None:
    from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC
    from lightning.pytorch.strategies import StrategyRegistry

    for prefix, start_method in START_PREFIXES:
        for name, stage, offload in NAMES:
            named = prefix + name[len("shardlab") :]
            for strategy in (StrategyRegistry.get(named), FABRIC.get(named)):
                config = strategy.config
                assert (config.start_method, int(config.stage), config.offload) == (start_method, stage, offload)
    assert isinstance(StrategyRegistry.get("shardlab_notebook"), lightning_shardlab.ShardLabStrategy)
    assert isinstance(FABRIC.get("shardlab_spawn_stage_2"), shardlab_fabric.ShardLabStrategy)


def _texts(cell: Any) -> str:
    """Everything a cell showed: its streams, its plain-text displays and results, its errors."""
    parts = []
    for output in cell.get("outputs", []):
        parts.append(output.get("text", ""))
        parts.append(str(output.get("data", {}).get("text/plain", "")))
        parts.append(output.get("evalue", ""))
    return "".join(parts)


def test_the_notebook_fine_tunes_and_generates_headless(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """examples/notebook.ipynb in a real kernel (nbclient), at its tiny sizes: the fit forks 2 ranks from the
    kernel, rank 0's budget tables appear in the fit's cell, the timeline picture inline, the dashboard linked, and
    the next cell generates from the whole weights in the kernel."""
    why = "the notebook runs in a kernel: nbformat and nbclient come with the test extra (pip install -e '.[test]')"
    nbformat = pytest.importorskip("nbformat", reason=why)
    nbclient = pytest.importorskip("nbclient", reason=why)
    for name, value in (("SHARDLAB_NOTEBOOK_QUICK", "1"), ("SHARDLAB_NOTEBOOK_RUNS", str(tmp_path))):
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    notebook = nbformat.read(ROOT / "examples" / "notebook.ipynb", as_version=4)
    client = nbclient.NotebookClient(
        notebook, timeout=240, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}
    )
    client.execute()
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    fit, cost, generated = _texts(code[1]), code[2], _texts(code[3])
    assert "shardlab budget: memory per rank" in fit and "fit finished from scratch" in fit, fit
    assert "val_ppl" in fit and "budget written to" in fit, fit
    assert "rank 0:" in _texts(cost) and "rank 1:" in _texts(cost)
    shown = [o for o in cost.outputs if "image/png" in o.get("data", {})]
    assert len(shown) == 1 and (tmp_path / "shardlab_timeline.png").is_file()
    assert "vitals.html" in str([o.get("data", {}).get("text/markdown") for o in cost.outputs])
    assert "parameters, whole in this process" in generated and 'The "while" statement' in generated, generated
    assert not [o for cell in code for o in cell.outputs if o.output_type == "error"]
