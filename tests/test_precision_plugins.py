"""The precision plugin is Lightning's, and "64-true" trains: each against Lightning's ``ddp`` on the same data.

- ``trainer.precision_plugin`` (and Fabric's ``strategy.precision``) is an instance of the class Lightning's own
  is under DDP, of the same name, with the same ``.device`` and ``.scaler``, for every precision; a plugin the
  user passes is that very object.
- "64-true", 2 ranks, stages 1-3: the Trainer's losses, global gradient norms and final weights equal DDP's to
  fp64 tolerance, and so do Fabric's; the flat parameters, gradients, optimizer state and every collective are
  fp64; the budget's predicted bytes by category are what the tensors hold; a sharded checkpoint resumes into
  the same fp64 weights and optimizer state.
- A user's MixedPrecision subclass (its ``autocast_context_manager`` counts its entries) with a custom GradScaler
  (counts its updates) on "16-mixed": both are driven as DDP drives them (the same counts, the same scales, the
  scaler state in the checkpoint under the plugin's class name), and the weights end near DDP's.
- What is refused says what was passed: the precision and Lightning's class, or the user's class.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.fabric.plugins import precision as fabric_plugins
from lightning.pytorch.plugins import precision as trainer_plugins
from torch.testing import assert_close

from lightning_shardlab import ShardLabPrecision, ShardLabStrategy
from lightning_shardlab import fabric as shardlab_fabric
from lightning_shardlab.budget.measured.memory import measure_memory
from lightning_shardlab.budget.predicted.zero_table import predict_memory
from lightning_shardlab.sharding.optimizer import OptimizerShape
from tests.helpers.launch import run_ranks
from tests.models import OddNet, OrderedData, RegressionNet, TinyGPT, regression_dataset, token_dataset
from tests.test_mixed_precision import MIXED_UPDATE_GAP, _update_gap

FP64 = {"rtol": 1e-12, "atol": 1e-12}  # 2 ranks: DDP's all-reduce and the reduce-scatter sum the same two terms
QUIET = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False}
STEPS = 6


def _trainer(strategy: object, **kwargs: object) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, use_distributed_sampler=False, num_sanity_val_steps=0,
        **{**QUIET, "max_steps": STEPS, **kwargs},
    )  # fmt: skip


# ---- 64-true ----


def _fp64_fit(model: RegressionNet, strategy: object, tmp: str, ckpt_path: str | None = None) -> L.Trainer:
    trainer = _trainer(strategy, precision="64-true", gradient_clip_val=0.05, default_root_dir=tmp)
    trainer.fit(model, OrderedData(regression_dataset(STEPS * 2 * 2), 2), ckpt_path=ckpt_path)
    return trainer


def _fp64_held(trainer: L.Trainer) -> dict:
    """What the run holds: every flat tensor and optimizer state in fp64, each collective's bytes at 8 per element,
    and the budget's prediction by category against the bytes measured."""
    sharded = trainer.strategy.sharded
    optimizer = trainer.optimizers[0]
    dtypes = {str(t.dtype) for fp in sharded.flat_params for t in (fp.full, fp.shard, fp.master)}
    dtypes |= {str(v.dtype) for s in optimizer.state.values() for k, v in s.items() if k != "step"}
    padded = {fp.layout.name: fp.layout.padded_numel for fp in sharded.flat_params}
    calls = {
        (kind, label): nbytes / n
        for (_, kind, label), (n, nbytes, _) in sharded.comm.ledger.snapshot().items()
        if kind in ("all_gather", "reduce_scatter") and label in padded
    }
    layouts = [fp.layout for fp in sharded.flat_params]
    rank, stage = trainer.global_rank, sharded.config.stage
    predicted = predict_memory(layouts, stage, sharded.policy, rank, OptimizerShape.of(optimizer))
    return {
        "dtypes": dtypes,
        "bytes_per_element": {key: per_call / padded[key[1]] for key, per_call in calls.items()},
        "predicted": predicted,
        "measured": measure_memory(sharded.flat_params, trainer.optimizers),
    }


