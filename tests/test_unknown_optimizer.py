"""Optimizers shardlab does not know, against Lightning's DDP on the same data, at stages 1-3 on 2 and 3 ranks.

Two unknown classes: ``CheckedSGD``, a subclass of SGD with momentum whose ``step`` checks every gradient and calls
``super().step()`` (so its update is no longer SGD's as far as shardlab can tell), and ``TanhMomentum``, a
``torch.optim.Optimizer`` written from scratch with an elementwise update of its own. Neither is declared, so each
is stepped whole on owner ranks (sharding/whole_step.py): the weights must be DDP's (fp32 tolerance), every
parameter's update must run on exactly one rank of the world (``CheckedSGD`` counts the elements it checked), rank
0 must say once how to declare it elementwise, and ``ShardLabBudget`` must list its whole-tensor exchange and the
state its owners keep, measured beside predicted. In the launch on 2 ranks: Fabric takes the same path
(``setup_optimizers`` at stage 1, ``setup`` at stage 3), and torch's ``ZeroRedundancyOptimizer`` is refused on
every rank with a message naming it and the fix, with no collective after ``configure_optimizers`` began (at stage
3 it fails while it is made: it reads the parameters' types).
"""

from __future__ import annotations

import copy
import io
import os
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

import lightning as L
import pytest
import torch
from rich.console import Console
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.optim import Optimizer
from torch.testing import assert_close

from lightning_shardlab import ShardLabBudget, ShardLabStrategy
from lightning_shardlab import fabric as shardlab_fabric
from lightning_shardlab.comm.collectives import Comm
from lightning_shardlab.sharding.optimizer import is_whole_tensor
from lightning_shardlab.sharding.sharded_model import ShardedModel
from tests.helpers.launch import run_ranks
from tests.helpers.reference import FP32
from tests.models import OrderedData, RegressionNet, regression_dataset

STEPS, LOCAL_BATCH = 6, 2
NOTICE = "is not known to update elementwise, so each parameter it steps is stepped whole"
CHECKED: list[int] = []  # elements whose gradient CheckedSGD checked in this process


class CheckedSGD(torch.optim.SGD):
    """SGD whose step runs the closure, checks that every gradient is finite (counting the elements it checked),
    then calls SGD's own step."""

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    if not torch.isfinite(p.grad).all():
                        raise FloatingPointError(f"a gradient of shape {tuple(p.shape)} is not finite")
                    CHECKED.append(p.numel())
        super().step()
        return loss


