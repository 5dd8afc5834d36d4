"""The glue a DDP user's script touches, against Lightning's own DDP: a compiled module, the process group in every
hook, the loops without fit, and the trainer's and strategy's properties and collectives.

One script (``script``) runs under ``ddp`` and under shardlab at stages 1, 2 and 3, in one set of ranks; every rank
records what the script sees and returns, and the test holds shardlab's records equal to DDP's (fp32 tolerances for
numbers, exact for everything else). Each strategy's script starts without a process group. The script:

1. validate and predict before any fit, on a fresh Trainer; its loaders build ``DistributedSampler(dataset)``
   themselves, and every hook records the process group and the properties DDP users read; then the strategy's
   ``barrier``, ``broadcast``, ``reduce`` and ``all_gather``;
2. ``fit(torch.compile(model))``, through a backend that counts the graphs it is given (so the step was compiled,
   after sharding), then validate with the compiled module, test without a module (from the fit's checkpoint),
   ``to_uncompiled`` and predict;
3. that checkpoint, loaded by ``validate(ckpt_path=...)`` on a fresh Trainer and model;
4. Fabric's twin: two steps, and the process group once launched.

At two ranks all of it; at one device parts 1 and 4 (the process group of one).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.utilities.compile import to_uncompiled
from torch import Tensor, nn
from torch.testing import assert_close
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_shardlab import ShardLabStrategy
from lightning_shardlab.fabric import ShardLabStrategy as FabricShardLab
from tests.helpers.launch import run_ranks
from tests.helpers.reference import FP32

STRATEGIES = ("ddp", "stage 1", "stage 2", "stage 3")
QUIET = {
    "accelerator": "cpu",
    "logger": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "num_sanity_val_steps": 0,
}


def _data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return TensorDataset(x, x[:, :1] * 0.5 - x[:, 1:2])


class GlueNet(L.LightningModule):
    """Two linear layers; its loaders build ``DistributedSampler(dataset)`` themselves, as DDP scripts do, and each
    hook records what a DDP user reads there."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 8), nn.Tanh())
        self.head = nn.Linear(8, 1)
        self.seen: dict[str, dict[str, Any]] = {}
        self.losses: list[float] = []

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.body(x))

    def _loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self._loss(batch)

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self._loss(batch)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self._loss(batch)

    # logged outside the steps: torch's compiler cannot trace ``self.log`` (under DDP neither)
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(outputs["loss"].item())
        self.log("train_loss", outputs["loss"], sync_dist=True)

    def on_validation_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.log("val_loss", outputs, sync_dist=True)

    def on_test_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.log("test_loss", outputs, sync_dist=True)
        self.log("test_max", outputs, sync_dist=True, reduce_fx="max")

    def predict_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def _loader(self, hook: str, seed: int) -> DataLoader:
        self.record(hook)
        dataset = _data(8, seed)
        return DataLoader(dataset, batch_size=2, sampler=DistributedSampler(dataset, shuffle=False))

    def train_dataloader(self) -> DataLoader:
        return self._loader("train_dataloader", 1)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val_dataloader", 2)

    def test_dataloader(self) -> DataLoader:
        return self._loader("test_dataloader", 3)

    def predict_dataloader(self) -> DataLoader:
        return self._loader("predict_dataloader", 4)

    def setup(self, stage: str) -> None:
        self.record(f"setup {stage}")

    def on_validation_start(self) -> None:
        self.record("on_validation_start")

    def on_predict_start(self) -> None:
        self.record("on_predict_start")

    def record(self, hook: str) -> None:
        """What a DDP user reads in ``hook``: the process group, the trainer's and the strategy's properties."""
        trainer, strategy = self.trainer, self.trainer.strategy
        self.seen[f"{trainer.state.fn.value} {hook}"] = {
            "process group": dist.is_initialized() and (dist.get_rank(), dist.get_world_size(), dist.get_backend()),
            "trainer": (trainer.world_size, trainer.global_rank, trainer.local_rank, trainer.node_rank),
            "devices": (trainer.num_devices, trainer.num_nodes, str(strategy.root_device)),
            "global zero": (trainer.is_global_zero, strategy.is_global_zero),
            "lightning_module": strategy.lightning_module is self and trainer.lightning_module is self,
        }