def _fabric_fp64(strategy: object) -> dict:
    """Fabric in "64-true": three AdamW steps with clipping; the weights (full, on rank 0)."""
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy, precision="64-true")
    fabric.launch()
    torch.manual_seed(0)
    model = OddNet()
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    x, y = regression_dataset(12).tensors
    rank = fabric.global_rank
    for step in range(3):
        xs, ys = x[4 * step : 4 * step + 4][rank::2], y[4 * step : 4 * step + 4][rank::2]
        loss = torch.nn.functional.mse_loss(model(xs), ys)  # inputs converted to fp64 by the plugin
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=0.05)
        optimizer.step()
        optimizer.zero_grad()
    if isinstance(strategy, str):
        return {k: v.detach().clone() for k, v in model.module.state_dict().items()}
    return {k: v.clone() for k, v in fabric.strategy.full_state_dict(model).items()}


def fp64_against_ddp(stages: list[int], tmp: str) -> dict:
    torch.manual_seed(0)
    initial = RegressionNet()
    reference = copy.deepcopy(initial)
    _fp64_fit(reference, "ddp", f"{tmp}/ddp")
    ref_state = {k: v.cpu() for k, v in reference.state_dict().items()}
    report: dict = {"ddp_dtypes": {str(v.dtype) for v in ref_state.values()}}
    for stage in stages:
        model = copy.deepcopy(initial)
        trainer = _fp64_fit(model, ShardLabStrategy(stage=stage), f"{tmp}/{stage}")
        where = f"stage {stage}, rank {trainer.global_rank}"
        assert_close(torch.stack(model.losses), torch.stack(reference.losses), **FP64, msg=lambda m: f"{where}: {m}")
        assert_close(
            torch.stack(model.grad_norms), torch.stack(reference.grad_norms), **FP64, msg=lambda m: f"{where}: {m}"
        )
        state = trainer.strategy.full_state_dict()
        if trainer.global_rank == 0:
            assert list(state) == list(ref_state), where
            for key, value in ref_state.items():
                assert state[key].dtype == torch.float64, (key, where)
                assert_close(state[key], value, **FP64, msg=lambda m, k=key: f"{k}, {where}: {m}")
        report[stage] = _fp64_held(trainer)
        if stage == 3:  # a sharded checkpoint, resumed by a fresh model: fp64 weights and optimizer state back
            path = f"{tmp}/fp64.ckpt"
            trainer.save_checkpoint(path)
            saved = copy.deepcopy(trainer.optimizers[0].state_dict()["state"])
            again = RegressionNet()  # other initial weights: the checkpoint's must replace them
            resumed = _fp64_fit(again, ShardLabStrategy(stage=3), f"{tmp}/again", ckpt_path=path)
            back = resumed.strategy.full_state_dict()
            assert all(torch.equal(back[k], v) and v.dtype == torch.float64 for k, v in state.items()), where
            loaded = resumed.optimizers[0].state_dict()["state"]
            for index, values in saved.items():
                for name, value in values.items():
                    assert loaded[index][name].dtype == value.dtype and torch.equal(loaded[index][name], value), name
            report["resumed_dtypes"] = {str(v.dtype) for s in loaded.values() for k, v in s.items() if k != "step"}
    fabric_ref = _fabric_fp64("ddp")
    for stage in stages:
        weights = _fabric_fp64(shardlab_fabric.ShardLabStrategy(stage=stage))
        if int(os.environ["RANK"]) == 0:
            assert weights.keys() == fabric_ref.keys()
            for key, value in fabric_ref.items():
                assert weights[key].dtype == torch.float64, key
                assert_close(weights[key], value, **FP64, msg=lambda m, k=key: f"Fabric stage {stage} {k}: {m}")
    return report


# ---- a user's MixedPrecision subclass, a user's GradScaler ----


