"""The ZeRO ladder against Lightning's own DDP, on the same data, for every stage.

Each scenario trains the same initial model twice in one set of ranks: once with Lightning's ``ddp``
strategy (the reference), once with shardlab at stages 1, 2 and 3. Every rank compares its local loss
and the global gradient norm at every step; rank 0 compares the final weights (DDP's module state
against ``full_state_dict()``). fp32 tolerance, at least 6 optimizer steps.

Whole-tensor optimizers (Muon with AdamW, Adafactor) also run a 2x2 hybrid layout on 4 ranks, and count the
Newton-Schulz iterations every rank ran: each matrix's, once per step, on one rank of the world. torch's Muon
orthogonalises in bfloat16, where a last-bit difference of an averaged gradient (DDP's all-reduce sums more than
two ranks in another order) can become a whole bfloat16 step of an update; so their reference is Lightning's DDP
with the gradients averaged in shardlab's order (``RankOrderDDP``), and the weights must be equal bit for bit.

``ddp_parity`` also runs with several ranks sharing one device under both strategies (``ranks_per_device``): the
GPU checks (tests/test_gpu.py) run the whole-tensor optimizers so on a machine with one GPU.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from unittest import mock

import lightning as L
import pytest
import torch
import torch.optim._muon as muon_impl
from torch.testing import assert_close

from lightning_shardlab import ShardLabStrategy
from tests.helpers.launch import run_ranks
from tests.helpers.reference import FP32, RankOrderDDP
from tests.models import (
    AdafactorGPT,
    BranchyNet,
    GroupedGPT,
    ManualNet,
    MuonGPT,
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
    whole_tensor: bool = False  # RankOrderDDP; the 2x2 hybrid layout on 4 ranks; weights bit for bit


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
    # Lightning counts each optimizer's steps: 12 steps are 6 batches, each stepping Muon then AdamW
    "muon_adamw_manual": Scenario(MuonGPT, token_dataset, {"max_steps": 12}, whole_tensor=True),
    "adafactor": Scenario(AdafactorGPT, token_dataset, whole_tensor=True),
}


def _layouts(scenario: Scenario, stages: list[int], world_size: int) -> dict[str, dict]:
    """Strategy options by label: each stage, and for whole-tensor optimizers on 4 ranks a 2x2 hybrid layout."""
    layouts = {f"stage {s}": {"stage": s} for s in stages}
    if scenario.whole_tensor and world_size == 4:
        layouts["2x2 stage 3"] = {"stage": 3, "shard_group_size": 2}
    return layouts


@contextmanager
def counting_newton_schulz() -> Iterator[list[int]]:
    """Counts the calls of torch Muon's Newton-Schulz orthogonalisation in this process (one per matrix)."""
    calls: list[int] = []
    run = muon_impl._zeropower_via_newtonschulz

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        return run(*args, **kwargs)

    with mock.patch.object(muon_impl, "_zeropower_via_newtonschulz", counted):
        yield calls


