"""One parameter, one identity: training code that changes the parameters mid-run, at every stage.

Four ways of changing a model after setup (tests/models/midrun.py): blocks frozen by ``requires_grad_`` in a
hook for three steps then trained again, Lightning's ``BackboneFinetuning`` (a backbone frozen at setup, then
unfrozen and added as a param group), Lightning's ``ModelPruning`` every epoch, and a ``weight_norm``
parametrization registered at the start of epoch 1. Each runs at stages 1, 2 and 3 in one spawned world, and
is compared with an unsharded run on the same global batches (one process, every step's mean loss and the
final ``state_dict``: keys and values). The single-process run is the reference rather than Lightning's
``ddp``, which builds its gradient buckets from the parameters trainable at setup: a backbone unfrozen later
is then never averaged across ranks (each rank trains it on its own gradient).
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import lightning as L
import pytest
import torch
from rich.console import Console
from torch.testing import assert_close

from lightning_shardlab import ShardLabBudget, ShardLabStrategy
from tests.helpers.launch import run_ranks
from tests.helpers.reference import FP32
from tests.models import OrderedData
from tests.models.midrun import MODES, MidRunNet, callbacks, midrun_dataset

GLOBAL_BATCH, STEPS_PER_EPOCH, EPOCHS = 8, 3, 3


def _trainer(strategy: object, devices: int, mode: str, **kwargs: object) -> L.Trainer:
    options = {
        "accelerator": os.environ.get("SHARDLAB_TEST_ACCELERATOR", "cpu"),
        "devices": devices,
        "strategy": strategy,
        "max_epochs": EPOCHS,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "use_distributed_sampler": False,
        "num_sanity_val_steps": 0,
        "callbacks": callbacks(mode),
    }
    return L.Trainer(**{**options, **kwargs})


def _data(world_size: int) -> OrderedData:
    return OrderedData(midrun_dataset(GLOBAL_BATCH * STEPS_PER_EPOCH), GLOBAL_BATCH // world_size)


def reference(mode: str) -> dict:
    """The unsharded run: one process, the global batch."""
    torch.manual_seed(0)
    model = MidRunNet(mode)
    _trainer("auto", 1, mode).fit(model, _data(1))
    return {"losses": torch.stack(model.losses).cpu(), "state": {k: v.cpu() for k, v in model.state_dict().items()}}


def midrun_fits(world_size: int, stages: list[int], modes: list[str], directory: str, offload: bool = True) -> dict:
    """Every rank: each mode at each stage (and, with ``offload``, finetuning at stage 3 with its state on disk
    in ``directory``); the mean loss per step, rank 0's full state dict, identity facts, the budget's memory."""
    runs = [(mode, stage, {}) for mode in modes for stage in stages]
    if offload:
        runs.append(("finetune", "3+disk", {"offload": "disk", "offload_dir": directory}))
    out = {}
    for mode, stage, options in runs:
        torch.manual_seed(0)
        model = MidRunNet(mode)
        before = {id(p) for p in model.parameters()}
        budget = ShardLabBudget(console=Console(file=io.StringIO()))  # its tables are not this test's
        extra = {"callbacks": [*callbacks(mode), budget], "default_root_dir": directory}
        trainer = _trainer(ShardLabStrategy(stage=int(str(stage)[0]), **options), world_size, mode, **extra)
        trainer.fit(model, _data(world_size))
        losses = trainer.strategy.reduce(torch.stack(model.losses), reduce_op="mean").cpu()
        report = budget.reports[trainer.global_rank] if budget.reports else {}
        out[(mode, stage)] = {
            "losses": losses,
            "state": trainer.strategy.full_state_dict(),
            "same_objects": before <= model.ids if mode == "weight_norm" else model.ids == before,
            "checks": model.identity_checks,
            "memory": (report.get("memory_measured"), report.get("memory_predicted")),
        }
    return out


class SaveAt(L.Callback):
    """Save a checkpoint at the end of one epoch (after BackboneFinetuning unfroze the backbone)."""

    def __init__(self, epoch: int, path: str) -> None:
        self.epoch, self.path = epoch, path

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.current_epoch == self.epoch:
            trainer.save_checkpoint(self.path)


def finetune_and_save(world_size: int, stages: list[int], directory: str, strategy: bool = True) -> None:
    """BackboneFinetuning, a checkpoint after the unfreeze (epoch 1); ``strategy=False``: one process, unsharded."""
    for stage in stages:
        torch.manual_seed(0)
        save = SaveAt(1, f"{directory}/stage{stage}" + ("" if strategy else ".ckpt"))
        chosen = ShardLabStrategy(stage=stage) if strategy else "auto"
        trainer = _trainer(chosen, world_size, "finetune", callbacks=[*callbacks("finetune"), save])
        trainer.fit(MidRunNet("finetune"), _data(world_size))


def finetune_resumed(world_size: int, stages: list[int], directory: str, strategy: bool = True) -> dict:
    """Resume each stage's checkpoint (at this world size) from another initialisation; the final weights."""
    out = {}
    for stage in stages:
        torch.manual_seed(1)
        model = MidRunNet("finetune")
        chosen = ShardLabStrategy(stage=stage) if strategy else "auto"
        trainer = _trainer(chosen, world_size, "finetune")
        path = f"{directory}/stage{stage}" + ("" if strategy else ".ckpt")
        trainer.fit(model, _data(world_size), ckpt_path=path)
        out[stage] = trainer.strategy.full_state_dict() if strategy else model.state_dict()
        out[stage, "groups"] = [len(g["params"]) for g in trainer.optimizers[0].param_groups]
    return out


