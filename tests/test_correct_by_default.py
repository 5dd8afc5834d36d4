"""Correct by default on models and callbacks a new user brings, against Lightning's DDP on the same batches.

Each scenario trains the same initial model with Lightning ``ddp`` (``ddp_find_unused_parameters_true``
where parameters go unused, as DDP requires) and with shardlab at stages 1, 2 and 3 with default
options, in one set of ranks. Every rank compares its losses every step; rank 0 compares the final
weights. The scenarios:

    weights_read_between_steps   a callback reads every weight in on_train_batch_end, every rank, every step
                                 (stages 1-2: the module's own parameters; stage 3: inside gathered_params())
    alternating_branch           a branch that alternates by step and an unused layer (AdamW, weight decay)
    moe_top1 / moe_top2_blocks   mixture-of-experts routing where experts get no tokens on some ranks
    writeback                    a callback halves the head's weights between two steps (gathered_params
                                 with writeback=True under shardlab, in place under DDP)

After training, the full weights inside ``gathered_params()`` equal ``full_state_dict()`` bit for bit.
"""

from __future__ import annotations

import copy
from contextlib import nullcontext
from dataclasses import dataclass, field

import lightning as L
import pytest
import torch
from torch.testing import assert_close

from lightning_shardlab import ShardLabStrategy
from lightning_shardlab.comm.mismatch import CollectiveMismatch
from tests.helpers.launch import run_ranks
from tests.helpers.reference import FP32
from tests.models import (
    BranchyNet,
    MoENet,
    OrderedData,
    ParityModule,
    RankOneExtra,
    RegressionNet,
    SwappedBlocks,
    regression_dataset,
)


def shardlab_stage(trainer: L.Trainer) -> int | None:
    return int(trainer.strategy.config.stage) if isinstance(trainer.strategy, ShardLabStrategy) else None


class WeightReader(L.Callback):
    """What any weight-reading callback (EMA, logging, pruning) does: read every weight after every step."""

    def __init__(self) -> None:
        self.sums: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        full = trainer.strategy.gathered_params() if shardlab_stage(trainer) == 3 else nullcontext()
        with full:
            self.sums.append(torch.stack([p.detach().double().sum() for p in pl_module.parameters()]))