class TanhMomentum(Optimizer):
    """From scratch: m <- beta m + g, p <- p (1 - lr wd) - lr tanh(m). Elementwise; one buffer and a step count."""

    def __init__(self, params: Any, lr: float = 0.05, beta: float = 0.8, weight_decay: float = 0.01) -> None:
        super().__init__(params, {"lr": lr, "beta": beta, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"], state["momentum"] = torch.zeros(()), torch.zeros_like(p)
                state["step"] += 1
                state["momentum"].mul_(group["beta"]).add_(p.grad)
                p.mul_(1 - group["lr"] * group["weight_decay"]).add_(torch.tanh(state["momentum"]), alpha=-group["lr"])
        return loss


OPTIMIZERS: dict[str, Callable[[Any], Optimizer]] = {
    "CheckedSGD": lambda params: CheckedSGD(params, lr=0.05, momentum=0.9),
    "TanhMomentum": lambda params: TanhMomentum(params),
}


class UnknownOptimizerNet(RegressionNet):
    """RegressionNet (OddNet: odd shapes, several units) with one of the optimizers above."""

    def __init__(self, optimizer: str) -> None:
        super().__init__()
        self.optimizer_name = optimizer

    def configure_optimizers(self) -> Optimizer:
        return OPTIMIZERS[self.optimizer_name](self.parameters())


class ZeroNet(RegressionNet):
    """torch's ZeroRedundancyOptimizer around SGD with momentum."""

    def configure_optimizers(self) -> Optimizer:
        WATCH.opened = True
        return ZeroRedundancyOptimizer(self.parameters(), optimizer_class=torch.optim.SGD, lr=0.05, momentum=0.9)


class Watch(L.Callback):
    """Whether ZeroNet.configure_optimizers began, and whether the fit's error reached Lightning's handler."""

    opened = failed = False

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self.failed = True


WATCH = Watch()


def _trainer(strategy: object, world_size: int, root: str, callbacks: list | None = None) -> L.Trainer:
    return L.Trainer(
        default_root_dir=root,  # the budget writes its figures there
        accelerator="cpu",
        devices=world_size,
        strategy=strategy,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=callbacks or [],
    )


def _data(world_size: int) -> OrderedData:
    return OrderedData(regression_dataset(STEPS * LOCAL_BATCH * world_size), LOCAL_BATCH)


def _fit(
    model: L.LightningModule, strategy: object, world_size: int, root: str, callbacks: list | None = None
) -> L.Trainer:
    trainer = _trainer(strategy, world_size, root, callbacks)
    trainer.fit(model, _data(world_size))
    assert trainer.global_step == STEPS
    return trainer


def _budget_figures(budget: ShardLabBudget, rank: int) -> dict[str, Any]:
    report = budget.reports[rank]
    sent = report["comm_per_step"].get("all_to_all", {"calls": 0.0, "bytes": 0.0})
    predicted = report["comm_predicted_per_step"]
    gathered = report["comm_per_step"].get("all_gather", {"calls": 0.0})["calls"]
    return {
        "gathers": (gathered, predicted["all_gather_calls"]),
        "whole_tensor": report["whole_tensor"],
        "sent": (sent["calls"], sent["bytes"]),
        "predicted": (predicted["all_to_all_calls"], predicted["all_to_all_bytes"]),
        "state": (report["memory_measured"]["optimizer_state"], report["memory_predicted"]["optimizer_state"]),
        "printed": budget.console.file.getvalue(),
    }


def _shardlab_fit(model: UnknownOptimizerNet, stage: int, world_size: int, root: str) -> tuple[L.Trainer, dict]:
    """One shardlab fit under the budget; the notices rank 0 gave, the elements CheckedSGD checked here, and how
    often the compute copies were brought up to date after a step (``after_optimizer_step``)."""
    CHECKED.clear()
    budget = ShardLabBudget(Console(file=io.StringIO(), width=400))
    after_step, refreshes = ShardedModel.after_optimizer_step, []

    def counted(self: ShardedModel, *args: Any, **kwargs: Any) -> None:
        refreshes.append(1)
        after_step(self, *args, **kwargs)

    with (
        warnings.catch_warnings(record=True) as caught,
        mock.patch.object(ShardedModel, "after_optimizer_step", counted),
    ):
        warnings.simplefilter("always")
        trainer = _fit(model, ShardLabStrategy(stage=stage, transport="builtin"), world_size, root, [budget])
    notices = [str(w.message) for w in caught if NOTICE in str(w.message)]
    whole = is_whole_tensor(trainer.optimizers[0])
    figures = {"notices": notices, "checked": sum(CHECKED), "whole": whole, "after_step": len(refreshes)}
    return trainer, {**figures, **_budget_figures(budget, trainer.global_rank)}


def unknown_optimizer_parity(world_size: int, stages: list[int], extras: bool, root: str) -> dict:
    """Each unknown optimizer under Lightning's DDP and shardlab at ``stages``; with ``extras``, Fabric and the
    refusals of ZeroRedundancyOptimizer too. ``root``: the Trainers' directory."""
    report: dict[Any, Any] = {}
    # torch hooks a class's step when its first instance is made: SGD's here, as in any process that made one, so
    # CheckedSGD's super().step() runs the step hooks (shardlab's among them) inside the update: ignored there
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    for name in OPTIMIZERS:
        torch.manual_seed(0)
        initial = UnknownOptimizerNet(name)
        reference = copy.deepcopy(initial)
        CHECKED.clear()
        _fit(reference, "ddp", world_size, root)
        report[(name, "ddp")] = {"checked": sum(CHECKED)}
        ref_state = {k: v.detach().clone() for k, v in reference.state_dict().items()}
        for stage in stages:
            model = copy.deepcopy(initial)
            trainer, report[(name, stage)] = _shardlab_fit(model, stage, world_size, root)
            where = f"{name}, stage {stage}, rank {trainer.global_rank}"
            assert len(model.losses) == len(reference.losses) == STEPS, where
            assert_close(
                torch.stack(model.losses), torch.stack(reference.losses), **FP32, msg=lambda m: f"{where}\n{m}"
            )
            state = trainer.strategy.full_state_dict()
            if trainer.global_rank == 0:
                assert list(state) == list(ref_state), where
                for key, value in ref_state.items():
                    assert_close(state[key], value, **FP32, msg=lambda m, k=key: f"{k}: {where}\n{m}")
    if extras:
        report["fabric"] = fabric_runs(world_size)
        report["zero"] = {stage: zero_refusal(stage, world_size, root) for stage in (1, 3)}
    return report


@contextmanager
def collectives_after_configure_optimizers() -> Iterator[list[str]]:
    """The collectives this rank started (every one passes ``Comm.start``) after ZeroNet.configure_optimizers began,
    until the fit's error reached Lightning's handler (its teardown may take part in collectives of its own)."""
    seen: list[str] = []
    start = Comm.start
    WATCH.opened = WATCH.failed = False

    def counted(self: Comm, kind: str, label: str, *args: Any, **kwargs: Any) -> Any:
        if WATCH.opened and not WATCH.failed:
            seen.append(f"{kind} {label}")
        return start(self, kind, label, *args, **kwargs)

    with mock.patch.object(Comm, "start", counted):
        yield seen


def zero_refusal(stage: int, world_size: int, root: str) -> dict[str, Any]:
    """ZeroRedundancyOptimizer under shardlab at ``stage``: what this rank raised, and what ran after it was made."""
    torch.manual_seed(0)
    model = ZeroNet()
    with collectives_after_configure_optimizers() as seen:
        try:
            _fit(model, ShardLabStrategy(stage=stage, transport="builtin"), world_size, root, [WATCH])
        except Exception as error:  # noqa: BLE001  (what a user would see)
            return {"error": f"{type(error).__name__}: {error}", "collectives": seen, "trained": bool(model.losses)}
    raise AssertionError(f"stage {stage}: rank {os.environ['RANK']} did not refuse ZeroRedundancyOptimizer")


def fabric_runs(world_size: int) -> dict[str, Any]:
    """CheckedSGD under Fabric's DDP, then shardlab's Fabric at stage 1 (``setup_module``, then
    ``setup_optimizers``) and stage 3 (``setup`` of both): each rank's final weights, rank 0's notices."""
    rank = int(os.environ["RANK"])
    data = regression_dataset(STEPS * LOCAL_BATCH * world_size).tensors
    out: dict[str, Any] = {}
    for label, strategy in (
        ("ddp", "ddp"),
        ("stage 1", shardlab_fabric.ShardLabStrategy(stage=1)),
        ("stage 3", shardlab_fabric.ShardLabStrategy(stage=3)),
    ):
        fabric = L.Fabric(accelerator="cpu", devices=world_size, strategy=strategy)
        fabric.launch()
        torch.manual_seed(0)
        model = UnknownOptimizerNet("CheckedSGD").net
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if label == "stage 1":
                model = fabric.setup_module(model)
                optimizer = fabric.setup_optimizers(OPTIMIZERS["CheckedSGD"](model.parameters()))
            else:
                model, optimizer = fabric.setup(model, OPTIMIZERS["CheckedSGD"](model.parameters()))
            for step in range(STEPS):
                rows = slice(step * LOCAL_BATCH * world_size, (step + 1) * LOCAL_BATCH * world_size)
                x, y = (t[rows][rank::world_size] for t in data)
                fabric.backward(torch.nn.functional.mse_loss(model(x), y))
                optimizer.step()
                optimizer.zero_grad()
        weights = model.module.state_dict() if label == "ddp" else fabric.strategy.full_state_dict(model)
        out[label] = {
            "weights": {k: v.detach().clone() for k, v in weights.items()},
            "notices": [str(w.message) for w in caught if NOTICE in str(w.message)],
            "whole": is_whole_tensor(optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer),
        }
    return out


@pytest.fixture(scope="module")
def launches(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], list[dict]]:
    """One launch per world size, made when a test first asks for it: every case of this file on those ranks
    (Fabric and the refusals on 2)."""
    done: dict[int, list[dict]] = {}

    def launch(world_size: int) -> list[dict]:
        if world_size not in done:
            root = str(tmp_path_factory.mktemp(f"unknown_optimizer_{world_size}"))
            kwargs = {"world_size": world_size, "stages": [1, 2, 3], "extras": world_size == 2, "root": root}
            done[world_size] = run_ranks(
                "tests.test_unknown_optimizer:unknown_optimizer_parity", world_size, kwargs, 300
            )
        return done[world_size]

    return launch


@pytest.mark.parametrize("world_size", [2, 3])
def test_unknown_optimizers_step_whole_parameters_once_each_and_match_ddp(launches: Callable, world_size: int) -> None:
    """Weights and losses equal DDP's (checked on the ranks); each parameter's update runs on one rank of the world:
    CheckedSGD checks every element once per step over all ranks, where under DDP every rank checks them all; the
    compute copies follow the masters once per step (not again inside CheckedSGD's ``super().step()``)."""
    ranks = launches(world_size)
    numel = sum(p.numel() for p in UnknownOptimizerNet("CheckedSGD").parameters())
    for name in OPTIMIZERS:
        for stage in (1, 2, 3):
            assert all(r[(name, stage)]["whole"] for r in ranks), (name, stage)
            assert all(r[(name, stage)]["after_step"] == STEPS for r in ranks), (name, stage)  # once a step
        if name == "CheckedSGD":
            assert [r[(name, "ddp")]["checked"] for r in ranks] == [STEPS * numel] * world_size
            for stage in (1, 2, 3):
                checked = [r[(name, stage)]["checked"] for r in ranks]
                assert sum(checked) == STEPS * numel and all(checked), (stage, checked)


@pytest.mark.parametrize("world_size", [2, 3])
def test_rank_0_says_once_how_to_declare_it_elementwise(launches: Callable, world_size: int) -> None:
    ranks = launches(world_size)
    for name, path in (("CheckedSGD", "CheckedSGD"), ("TanhMomentum", "TanhMomentum")):
        for stage in (1, 2, 3):
            (notice,) = ranks[0][(name, stage)]["notices"]
            assert notice.startswith(f"[rank 0] {name} is not known"), notice
            assert f"elementwise_optimizers=['tests.test_unknown_optimizer.{path}']" in notice, notice
            assert "\n" not in notice
            assert all(not r[(name, stage)]["notices"] for r in ranks[1:]), (name, stage)


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_budget_lists_the_whole_tensor_exchange_and_the_owned_state(launches: Callable, world_size: int) -> None:
    """Two all-to-alls per step (a gather and a return), each rank's bytes measured = predicted; the owners' state
    measured = predicted for CheckedSGD (SGD's momentum buffer, whole); every parameter owned by one rank; the
    all-gathers are the predicted ones."""
    ranks = launches(world_size)
    for name in OPTIMIZERS:
        for stage in (1, 2, 3):
            where = f"{name}, stage {stage}"
            entries = [r[(name, stage)]["whole_tensor"] for r in ranks]
            assert all(len(e) == 1 and e[0]["optimizer"] == name for e in entries), where
            assert sum(e[0]["owned_numel"] for e in entries) == entries[0][0]["total_numel"], where
            assert sum(e[0]["owned"] for e in entries) == entries[0][0]["params"], where
            for rank, r in enumerate(ranks):
                figures = r[(name, stage)]
                assert figures["sent"] == figures["predicted"], (where, rank)
                assert figures["sent"][0] == 2 and figures["sent"][1] > 0, (where, rank)
                assert figures["gathers"][0] == figures["gathers"][1] > 0, (where, rank)
                (entry,) = figures["whole_tensor"]
                assert entry["steps"] == STEPS, (where, rank)
                if name == "CheckedSGD":
                    assert entry["state_bytes_measured"] == entry["state_bytes_predicted"] > 0, (where, rank)
                    assert figures["state"][0] == figures["state"][1], (where, rank)
            printed = ranks[0][(name, stage)]["printed"]
            assert "whole-tensor optimizers" in printed and "all_to_all" in printed and name in printed, where


def test_fabric_steps_an_unknown_optimizer_whole_like_fabric_ddp(launches: Callable) -> None:
    ranks = launches(2)
    for rank, r in enumerate(ranks):
        runs = r["fabric"]
        for label in ("stage 1", "stage 3"):
            assert runs[label]["whole"], label
            assert len(runs[label]["notices"]) == (1 if rank == 0 else 0), (label, rank)
            if rank == 0:
                for key, value in runs["ddp"]["weights"].items():
                    assert_close(runs[label]["weights"][key], value, **FP32, msg=lambda m, k=key: f"{label} {k}: {m}")


def test_zero_redundancy_optimizer_is_refused_on_every_rank_naming_the_fix(launches: Callable) -> None:
    ranks = launches(2)
    for rank, r in enumerate(ranks):
        for stage, refused in r["zero"].items():
            where = (stage, rank, refused)
            assert refused["error"].startswith(f"ValueError: [rank {rank}] ZeroRedundancyOptimizer cannot run"), where
            assert "shards its own optimizer state" in refused["error"], where
            assert "HINT: return the optimizer it wraps, torch.optim.SGD(self.parameters()" in refused["error"], where
            assert "momentum=0.9" in refused["error"] and "was read" not in refused["error"], where
            assert refused["collectives"] == [] and not refused["trained"], where


def test_what_cannot_be_made_exact_stays_refused_and_what_is_known_stays_known(tmp_path: Any) -> None:
    """One process: a subclass of LBFGS is refused as LBFGS is (its closure re-evaluations); an unknown class with
    offload is refused naming both fixes; a subclass that keeps its base's update stays elementwise even when torch
    wrapped its step in hooks of its own (its first instance made before any of its base's); an unknown class on a
    world of one is stepped whole, with the notice; an optimizer sharded for one model is refused for another."""
    from lightning_shardlab import Comm as Single
    from lightning_shardlab import ShardLabConfig, shard_model, shard_optimizer
    from lightning_shardlab.sharding.optimizer import check_optimizer
    from tests.models.basic import OddNet

    class LineSearch(torch.optim.LBFGS):
        pass

    sharded = shard_model(OddNet(), ShardLabConfig(), Single.single())
    with pytest.raises(ValueError, match=r"^\[rank 0\] LineSearch cannot run sharded: its step re-runs the closure"):
        shard_optimizer(LineSearch(sharded.module.parameters()), sharded)

    class Logged(torch.optim.Adamax):  # no step of its own: Adamax's update, under the name Logged
        pass

    # what torch does when a Logged is made before any Adamax: Logged.step becomes a hooked wrapper of Adamax.step
    Logged.step = Optimizer.profile_hook_step(torch.optim.Adamax.step)
    Logged.step.hooked = True
    assert check_optimizer(Logged(sharded.module.parameters())) == "elementwise"
    assert check_optimizer(TanhMomentum(sharded.module.parameters())) == "unknown"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimizer = CheckedSGD(sharded.module.parameters(), lr=0.1, momentum=0.9)
        shard_optimizer(optimizer, sharded)
        shard_optimizer(CheckedSGD(sharded.module.parameters(), lr=0.1), sharded)  # a second one: said once
    assert is_whole_tensor(optimizer) and len([w for w in caught if NOTICE in str(w.message)]) == 1
    other = shard_model(OddNet(), ShardLabConfig(), Single.single())
    with pytest.raises(ValueError, match=r"CheckedSGD steps the shards of another sharded model already"):
        shard_optimizer(optimizer, other)  # its step is the engine's now: nothing of the user's to classify

    disk = shard_model(OddNet(), ShardLabConfig(offload="disk", offload_dir=str(tmp_path)), Single.single())
    with pytest.raises(ValueError, match=r"TanhMomentum is not known to update elementwise.*offload='disk'") as error:
        shard_optimizer(TanhMomentum(disk.module.parameters()), disk)
    assert "elementwise_optimizers=['tests.test_unknown_optimizer.TanhMomentum']" in str(error.value)
    assert "otherwise use offload='none'" in str(error.value)