def ungathered_weight_norm_at_stage_3(world_size: int) -> str:
    """Registering a parametrization reads the weight: at stage 3, outside gathered_params, it is refused."""
    torch.manual_seed(0)
    model = MidRunNet("weight_norm")
    model._gathered = lambda: __import__("contextlib").nullcontext()  # the user forgot to gather
    try:
        _trainer(ShardLabStrategy(stage=3), world_size, "weight_norm").fit(model, _data(world_size))
    except RuntimeError as err:
        return str(err)
    return "no error"


def _compare(results: list[dict], references: dict, world_size: int) -> None:
    for key, got in results[0].items():
        mode, stage = key
        where = f"{mode}, stage {stage}, {world_size} ranks"
        ref = references[mode]
        assert got["checks"] == 2 * STEPS_PER_EPOCH * EPOCHS, where  # in each training_step, after each step
        assert all(r[key]["same_objects"] for r in results), f"parameter objects changed: {where}"
        for rank, r in enumerate(results):  # the budget after the change: measured = predicted, byte for byte
            measured, predicted = r[key]["memory"]
            assert measured is not None and measured == predicted, f"budget, rank {rank}: {where}"
        assert_close(got["losses"], ref["losses"], **FP32, msg=lambda m, w=where: f"losses: {w}\n{m}")
        state = got["state"]
        assert list(state) == list(ref["state"]), f"keys: {where}"
        for name, value in ref["state"].items():
            assert_close(state[name], value, **FP32, msg=lambda m, w=where, n=name: f"{n}: {w}\n{m}")


def world_of_two(directory: str) -> dict:
    """2 ranks: every mid-run change at every stage; finetuning saved after its unfreeze (resumed at 4 ranks);
    last, a parametrization that reads sharded weights (refused: the run ends there)."""
    fits = midrun_fits(2, [1, 2, 3], list(MODES), directory)
    finetune_and_save(2, [1, 2, 3], directory)
    fabric = fabric_midrun([1, 2, 3])  # Fabric's front door, in the same world
    return {"fits": fits, "fabric": fabric, "refused": ungathered_weight_norm_at_stage_3(2)}


def world_of_four(directory: str) -> dict:
    """4 ranks: every mid-run change at every stage; the 2-rank finetuning checkpoints resumed."""
    return {
        "fits": midrun_fits(4, [1, 2, 3], list(MODES), directory),
        **finetune_resumed(4, [1, 2, 3], directory),
    }


def test_midrun_changes_match_the_unsharded_run_at_every_stage_on_2_and_4_ranks(tmp_path: Path) -> None:
    references = {mode: reference(mode) for mode in MODES}
    finetune_and_save(1, [0], str(tmp_path), strategy=False)  # the unsharded run's own save, after the unfreeze
    expected = finetune_resumed(1, [0], str(tmp_path), strategy=False)  # ... and resume
    two = run_ranks("tests.test_identity:world_of_two", 2, {"directory": str(tmp_path)}, timeout=900)
    four = run_ranks("tests.test_identity:world_of_four", 4, {"directory": str(tmp_path)}, timeout=900)
    runs = [(m, s) for m in MODES for s in (1, 2, 3)] + [("finetune", "3+disk")]
    for world, results in ((2, two), (4, four)):
        assert sorted(results[0]["fits"], key=str) == sorted(runs, key=str), world
        _compare([r["fits"] for r in results], references, world)
    pruned = references["prune"]["state"]["head.weight"]
    assert (pruned == 0).any(), "the pruning scenario pruned nothing: it would not test anything"
    # BackboneFinetuning saved at 2 ranks after it added the backbone's group, resumed at 4 from another
    # initialisation: the two groups come back by name, and the weights end on the unsharded resume's
    assert expected[0, "groups"] == [4, 8]  # the stem's and head's parameters, then the backbone's
    resumed = four[0]
    for stage in (1, 2, 3):
        assert resumed[stage, "groups"] == expected[0, "groups"], stage
        assert list(resumed[stage]) == list(expected[0]), stage
        for name, value in expected[0].items():
            assert_close(resumed[stage][name], value, **FP32, msg=lambda m, s=stage, n=name: f"{n}, stage {s}\n{m}")
    _check_fabric(two)
    # a parametrization registered at stage 3 outside gathered_params reads the weight: refused on every rank
    for rank, result in enumerate(two):
        assert f"[rank {rank}] parameter 'head.weight'" in result["refused"], result["refused"]
        assert "gathered_params" in result["refused"] and "shardlab_stage_2" in result["refused"], result["refused"]