class HalveHead(L.Callback):
    """Changes weights between steps 3 and 4, on every rank."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        if trainer.global_step != 3:
            return
        head = pl_module.net.out
        full = trainer.strategy.gathered_params([head], writeback=True) if shardlab_stage(trainer) else nullcontext()
        with full, torch.no_grad():
            for p in head.parameters():
                p.mul_(0.5)


@dataclass
class Scenario:
    model: type
    kwargs: dict = field(default_factory=dict)
    callback: type | None = None
    ddp: str = "ddp"


SCENARIOS = {
    "weights_read_between_steps": Scenario(RegressionNet, {}, WeightReader),
    "alternating_branch": Scenario(BranchyNet, ddp="ddp_find_unused_parameters_true"),
    "moe_top1": Scenario(MoENet, {"experts": 4, "top_k": 1}, ddp="ddp_find_unused_parameters_true"),
    "moe_top2_blocks": Scenario(MoENet, {"experts": 6, "top_k": 2, "blocks": 2}, ddp="ddp_find_unused_parameters_true"),
    "writeback": Scenario(RegressionNet, {"optimizer": "sgd"}, HalveHead),
}


def _fit(model: ParityModule, strategy: object, callback: L.Callback | None, world_size: int) -> L.Trainer:
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=strategy,
        max_steps=6,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[callback] if callback else [],
    )
    trainer.fit(model, OrderedData(regression_dataset(6 * 2 * world_size), 2))
    return trainer


def _routed_differently(model: MoENet, world_size: int) -> bool:
    """Whether, in some forward, the set of experts that got tokens differed between ranks."""
    mine = torch.tensor(
        [[int(e in ran) for e in range(len(layer.experts))] for layer in model.layers() for ran in layer.ran]
    )
    everyone = [torch.zeros_like(mine) for _ in range(world_size)]
    torch.distributed.all_gather(everyone, mine)
    return any(not torch.equal(everyone[0], other) for other in everyone[1:])


def correct_by_default(world_size: int, names: list[str], stages: list[int]) -> dict:
    report = {}
    for name in names:
        scenario = SCENARIOS[name]
        torch.manual_seed(0)
        initial = scenario.model(**scenario.kwargs)
        reference = copy.deepcopy(initial)
        ref_callback = scenario.callback() if scenario.callback else None
        _fit(reference, scenario.ddp, ref_callback, world_size)
        ref_state = reference.state_dict()
        for stage in stages:
            model = copy.deepcopy(initial)
            callback = scenario.callback() if scenario.callback else None
            trainer = _fit(model, ShardLabStrategy(stage=stage), callback, world_size)
            where = f"{name}, stage {stage}, rank {trainer.global_rank}"
            assert_close(
                torch.stack(model.losses), torch.stack(reference.losses), **FP32, msg=lambda m: f"{where}\n{m}"
            )
            if isinstance(callback, WeightReader):
                assert len(callback.sums) == len(ref_callback.sums) == 6, where
                assert_close(
                    torch.stack(callback.sums),
                    torch.stack(ref_callback.sums),
                    rtol=1e-6,
                    atol=1e-6,
                    msg=lambda m: f"weights read in on_train_batch_end: {where}\n{m}",
                )
            with trainer.strategy.gathered_params():
                gathered = {n: p.detach().clone() for n, p in model.named_parameters()}
            state = trainer.strategy.full_state_dict()
            if trainer.global_rank == 0:
                assert list(state) == list(ref_state), where
                for key, value in ref_state.items():
                    assert_close(state[key], value, **FP32, msg=lambda m, k=key: f"{k}: {where}\n{m}")
                for key, value in gathered.items():
                    assert torch.equal(value, state[key]), f"gathered_params() vs full_state_dict(): {key}, {where}"
            if isinstance(model, MoENet):
                report[(name, "routed_differently", stage)] = _routed_differently(model, world_size)
            report[(name, stage)] = len(model.losses)
    return report


@pytest.mark.parametrize("world_size", [2])
def test_models_and_callbacks_users_bring_match_ddp_with_default_options(world_size: int) -> None:
    names = list(SCENARIOS)
    reports = run_ranks(
        "tests.test_correct_by_default:correct_by_default",
        world_size,
        {"world_size": world_size, "names": names, "stages": [1, 2, 3]},
        timeout=600,
    )
    for report in reports:
        for name in names:
            for stage in (1, 2, 3):
                assert report[(name, stage)] == 6
                if name.startswith("moe"):  # the case that hangs or aborts when experts are units
                    assert report[(name, "routed_differently", stage)], (name, stage)


# ---- ranks that part: a named error on every rank, at the collective where they part ----


def part_ways(model: str, stage: int) -> dict:
    """Train a model whose ranks run different units; return this rank's error. Without the verified
    collectives they would hang (the test's wall clock ends that) or abort inside gloo."""
    torch.manual_seed(0)
    module = {"rank_one_extra": RankOneExtra, "swapped": SwappedBlocks, "experts": MoENet}[model]()
    units = {"rank_one_extra": ["tests.models.routing.Extra"], "experts": ["tests.models.routing.Expert"]}.get(
        model
    )  # forced
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        # swapped: two same-sized blocks, each its own unit (not one bucket)
        strategy=ShardLabStrategy(stage=stage, unit_classes=units, unit_bucket_params=0),
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    try:
        trainer.fit(module, OrderedData(regression_dataset(16), 2))
    except CollectiveMismatch as err:
        return {"error": str(err)}
    return {"error": None}


@pytest.mark.parametrize(
    ("model", "stage"), [("rank_one_extra", 3), ("rank_one_extra", 2), ("swapped", 3), ("swapped", 2), ("experts", 3)]
)
def test_ranks_that_part_raise_a_named_error_on_every_rank(model: str, stage: int) -> None:
    reports = run_ranks("tests.test_correct_by_default:part_ways", 2, {"model": model, "stage": stage}, timeout=120)
    for rank, report in enumerate(reports):
        error = report["error"]
        assert error is not None and error.startswith(f"[rank {rank}] collective #"), report
        assert "(verified before it ran)" in error and "HINT:" in error
        if model == "rank_one_extra":  # which unit, who ran it, and the block to make the unit instead
            assert "rank 1 gathered unit 'extra'" in error or "rank 1 reduced the gradients of unit 'extra'" in error
            assert "leave tests.models.routing.Extra out of unit_classes" in error, error
        elif model == "experts":  # experts made units by the user, routed differently on each rank
            assert "unit 'moe.experts." in error, error
            fix = "unit_classes=['tests.models.routing.MoELayer'] makes each MoELayer (here 'moe') one unit"
            assert fix in error, error
        else:  # two units of one size, swapped: the silent exchange of the wrong unit, caught
            assert "unit 'blocks.0'" in error and "unit 'blocks.1'" in error, error
            assert "run the tests.models.basic.Block blocks in the same order on every rank" in error, error
    assert reports[0]["error"].split(": ", 1)[1] == reports[1]["error"].split(": ", 1)[1]  # the same on every rank


def test_find_unused_parameters_false_is_an_explicit_trade_with_a_warning() -> None:
    """One process: a parameter no rank used keeps a None gradient by default; with False it gets zeros."""
    from lightning_shardlab import Comm, ShardLabConfig, shard_model, shard_optimizer

    grads = {}
    for unused in (True, False):
        torch.manual_seed(0)
        model = BranchyNet()
        sharded = shard_model(model, ShardLabConfig(find_unused_parameters=unused), Comm.single())
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        shard_optimizer(optimizer, sharded)
        x, y = regression_dataset(4).tensors
        with sharded.step(keep_root_gathered=True):
            loss = torch.nn.functional.mse_loss(model.out(model.branches[0](model.inp(x))), y)
        sharded.prepare_backward(loss)
        with (
            pytest.warns(UserWarning, match=r"find_unused_parameters=False\): .*unused\.weight")
            if not unused
            else nullcontext()
        ):
            loss.backward()
        by_name = {name: master for name, master, _ in sharded.master_params_by_id().values()}
        grads[unused] = {name: by_name[name].grad for name in ("unused.weight", "branches.1.l1.weight", "inp.weight")}
    assert grads[True]["unused.weight"] is None and grads[True]["branches.1.l1.weight"] is None
    assert grads[True]["inp.weight"] is not None
    assert torch.count_nonzero(grads[False]["unused.weight"]) == 0  # a zero gradient: AdamW would still decay it