def _strategy(label: str) -> Any:
    return "ddp" if label == "ddp" else ShardLabStrategy(stage=int(label[-1]))


def _weights(trainer: L.Trainer, model: GlueNet) -> dict[str, Tensor]:
    """The whole module's weights on every rank: DDP's own; shardlab's full state dict, gathered to rank 0 and
    broadcast."""
    if not isinstance(trainer.strategy, ShardLabStrategy):
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    return trainer.strategy.broadcast(trainer.strategy.full_state_dict())


def _collectives(strategy: Any) -> dict[str, Any]:
    """The strategy's collectives a DDP user calls, on the same inputs under both strategies."""
    rank = strategy.global_rank
    strategy.barrier("glue")
    value = torch.tensor([rank + 1.0, 2.0 * rank])
    return {
        "broadcast": strategy.broadcast({"from": rank, "values": [rank, "x"]}, src=strategy.world_size - 1),
        "reduce sum": strategy.reduce(value.clone(), reduce_op="sum"),
        "reduce mean": strategy.reduce(value.clone(), reduce_op="mean"),
        "reduce max": strategy.reduce(value.clone(), reduce_op="max"),
        "all_gather": strategy.all_gather(value.clone()),
        "all_gather sync_grads": strategy.all_gather(value.clone().requires_grad_(), sync_grads=True).detach(),
    }


class GraphCount:
    """A ``torch.compile`` backend that counts the graphs it is given and runs them with eager kernels: the numbers
    of the uncompiled module. With ``aot``, through AOTAutograd, which traces the backward too (where the engine
    frees and gathers parameters around the graphs: stage 3, and DDP's reference); elsewhere dynamo's capture
    alone, which keeps the test short."""

    def __init__(self, aot: bool) -> None:
        self.graphs, self.aot = 0, aot

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Tensor]) -> Any:
        from torch._dynamo.backends.registry import lookup_backend

        self.graphs += 1
        return lookup_backend("aot_eager" if self.aot else "eager")(gm, example_inputs)