class CountingAmp(trainer_plugins.MixedPrecision):
    """A user's AMP plugin: counts the autocast contexts Lightning enters through it."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.entries = 0

    def autocast_context_manager(self) -> torch.autocast:
        self.entries += 1
        return super().autocast_context_manager()


class CountingScaler(torch.amp.GradScaler):
    """A user's GradScaler: counts its updates."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.updates = 0

    def update(self, new_scale: float | None = None) -> None:
        self.updates += 1
        super().update(new_scale)


class KeysSaved(L.Callback):
    """Which keys of a checkpoint hold a plugin's state, and the scale after each step."""

    def __init__(self) -> None:
        self.keys: list[str] = []
        self.scales: list[float] = []

    def on_train_batch_end(self, trainer, *args) -> None:  # noqa: ANN001, ANN002
        self.scales.append(trainer.precision_plugin.scaler.get_scale())

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:  # noqa: ANN001
        self.keys = sorted(k for k in checkpoint if k in ("CountingAmp", "MixedPrecision", "ShardLabPrecision"))


def user_amp_against_ddp(stages: list[int], tmp: str) -> dict:
    torch.manual_seed(0)
    initial = TinyGPT(n_layer=2)
    report, finals = {}, {}
    for name in ["ddp", *stages]:
        scaler = CountingScaler("cpu", init_scale=2.0**10)
        plugin = CountingAmp("16-mixed", "cpu", scaler=scaler)
        keys = KeysSaved()
        strategy = "ddp" if name == "ddp" else ShardLabStrategy(stage=name)
        trainer = _trainer(strategy, plugins=[plugin], callbacks=[keys])
        model = copy.deepcopy(initial)
        trainer.fit(model, OrderedData(token_dataset(STEPS * 2 * 2), 2))
        trainer.save_checkpoint(f"{tmp}/amp_{name}.ckpt")
        full = trainer.strategy.full_state_dict() if name != "ddp" else model.state_dict()
        finals[name] = {k: v.float().cpu() for k, v in full.items()}
        report[name] = {
            "same_objects": trainer.precision_plugin is plugin and plugin.scaler is scaler,
            "types": (type(plugin).__name__, type(scaler).__name__),
            "entries": plugin.entries,
            "updates": scaler.updates,
            "scales": keys.scales,
            "keys": keys.keys,
            "from_ddp": _update_gap(finals[name], finals["ddp"], initial.state_dict()),
        }
        if name != "ddp":
            report[name]["compute_dtype"] = str(trainer.strategy.sharded.flat_params[0].full.dtype)
    return report


def precision_plugins(stages: list[int], tmp: str) -> dict:
    """One launch of 2 ranks for both: "64-true" and the user's AMP plugin, each against DDP."""
    return {"fp64": fp64_against_ddp(stages, tmp), "amp": user_amp_against_ddp(stages, tmp)}


def test_64_true_and_a_users_amp_plugin_match_ddp(tmp_path: Path) -> None:
    reports = run_ranks(
        "tests.test_precision_plugins:precision_plugins", 2, {"stages": [1, 2, 3], "tmp": str(tmp_path)}, timeout=300
    )
    for rank, report in enumerate(reports):
        fp64 = report["fp64"]
        assert fp64["ddp_dtypes"] == {"torch.float64"} and fp64["resumed_dtypes"] == {"torch.float64"}
        for stage in (1, 2, 3):
            held = fp64[stage]
            assert held["dtypes"] == {"torch.float64"}, (stage, held["dtypes"])
            assert held["bytes_per_element"] and set(held["bytes_per_element"].values()) == {8.0}, (stage, held)
            assert held["predicted"] == held["measured"], (stage, rank, held["predicted"], held["measured"])
        amp = report["amp"]
        ddp = amp["ddp"]
        assert ddp["same_objects"] and ddp["entries"] >= STEPS and ddp["updates"] == STEPS, ddp
        assert ddp["keys"] == ["CountingAmp"], ddp
        for stage in (1, 2, 3):
            ours = amp[stage]
            assert ours["same_objects"] and ours["types"] == ddp["types"] == ("CountingAmp", "CountingScaler"), ours
            assert ours["compute_dtype"] == "torch.float16", ours
            for key in ("entries", "updates", "scales", "keys"):
                assert ours[key] == ddp[key], (stage, key, ours[key], ddp[key])
            assert ours["from_ddp"] < MIXED_UPDATE_GAP, (stage, ours["from_ddp"])


