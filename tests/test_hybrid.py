"""Hybrid sharding (``shard_group_size``) and reshard groups (``reshard_after_forward=k``) on 4 ranks.

One 4-rank run serves the matrix: Lightning DDP on 4 ranks is the reference, then

    2x2 stage 1, 2x2 stage 2, 2x2 stage 3     two shard groups of 2 ranks, replicas of each other
    1x4 stage 3, reshard_after_forward=2      one shard group of 4; backward gathers inside pairs
    1x4 stage 3, reshard_after_forward=False  every unit kept gathered from its forward to its backward

each trained from the same initial weights on the same batches: losses every step, grad norms and final
weights equal DDP's (fp32 tolerance). Every rank also checks, from its ledger, the exact collectives of a
steady-state step per kind and per group kind (scope), and that its bytes are the ZeRO formula at N = the
shard group's size. The 2x2 stage 2 run saves a checkpoint after 3 of its 6 steps; it is resumed at 1x4, at
4x1 (every rank whole, four replicas) and, in a second launch, on 2 ranks, and each must end on the 2x2 run's
final weights; a plain 1x4 checkpoint resumes at 2x2. Last, one rank's master shard is nudged and the
divergence check names it among its replicas. (The two-node torchrun run is in tests/test_launchers.py.)
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch.testing import assert_close

from lightning_shardlab import ShardLabStrategy
from lightning_shardlab.budget.measured.memory import measure_memory
from lightning_shardlab.budget.predicted.engine_schedule import Schedule, gathered_peak
from lightning_shardlab.guard.divergence import DivergenceError
from tests.helpers.launch import run_ranks
from tests.helpers.reference import FP32
from tests.models import GroupedGPT, OrderedData, RegressionNet, regression_dataset, token_dataset
from tests.test_checkpoint import QUIET

EPOCHS, STEPS_PER_EPOCH, GLOBAL_BATCH = 2, 3, 8
PER_BLOCK = {"unit_bucket_params": 0}  # a unit per block (these blocks are tiny): several units in every group
CONFIGS = {
    "2x2 stage 1": ("regression", {"stage": 1, "shard_group_size": 2, **PER_BLOCK}),
    "2x2 stage 2": ("regression", {"stage": 2, "shard_group_size": 2, **PER_BLOCK}),
    "2x2 stage 3": ("regression", {"stage": 3, "shard_group_size": 2, **PER_BLOCK}),
    "1x4 stage 3, reshard groups of 2": ("gpt", {"stage": 3, "reshard_after_forward": 2, **PER_BLOCK}),
    "1x4 stage 3, kept gathered": ("gpt", {"stage": 3, "reshard_after_forward": False, **PER_BLOCK}),
}
MODELS = {
    "regression": (lambda: RegressionNet("sgd"), lambda: regression_dataset(GLOBAL_BATCH * STEPS_PER_EPOCH)),
    "gpt": (GroupedGPT, lambda: token_dataset(GLOBAL_BATCH * STEPS_PER_EPOCH)),
}


class StepCalls(Callback):
    """The ledger's calls and bytes of each training step, by (scope, kind); with ``path``, saves a checkpoint
    at the end of the first epoch."""

    def __init__(self, path: str | None = None) -> None:
        self.steps: list[dict[tuple[str, str], tuple[int, int]]] = []
        self.peaks: list[int] = []  # bytes of gathered parameters (and group shards) at the step's busiest
        self.path = path

    def _now(self, trainer: L.Trainer) -> dict[tuple[str, str], tuple[int, int]]:
        return {k: (t.count, t.bytes) for k, t in trainer.strategy.sharded.comm.ledger.by_scope.items()}

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._before = self._now(trainer)
        trainer.strategy.sharded.comm.ledger.reset_peak()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        now = self._now(trainer)
        self.steps.append(
            {k: (c - self._before.get(k, (0, 0))[0], b - self._before.get(k, (0, 0))[1]) for k, (c, b) in now.items()}
        )
        self.peaks.append(trainer.strategy.sharded.comm.ledger.gathered_peak)

    def on_train_epoch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if self.path is not None and trainer.current_epoch == 0:
            trainer.save_checkpoint(self.path)


class Loaded(Callback):
    """The full weights when training starts: what a checkpoint loaded."""

    def on_train_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.state = trainer.strategy.full_state_dict()


class Nudge(Callback):
    """After step 2, rank 3 adds 1e-3 to the first element of its master shard of the first block."""

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == 2 and trainer.global_rank == 3:
            fp = next(fp for fp in trainer.strategy.sharded.flat_params if fp.layout.unit.startswith("net.blocks"))
            with torch.no_grad():
                fp.master[0] += 1e-3


def _fit(model: L.LightningModule, strategy: Any, world: int, callbacks: list, epochs: int = EPOCHS, **kwargs: Any):  # noqa: ANN202
    data = MODELS["gpt" if isinstance(model, GroupedGPT) else "regression"][1]()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_epochs=epochs,
        enable_checkpointing=False,
        callbacks=callbacks,
        **QUIET,
    )
    trainer.fit(model, OrderedData(data, GLOBAL_BATCH // world), **kwargs)
    return trainer


def _expected_calls(trainer: L.Trainer) -> dict[tuple[str, str], tuple[int, int]]:
    """A steady-state step's collectives (all_gather, reduce_scatter, all_reduce) by (scope, kind), with their
    full-tensor bytes, from the layout: stages 1-2 reduce-scatter each flat parameter and all-gather it after
    the step; stage 3 gathers the root and the unit that runs forward last once, every other unit twice (the
    second, before its backward, in the reshard group when there is one), unless kept gathered
    (``reshard_after_forward=False``); hybrid all-reduces each gradient
    shard across the replica group; the world agrees on unused parameters, the shard group on the grad norm."""
    sharded = trainer.strategy.sharded
    mesh, stage3 = sharded.mesh, int(sharded.config.stage) == 3
    inside = "shard" if mesh.hybrid else "world"
    out: dict[tuple[str, str], list[int]] = {}

    def add(scope: str, kind: str, nbytes: int) -> None:
        entry = out.setdefault((scope, kind), [0, 0])
        entry[0], entry[1] = entry[0] + 1, entry[1] + nbytes

    last = sharded.forward_order[-1]  # the unit that runs forward last stays gathered for its backward
    for unit in sharded.units:
        for fp in unit.flat_params:
            full = fp.layout.padded_numel * 4
            if fp.layout.requires_grad:
                add(inside, "reduce_scatter", full)
                if mesh.hybrid:
                    add("replica", "all_reduce", fp.layout.shard_numel * 4)
            if stage3 or fp.layout.requires_grad:
                add(inside, "all_gather", full)
            resharded = sharded.config.reshard_after_forward and not unit.is_root and unit is not last
            if stage3 and resharded:  # gathered again for its backward
                add("reshard" if mesh.regrouped else inside, "all_gather", full)
    add("world", "all_reduce", 4 * sum(len(fp.layout.slots) for fp in sharded.flat_params if fp.layout.requires_grad))
    add(inside, "all_reduce", 4)  # the grad norm ParityModule logs
    return {k: tuple(v) for k, v in out.items()}


def _zero_formula(trainer: L.Trainer, group: int) -> dict[str, int]:
    """Bytes per rank at N = ``group``: P_f padded to a multiple of N, shard S_f = P_f / N; fp32 SGD momentum
    (regression) or AdamW (gpt): params S_f (stage 3) or P_f, grads S_f, one or two state tensors per element."""
    sharded = trainer.strategy.sharded
    per_element = 2 if isinstance(trainer.lightning_module, GroupedGPT) else 1
    out = {"params": 0, "grads": 0, "optimizer_state": 0}
    for fp in sharded.flat_params:
        padded = -(-fp.layout.numel // group) * group
        assert fp.layout.world_size == group and fp.layout.padded_numel == padded
        s = padded // group
        out["params"] += 4 * (s if int(sharded.config.stage) == 3 else padded)
        if fp.layout.requires_grad:
            real = s - fp.layout.padding_in_shard(fp.rank)
            out["grads"] += 4 * s
            out["optimizer_state"] += 4 * per_element * real + (4 * len(fp.layout.slots) if per_element == 2 else 0)
    return out


def _report(trainer: L.Trainer, model: Any, calls: StepCalls) -> dict:
    memory = measure_memory(trainer.strategy.sharded.flat_params, trainer.optimizers)
    group = trainer.strategy.sharded.mesh.shard.world_size
    expected = _expected_calls(trainer)
    for step in calls.steps[2:]:  # steady state: no warm-up, no sanity check (every 10 steps)
        measured = {k: v for k, v in step.items() if k[1] in ("all_gather", "reduce_scatter", "all_reduce")}
        assert measured == expected, f"rank {trainer.global_rank}: {measured} != {expected}"
    formula = _zero_formula(trainer, group)
    assert {k: memory[k] for k in formula} == formula, (memory, formula)
    sharded = trainer.strategy.sharded
    units = {u.name: [fp.layout for fp in u.flat_params] for u in sharded.forward_order}
    k = sharded.mesh.reshard.world_size if sharded.mesh.regrouped else None
    peak = gathered_peak(units, sharded.policy, Schedule.of(sharded.config), k)
    assert calls.peaks[2:] == [peak] * len(calls.peaks[2:]), (calls.peaks, peak)
    return {
        "losses": torch.stack(model.losses).tolist(),
        "norms": torch.stack(model.grad_norms).tolist(),
        "state": trainer.strategy.full_state_dict(),
    }


def hybrid_matrix(tmp: str) -> dict:
    rank, results = int(os.environ["RANK"]), {}
    references = {}
    for name in MODELS:
        torch.manual_seed(0)
        initial = MODELS[name][0]()
        ddp = copy.deepcopy(initial)
        _fit(ddp, "ddp", 4, [])
        references[name] = (initial, ddp)
    for label, (name, options) in CONFIGS.items():
        model = copy.deepcopy(references[name][0])
        calls = StepCalls(path=f"{tmp}/C" if label == "2x2 stage 2" else None)
        trainer = _fit(model, ShardLabStrategy(**options), 4, [calls])
        results[label] = _report(trainer, model, calls)
        ddp = references[name][1]
        assert_close(torch.tensor(results[label]["losses"]), torch.stack(ddp.losses), **FP32, msg=label)
        assert_close(torch.tensor(results[label]["norms"]), torch.stack(ddp.grad_norms), **FP32, msg=label)
        if rank == 0:
            for key, value in ddp.state_dict().items():
                assert_close(results[label]["state"][key], value, **FP32, msg=f"{label}: {key}")
    final = results["2x2 stage 2"]["state"]
    resumed = {}
    for label, options in {"1x4": {"stage": 2}, "4x1": {"stage": 2, "shard_group_size": 1}}.items():
        torch.manual_seed(1)  # other initial weights: the checkpoint must win
        trainer = _fit(RegressionNet("sgd"), ShardLabStrategy(**options), 4, [], ckpt_path=f"{tmp}/C")
        resumed[label] = trainer.strategy.full_state_dict()
        if label == "1x4":
            trainer.save_checkpoint(f"{tmp}/E")  # a plain checkpoint, resumed below at 2x2
    loaded = Loaded()
    trainer = _fit(
        RegressionNet("sgd"), ShardLabStrategy(stage=3, shard_group_size=2), 4, [loaded], 3, ckpt_path=f"{tmp}/E"
    )
    if rank == 0:
        torch.save(final, f"{tmp}/final.pt")
        for label, state in resumed.items():
            for key, value in final.items():
                assert_close(state[key], value, **FP32, msg=f"resumed at {label}: {key}")
        for key, value in resumed["1x4"].items():
            assert torch.equal(loaded.state[key], value), f"1x4 checkpoint loaded at 2x2: {key}"
        assert trainer.global_step == 3 * STEPS_PER_EPOCH  # and trained on
    try:
        strategy = ShardLabStrategy(stage=3, shard_group_size=2, sanity_every_n_steps=2, **PER_BLOCK)
        _fit(copy.deepcopy(references["regression"][0]), strategy, 4, [Nudge()])
        divergence = None
    except DivergenceError as err:
        divergence = str(err)
    return {"divergence": divergence, "replicas": trainer.strategy.sharded.mesh.replica.world_size}


def resume_on_two(tmp: str) -> dict:
    torch.manual_seed(2)
    trainer = _fit(RegressionNet("sgd"), ShardLabStrategy(stage=3), 2, [], ckpt_path=f"{tmp}/C")
    return {"state": trainer.strategy.full_state_dict()}


def test_hybrid_and_reshard_groups_match_ddp_and_reshape_checkpoints(tmp_path: Path) -> None:
    reports = run_ranks("tests.test_hybrid:hybrid_matrix", 4, {"tmp": str(tmp_path)}, timeout=600)
    for rank, report in enumerate(reports):
        assert report["replicas"] == 2
        message = report["divergence"]
        assert message is not None, f"rank {rank}: the nudged master shard was not noticed"
        assert "master shard 1 of net.blocks.0[float32] on rank 3 differs from rank 1" in message, message
        assert "among ranks 1, 3" in message, message
    two = run_ranks("tests.test_hybrid:resume_on_two", 2, {"tmp": str(tmp_path)}, timeout=240)
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    for key, value in final.items():
        assert_close(two[0]["state"][key], value, **FP32, msg=f"resumed on 2 ranks: {key}")