def script(label: str, devices: int, folder: str, compiled: bool) -> dict[str, Any]:
    """The DDP user's script, under ``label``'s strategy; what it sees and what it computes. It starts without a
    process group, as a fresh script does (an earlier strategy's would hide a strategy that opens none)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    torch.manual_seed(0)
    initial = GlueNet()
    out: dict[str, Any] = {}

    # 1. the loops before any fit, and the strategy's collectives
    model = copy.deepcopy(initial)
    trainer = L.Trainer(devices=devices, strategy=_strategy(label), **QUIET)
    out["validate"] = trainer.validate(model, verbose=False)
    out["predict"] = torch.cat(trainer.predict(model))
    out["collectives"] = _collectives(trainer.strategy)
    out["seen before fit"] = model.seen
    if not compiled:
        return out

    # 2. a compiled module: fit, validate, test without the module (from the fit's checkpoint), then uncompiled
    torch._dynamo.reset()  # every strategy compiles from nothing (and no run meets the recompile limit)
    backend, model = GraphCount(aot=label in ("ddp", "stage 3")), copy.deepcopy(initial)
    trainer = L.Trainer(devices=devices, strategy=_strategy(label), max_steps=3, enable_checkpointing=False, **QUIET)
    trainer.fit(torch.compile(model, backend=backend))
    out["graphs"] = {"fit": backend.graphs}
    out["fit losses"] = model.losses
    out["fit metrics"] = {k: v.item() for k, v in trainer.callback_metrics.items()}
    out["weights"] = _weights(trainer, model)
    out["compiled validate"] = trainer.validate(model, verbose=False)
    path = str(Path(folder) / f"{label.replace(' ', '_')}.ckpt")
    trainer.save_checkpoint(path)
    out["compiled test, no module"] = trainer.test(ckpt_path=path, verbose=False)
    out["uncompiled"] = to_uncompiled(model) is model and model._compiler_ctx is None
    graphs = backend.graphs
    out["uncompiled predict"] = torch.cat(trainer.predict(model))
    out["graphs"]["after to_uncompiled"] = backend.graphs - graphs

    # 3. that checkpoint, loaded by validate(ckpt_path=...) on a fresh Trainer and module
    trainer = L.Trainer(devices=devices, strategy=_strategy(label), **QUIET)
    out["validate from checkpoint"] = trainer.validate(copy.deepcopy(initial), ckpt_path=path, verbose=False)
    out["seen in fit"] = model.seen
    return out


def fabric_script(label: str, devices: int, compiled: bool) -> dict[str, Any]:
    """Fabric's twin, at any device count: the process group is there once launched, and two steps give DDP's
    losses and weights (with ``compiled``, of a ``torch.compile``'d module, through AOTAutograd at every stage)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    torch.manual_seed(0)
    model, backend = GlueNet(), GraphCount(aot=True)
    if compiled:
        torch._dynamo.reset()
        model = torch.compile(model, backend=backend)
    strategy = "ddp" if label == "ddp" else FabricShardLab(stage=int(label[-1]))
    fabric = L.Fabric(accelerator="cpu", devices=devices, strategy=strategy)
    fabric.launch()
    module, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters()))
    data, losses = _data(4 * devices, 1), []
    for step in range(2):
        x, y = data[2 * step * devices + fabric.global_rank :: 2 * devices]
        loss = F.mse_loss(module(x), y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    weights = module.state_dict() if label == "ddp" else fabric.strategy.full_state_dict()
    return {
        "compiled graphs": backend.graphs > 0 if compiled else None,
        "process group": dist.is_initialized() and (dist.get_rank(), dist.get_world_size()),
        "losses": losses,
        "weights": fabric.broadcast({k: v.detach().cpu() for k, v in weights.items()}),
    }


def glue(devices: int, folder: str, compiled: bool) -> dict[str, dict[str, Any]]:
    out = {label: script(label, devices, folder, compiled) for label in STRATEGIES}
    for label in STRATEGIES:
        out[label]["fabric"] = fabric_script(label, devices, compiled)
    return out


def _equal(mine: Any, reference: Any, where: str) -> None:
    if isinstance(reference, Tensor):
        assert isinstance(mine, Tensor), where
        assert_close(mine, reference, **FP32, msg=lambda m: f"{where}\n{m}")
    elif isinstance(reference, float):
        assert mine == pytest.approx(reference, rel=FP32["rtol"], abs=FP32["atol"]), where
    elif isinstance(reference, dict):
        assert list(mine) == list(reference), where
        for key in reference:
            _equal(mine[key], reference[key], f"{where} / {key}")
    elif isinstance(reference, (list, tuple)):
        assert type(mine) is type(reference) and len(mine) == len(reference), where
        for i, (m, r) in enumerate(zip(mine, reference)):
            _equal(m, r, f"{where} [{i}]")
    else:
        assert mine == reference, where


@pytest.mark.parametrize("devices", [2, 1])
def test_a_ddp_script_sees_and_computes_what_it_does_under_ddp(devices: int, tmp_path: Path) -> None:
    """At one device the loops before fit and the collectives (the process group of one); at two, the whole script."""
    compiled = devices == 2
    kwargs = {"devices": devices, "folder": str(tmp_path), "compiled": compiled}
    reports = run_ranks("tests.test_ddp_glue:glue", devices, kwargs, timeout=240)
    for rank, report in enumerate(reports):
        ddp = report["ddp"]
        # what the script checks is there to check: DDP's own run is the reference
        seen = [*ddp["seen before fit"].values(), *ddp.get("seen in fit", {}).values()]
        assert len(seen) == (6 + 12 if compiled else 6), sorted(ddp["seen before fit"])
        assert all(hook["process group"] == (rank, devices, "gloo") for hook in seen)
        assert ddp["fabric"]["process group"] == (rank, devices) and len(ddp["fabric"]["losses"]) == 2
        assert ddp["collectives"]["reduce sum"].tolist() == [3.0, 2.0] if compiled else [1.0, 0.0]
        if compiled:
            assert len(ddp["fit losses"]) == 3 and ddp["uncompiled"]
            for label in STRATEGIES:  # a sharded step has more graphs: the engine's hooks break them
                graphs = report[label].pop("graphs")
                assert graphs["fit"] > 0 and graphs["after to_uncompiled"] == 0, (label, graphs)
        for label in STRATEGIES[1:]:
            _equal(report[label], ddp, f"rank {rank}, {label}")