# ---- the plugin's class and device, and the refusals (no ranks: the front doors' constructors) ----


def _plugin(precision: str, strategy: object, fabric: bool) -> object:
    if fabric:
        return L.Fabric(accelerator="cpu", devices=2, strategy=strategy, precision=precision).strategy.precision
    return L.Trainer(accelerator="cpu", devices=2, strategy=strategy, precision=precision, **QUIET).precision_plugin


def _looks(plugin: object, classes: tuple[type, ...]) -> dict:
    return {
        "name": type(plugin).__name__,
        "isinstance": [isinstance(plugin, c) for c in classes],
        "device": getattr(plugin, "device", "no .device"),
        "scaler": type(getattr(plugin, "scaler", None)).__name__,
        "precision": plugin.precision,
    }


@pytest.mark.parametrize("fabric", [False, True], ids=["trainer", "fabric"])
def test_the_plugin_is_lightnings_class_as_under_ddp(fabric: bool) -> None:
    lightning = fabric_plugins if fabric else trainer_plugins
    classes = tuple(getattr(lightning, n) for n in ("Precision", "MixedPrecision", "HalfPrecision", "DoublePrecision"))
    ours = shardlab_fabric.ShardLabStrategy if fabric else ShardLabStrategy
    for precision in ("32-true", "64-true", "bf16-mixed", "16-mixed", "bf16-true"):  # 16-mixed: bf16 on a CPU
        ddp, shardlab = _plugin(precision, "ddp", fabric), _plugin(precision, ours(), fabric)
        assert _looks(shardlab, classes) == _looks(ddp, classes), precision
    plugin = trainer_plugins.MixedPrecision("16-mixed", "cpu")  # fp16 on a CPU: passed as a plugin
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="shardlab", plugins=[plugin], **QUIET)
    assert trainer.precision_plugin is plugin and isinstance(plugin, ShardLabPrecision)
    assert isinstance(plugin.scaler, torch.amp.GradScaler) and plugin.device == "cpu"
    made = ShardLabPrecision("16-mixed")  # the README's way to force fp16 on a CPU
    assert isinstance(made, trainer_plugins.MixedPrecision) and made.precision == "16-mixed" and made.scaler


class FloatHalf(trainer_plugins.HalfPrecision):
    """A user's subclass of Lightning's HalfPrecision."""


@pytest.mark.parametrize(
    ("passed", "names"),
    [
        ({"precision": "16-true"}, ["precision='16-true'", "Lightning's HalfPrecision", "bf16-true only"]),
        ({"plugins": [FloatHalf("16-true")]}, ["FloatHalf", "precision='16-true'", "subclass of Lightning's Half"]),
        ({"plugins": [trainer_plugins.FSDPPrecision("bf16-mixed")]}, ["FSDPPrecision", "other strategies' plugins"]),
    ],
)
def test_a_refusal_says_what_was_passed(passed: dict, names: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        L.Trainer(accelerator="cpu", devices=2, strategy="shardlab", **passed, **QUIET)
    message = str(info.value)
    for name in [*names, "[rank 0]", "is not supported", "HINT: `Trainer(precision=...)`"]:
        assert name in message, (name, message)
    assert "Allowed" not in message
    with pytest.raises(ValueError, match=r"\[rank 0\] precision='16-true' \(Lightning's HalfPrecision plugin\)"):
        L.Fabric(accelerator="cpu", devices=2, strategy=shardlab_fabric.ShardLabStrategy(), precision="16-true")