def cuda_midrun(directory: str) -> dict:
    """One rank on one GPU: every mid-run change at every stage, and the unsharded run on the same GPU."""
    os.environ["SHARDLAB_TEST_ACCELERATOR"] = "cuda"
    fits = midrun_fits(1, [1, 2, 3], list(MODES), directory, offload=False)
    return {"fits": fits, "references": {m: reference(m) for m in MODES}}


@pytest.mark.gpu
def test_midrun_changes_on_a_gpu_match_the_unsharded_run_on_it(tmp_path: Path) -> None:
    (out,) = run_ranks("tests.test_identity:cuda_midrun", 1, {"directory": str(tmp_path)}, timeout=600)
    _compare([out["fits"]], out["references"], 1)


def test_reading_a_parameter_at_rest_fails_loudly_but_its_shape_answers(tmp_path: Path) -> None:
    from torch import nn

    from lightning_shardlab.sharding.flat_param import FlatParam, FlatParamLayout

    layout = FlatParamLayout.build("unit", torch.float32, True, [(("w",), torch.Size([3, 5]))], world_size=2)
    weight = nn.Parameter(torch.randn(3, 5))
    fp = FlatParam(layout, rank=0, device=torch.device("cpu"), resident_full=False, params=[weight])
    fp.show_stubs()
    assert weight.shape == (3, 5) and weight.dim() == 2 and weight.numel() == 15 and weight.requires_grad
    weight.requires_grad_(False)
    assert not weight.requires_grad
    for read in (lambda: weight.sum(), lambda: weight + 1, lambda: weight.clone(), lambda: repr(weight)):
        with pytest.raises(RuntimeError, match=r"parameter 'w' was read .* while it is sharded"):
            read()
    with pytest.raises(RuntimeError, match="HINT"):
        torch.save(weight, tmp_path / "w.pt")
    fp.alloc_full()
    fp.show_views()
    assert type(weight) is nn.Parameter and weight.data_ptr() == fp.full.data_ptr()


# ---- Fabric: the same changes in a loop of one's own ----


def _fabric_net() -> torch.nn.Module:
    from tests.models.basic import Block

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(7, 15), torch.nn.Tanh(), Block(15), Block(15), torch.nn.Linear(15, 3))


def _fabric_loop(model: torch.nn.Module, optimizer: torch.optim.Optimizer, backward, rank: int, world: int) -> list:
    """Block 2 frozen for two steps, then trained; block 3 (not in the optimizer at first) added at step 3."""
    net = getattr(model, "module", model)  # Fabric's wrapper forwards calls to the module it holds
    x, y = midrun_dataset(8 * 6).tensors
    losses = []
    for step in range(6):
        net[2].requires_grad_(step >= 2)
        if step == 3:
            optimizer.add_param_group({"params": list(net[3].parameters()), "lr": 1e-2})
        xs, ys = x[8 * step : 8 * (step + 1)], y[8 * step : 8 * (step + 1)]
        loss = torch.nn.functional.mse_loss(model(xs[rank::world]), ys[rank::world])
        backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return losses


def _initial_params(model: torch.nn.Module) -> list:
    return [p for i, m in enumerate(model) if i != 3 for p in m.parameters()]


def fabric_reference() -> dict:
    model = _fabric_net()
    optimizer = torch.optim.AdamW(_initial_params(model), lr=2e-2, weight_decay=0.1)
    losses = _fabric_loop(model, optimizer, lambda loss: loss.backward(), 0, 1)
    return {"losses": torch.stack(losses), "state": model.state_dict()}


def fabric_midrun(stages: list[int]) -> dict:
    from lightning_shardlab import fabric as shardlab_fabric

    out = {}
    for stage in stages:
        fabric = L.Fabric(accelerator="cpu", devices=2, strategy=shardlab_fabric.ShardLabStrategy(stage=stage))
        fabric.launch()
        model = _fabric_net()
        optimizer = torch.optim.AdamW(_initial_params(model), lr=2e-2, weight_decay=0.1)
        model, optimizer = fabric.setup(model, optimizer)
        losses = _fabric_loop(model, optimizer, fabric.backward, fabric.global_rank, fabric.world_size)
        held = {id(p) for g in optimizer.param_groups for p in g["params"]}
        out[stage] = {
            "losses": fabric.all_reduce(torch.stack(losses), reduce_op="mean"),
            "state": fabric.strategy.full_state_dict(),
            "identity": held == {id(p) for p in model.parameters()},
        }
    return out


def _check_fabric(ranks: list[dict]) -> None:
    """Fabric at stages 1-3 (run in the 2-rank world): freezing, unfreezing and add_param_group like one process."""
    expected = fabric_reference()
    results = [r["fabric"] for r in ranks]
    for stage, got in results[0].items():
        assert all(r[stage]["identity"] for r in results), stage
        assert_close(got["losses"], expected["losses"], **FP32, msg=lambda m, s=stage: f"losses, stage {s}\n{m}")
        for name, value in expected["state"].items():
            key = name if name in got["state"] else f"_forward_module.{name}"
            assert_close(got["state"][key], value, **FP32, msg=lambda m, s=stage, n=name: f"{n}, stage {s}\n{m}")
