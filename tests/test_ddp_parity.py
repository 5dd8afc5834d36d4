"""The ZeRO ladder against Lightning's own DDP, on the same data, for every stage.

Each scenario trains the same initial model twice in one set of ranks: once with Lightning's ``ddp``
strategy (the reference), once with shardlab at stages 1, 2 and 3. Every rank compares its local loss
and the global gradient norm at every step; rank 0 compares the final weights (DDP's module state
against ``full_state_dict()``). fp32 tolerance, at least 6 optimizer steps.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field

import lightning as L
import pytest
import torch
from torch.testing import assert_close

from lightning_shardlab import ShardLabStrategy
from tests.helpers.launch import run_ranks
from tests.helpers.reference import FP32
from tests.models import (
    BranchyNet,
    GroupedGPT,
    ManualNet,
    OrderedData,
    ParityModule,
    RegressionNet,
    TinyCNN,
    image_dataset,
    regression_dataset,
    token_dataset,
)


@dataclass
class Scenario:
    model: Callable[[], ParityModule]
    data: Callable[[int], object]
    trainer: dict = field(default_factory=dict)
    strategy: dict = field(default_factory=dict)
    ddp: str = "ddp"
    clip_norm_type: float = 2.0
    local_batch: int = 2


SCENARIOS = {
    "accumulate_reduce": Scenario(
        lambda: RegressionNet("sgd"), regression_dataset, {"accumulate_grad_batches": 2}, {"accumulation": "reduce"}
    ),
    "accumulate_defer": Scenario(
        lambda: RegressionNet("sgd"), regression_dataset, {"accumulate_grad_batches": 2}, {"accumulation": "defer"}
    ),
    "clip_norm_2": Scenario(lambda: RegressionNet(), regression_dataset, {"gradient_clip_val": 0.05}),
    "clip_norm_1": Scenario(
        lambda: RegressionNet(),
        regression_dataset,
        {"gradient_clip_val": 0.2},
        {"gradient_clip_norm_type": 1.0},
        clip_norm_type=1.0,
    ),
    "clip_norm_inf": Scenario(
        lambda: RegressionNet(),
        regression_dataset,
        {"gradient_clip_val": 0.01},
        {"gradient_clip_norm_type": "inf"},
        clip_norm_type=float("inf"),
    ),
    "clip_value": Scenario(
        lambda: RegressionNet("sgd"),
        regression_dataset,
        {"gradient_clip_val": 0.002, "gradient_clip_algorithm": "value"},
    ),
    "gpt_tied_frozen_groups_warmup": Scenario(GroupedGPT, token_dataset),
    "cnn_batchnorm_sgd_steplr": Scenario(TinyCNN, image_dataset, {"max_epochs": 3, "max_steps": -1}),
    # each training step steps two optimizers, and Lightning counts optimizer steps
    "manual_two_optimizers_clip": Scenario(ManualNet, regression_dataset, {"max_steps": 12}),
    "unused_layer_alternating_branch": Scenario(
        BranchyNet,
        regression_dataset,
        {},
        {},  # default options
        ddp="ddp_find_unused_parameters_true",
    ),
}


def _fit(scenario: Scenario, model: ParityModule, strategy: object, world_size: int) -> L.Trainer:
    steps = 12 * scenario.trainer.get("accumulate_grad_batches", 1)
    epochs = scenario.trainer.get("max_epochs", 1)
    data = scenario.data(max(steps, 2 * epochs) * scenario.local_batch * world_size // epochs)
    kwargs = {"max_steps": 6, "max_epochs": 1, **scenario.trainer}
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=strategy,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
        **kwargs,
    )
    model.clip_norm_type = scenario.clip_norm_type
    trainer.fit(model, OrderedData(data, scenario.local_batch))
    return trainer


def ddp_parity(world_size: int, stages: list[int], names: list[str]) -> dict:
    report = {}
    for name in names:
        scenario = SCENARIOS[name]
        torch.manual_seed(0)
        initial = scenario.model()
        reference = copy.deepcopy(initial)
        _fit(scenario, reference, scenario.ddp, world_size)
        ref_state = reference.state_dict()
        for stage in stages:
            model = copy.deepcopy(initial)
            trainer = _fit(scenario, model, ShardLabStrategy(stage=stage, **scenario.strategy), world_size)
            where = f"{name}, stage {stage}, rank {trainer.global_rank}"
            assert len(model.losses) == len(reference.losses) >= 6, where
            assert_close(
                torch.stack(model.losses), torch.stack(reference.losses), **FP32, msg=lambda m: f"losses: {where}\n{m}"
            )
            assert_close(
                torch.stack(model.grad_norms),
                torch.stack(reference.grad_norms),
                **FP32,
                msg=lambda m: f"grad norms: {where}\n{m}",
            )
            _check_frozen(trainer, where)
            state = trainer.strategy.full_state_dict()
            if trainer.global_rank == 0:
                assert list(state) == list(ref_state), where
                for key, value in ref_state.items():
                    assert_close(state[key], value, **FP32, msg=lambda m, k=key: f"{k}: {where}\n{m}")
                frozen = [n for n, p in initial.named_parameters() if not p.requires_grad]
                for key in frozen:  # bit for bit unchanged
                    assert torch.equal(state[key], initial.state_dict()[key]), f"{key}: {where}"
            report[(name, stage)] = len(model.losses)
    return report


def _check_frozen(trainer: L.Trainer, where: str) -> None:
    """Frozen parameters have no gradient buffer and no optimizer state."""
    stateful = {id(p) for opt in trainer.optimizers for p, s in opt.state.items() if s}
    for fp in trainer.strategy.sharded.flat_params:
        if not fp.layout.requires_grad:
            assert fp.grad_shard is None, f"{fp.layout.name}: {where}"
            assert not any(p.grad is not None for p in fp.params), where
            assert not any(id(p) in stateful for p in fp.params), f"{fp.layout.name}: {where}"


@pytest.mark.parametrize("world_size", [pytest.param(2, marks=pytest.mark.quick), 4])
def test_every_stage_matches_lightning_ddp(world_size: int) -> None:
    names = list(SCENARIOS)
    reports = run_ranks(
        "tests.test_ddp_parity:ddp_parity",
        world_size,
        {"world_size": world_size, "stages": [1, 2, 3], "names": names},
        timeout=900,
    )
    for report in reports:
        assert sorted(report) == sorted((n, s) for n in names for s in (1, 2, 3))