def _fit(
    scenario: Scenario, model: ParityModule, strategy: object, world_size: int, accelerator: str, per_device: int
) -> L.Trainer:
    """One fit on ``world_size`` ranks, ``per_device`` of them sharing each device."""
    steps = 12 * scenario.trainer.get("accumulate_grad_batches", 1)
    epochs = scenario.trainer.get("max_epochs", 1)
    data = scenario.data(max(steps, 2 * epochs) * scenario.local_batch * world_size // epochs)
    kwargs = {"max_steps": 6, "max_epochs": 1, **scenario.trainer}
    trainer = L.Trainer(
        accelerator=accelerator,
        devices=world_size // per_device,
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
    assert trainer.world_size == world_size, (type(strategy).__name__, trainer.world_size)
    return trainer


def ddp_parity(
    world_size: int, stages: list[int], names: list[str], accelerator: str = "cpu", ranks_per_device: int = 1
) -> dict:
    """Each scenario under the DDP reference and shardlab at ``stages``. ``ranks_per_device`` > 1: the ranks share
    the device, under both strategies (on a GPU: the proxy, over gloo)."""
    report, per_device = {}, ranks_per_device
    for name in names:
        scenario = SCENARIOS[name]
        torch.manual_seed(0)
        initial = scenario.model()
        references: dict[int | None, ParityModule] = {}
        for label, layout in _layouts(scenario, stages, world_size).items():
            group = layout.get("shard_group_size")
            if group not in references:
                references[group] = copy.deepcopy(initial)
                shared = scenario.whole_tensor or per_device > 1
                ddp = RankOrderDDP(group, per_device) if shared else scenario.ddp
                _fit(scenario, references[group], ddp, world_size, accelerator, per_device)
            reference = references[group]
            ref_state = {k: v.cpu() for k, v in reference.state_dict().items()}
            model = copy.deepcopy(initial)
            with counting_newton_schulz() as newton_schulz:
                strategy = ShardLabStrategy(**layout, **scenario.strategy, ranks_per_device=per_device)
                trainer = _fit(scenario, model, strategy, world_size, accelerator, per_device)
            where = f"{name}, {label}, rank {trainer.global_rank}"
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
            state = {k: v.cpu() for k, v in trainer.strategy.full_state_dict().items()}
            if trainer.global_rank == 0:
                assert list(state) == list(ref_state), where
                for key, value in ref_state.items():
                    assert_close(state[key], value, **FP32, msg=lambda m, k=key: f"{k}: {where}\n{m}")
                    assert torch.equal(state[key], value) or not scenario.whole_tensor, f"{key}: {where}"
                frozen = [n for n, p in initial.named_parameters() if not p.requires_grad]
                for key in frozen:  # bit for bit unchanged
                    assert torch.equal(state[key], initial.state_dict()[key].cpu()), f"{key}: {where}"
            report[(name, label)] = (len(model.losses), len(newton_schulz))
    return report


def _check_frozen(trainer: L.Trainer, where: str) -> None:
    """Frozen parameters have no gradient buffer and no optimizer state."""
    stateful = {id(p) for opt in trainer.optimizers for p, s in opt.state.items() if s}
    for fp in trainer.strategy.sharded.flat_params:
        if not fp.layout.requires_grad:
            assert fp.grad_shard is None, f"{fp.layout.name}: {where}"
            assert not any(p.grad is not None for p in fp.params), where
            assert not any(id(p) in stateful for p in fp.params), f"{fp.layout.name}: {where}"


# At 4 ranks, the scenarios whose sharding differs with the world size (shard boundaries and padding, owners of
# whole tensors, a 2x2 layout, accumulation, two optimizers, an unused branch); the other norms of clipping and the
# CNN's buffers reduce the same way at any world size, and run at 2 ranks.
SAME_AT_ANY_WORLD = ("clip_norm_1", "clip_norm_inf", "clip_value", "cnn_batchnorm_sgd_steplr")


@pytest.mark.parametrize("world_size", [pytest.param(2, marks=pytest.mark.quick), 4])
def test_every_stage_matches_lightning_ddp(world_size: int) -> None:
    names = [n for n in SCENARIOS if world_size == 2 or n not in SAME_AT_ANY_WORLD]
    reports = run_ranks(
        "tests.test_ddp_parity:ddp_parity",
        world_size,
        {"world_size": world_size, "stages": [1, 2, 3], "names": names},
        timeout=900,
    )
    for report in reports:
        expected = [(n, label) for n in names for label in _layouts(SCENARIOS[n], [1, 2, 3], world_size)]
        assert sorted(report) == sorted(expected)
    # Muon: each of the 12 block matrices orthogonalised once per batch (6), on exactly one rank of the world
    for label in _layouts(SCENARIOS["muon_adamw_manual"], [1, 2, 3], world_size):
        counts = [report[("muon_adamw_manual", label)][1] for report in reports]
        assert sum(counts) == 12 * 6 and all(counts), (label, counts)
