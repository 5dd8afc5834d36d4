"""Through the plain Trainer: a GPT-style LightningModule trains sharded and equals the reference."""

from __future__ import annotations

import copy
import os

import lightning as L
import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from lightning_shardlab import ShardLabStrategy
from lightning_shardlab.sharding.placeholders import ShardedAtRest
from tests.helpers.counting import counting_collectives
from tests.helpers.launch import run_ranks
from tests.helpers.reference import FP32
from tests.models import OrderedData, TinyGPT, global_batches, token_dataset

QUIET = dict(
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    use_distributed_sampler=False,
)


def fit_gpt(
    strategy, world_size: int, steps: int, local_batch: int, optimizer: str = "adamw", **trainer_kwargs
) -> tuple:
    """Fit TinyGPT on ``world_size`` ranks (``devices=world_size`` unless the kwargs say otherwise)."""
    torch.manual_seed(0)
    model = TinyGPT(optimizer=optimizer)
    reference = copy.deepcopy(model)
    data = token_dataset(steps * local_batch * world_size)
    kwargs = {"accelerator": "cpu", "devices": world_size, **trainer_kwargs}
    trainer = L.Trainer(
        strategy=strategy, max_steps=steps, num_sanity_val_steps=0, limit_val_batches=0, **QUIET, **kwargs
    )
    trainer.fit(model, OrderedData(data, local_batch))
    return trainer, model, reference, data


def reference_run(reference: TinyGPT, data, local_batch: int, world_size: int) -> tuple[list, dict]:
    optimizer = reference.configure_optimizers()
    losses = []
    for batch in global_batches(data, local_batch, world_size):
        optimizer.zero_grad()
        loss = reference.loss(batch)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return losses, reference.state_dict()


def gpt_parity(
    world_size: int,
    stage: int = 3,
    steps: int = 10,
    local_batch: int = 2,
    optimizer: str = "adamw",
    ranks_per_device: int = 1,
    shard_group_size: int | str | None = None,
    offload: str = "none",
    **trainer_kwargs,
) -> dict:
    """Fit sharded, then (rank 0) check losses and weights against the unsharded reference."""
    strategy = ShardLabStrategy(
        stage=stage, ranks_per_device=ranks_per_device, shard_group_size=shard_group_size, offload=offload
    )
    trainer, model, reference, data = fit_gpt(strategy, world_size, steps, local_batch, optimizer, **trainer_kwargs)
    assert trainer.world_size == world_size
    state = trainer.strategy.full_state_dict()
    losses = torch.stack(model.losses).cpu()
    if world_size > 1:
        dist.all_reduce(losses)
    losses /= world_size
    if trainer.global_rank != 0:
        assert state == {}
        return {}
    ref_losses, ref_state = reference_run(reference, data, local_batch, world_size)
    assert len(ref_losses) == steps
    assert_close(losses, torch.stack(ref_losses), **FP32)
    assert list(state) == list(ref_state)  # exactly the module's own keys, in order
    for key, value in ref_state.items():
        assert state[key].device.type == "cpu"
        assert_close(state[key], value, **FP32, msg=key)
    mesh = trainer.strategy.sharded.mesh
    trainable = [fp for fp in trainer.strategy.sharded.flat_params if fp.layout.requires_grad]
    return {
        "masters_pinned_on_host": all(fp.master.is_pinned() for fp in trainable),
        "losses": losses.tolist(),
        "world_size": trainer.world_size,
        "shard_group": list(mesh.shard.ranks or range(trainer.world_size)),
        "replicas": mesh.replica.world_size,
    }


@pytest.mark.parametrize("world_size", [2, 3])
def test_gpt_through_trainer_matches_reference(world_size: int) -> None:
    reports = run_ranks("tests.test_trainer:gpt_parity", world_size, {"world_size": world_size}, timeout=240)
    losses = reports[0]["losses"]
    assert losses[-1] < losses[0]  # it learns


def world_size_one_bit_exact() -> dict:
    """World size 1: no collective at all, and bit for bit what plain Lightning computes."""
    with counting_collectives() as calls:
        sharded_trainer, sharded_model, _, _ = fit_gpt(ShardLabStrategy(), 1, steps=6, local_batch=4)
    plain_trainer, plain_model, _, _ = fit_gpt("auto", 1, steps=6, local_batch=4)
    sharded_state = sharded_trainer.strategy.full_state_dict()
    return {
        "calls": dict(calls),
        "losses_equal": torch.equal(torch.stack(sharded_model.losses), torch.stack(plain_model.losses)),
        "params_equal": {k: torch.equal(v, sharded_state[k]) for k, v in plain_model.state_dict().items()},
    }


def test_world_size_one_issues_no_collective_and_equals_plain_lightning_bit_for_bit() -> None:
    (report,) = run_ranks("tests.test_trainer:world_size_one_bit_exact", 1, timeout=180)
    assert report["calls"] == {}
    assert report["losses_equal"]
    assert report["params_equal"] and all(report["params_equal"].values()), report["params_equal"]


def eval_loops(world_size: int) -> dict:
    """validate / test / predict run sharded (gather, compute, free) and equal the unsharded model."""
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = TinyGPT()
    reference = copy.deepcopy(model)
    data = token_dataset(4 * world_size)
    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=ShardLabStrategy(), **QUIET)
    val = trainer.validate(model, OrderedData(data, 2), verbose=False)[0]["val_loss"]
    test = trainer.test(model, OrderedData(data, 2), verbose=False)[0]["test_loss"]
    predictions = trainer.predict(model, OrderedData(data, 2))
    mine = data.tensors[0][rank::world_size]  # what this rank's sampler gave it, in order
    expected = [reference(mine[i : i + 2]) for i in range(0, len(mine), 2)]
    with torch.no_grad():
        ref_loss = reference.loss(data.tensors).item()
    return {
        "val": val,
        "test": test,
        "ref_loss": ref_loss,
        "predictions_equal": [torch.allclose(p, e, **FP32) for p, e in zip(predictions, expected)],
        "sharded_at_rest": all(isinstance(p, ShardedAtRest) for p in model.blocks.parameters()),
    }


def test_validate_test_predict_run_sharded_and_match() -> None:
    for report in run_ranks("tests.test_trainer:eval_loops", 2, {"world_size": 2}, timeout=120):
        assert report["val"] == pytest.approx(report["ref_loss"], rel=1e-6)
        assert report["test"] == pytest.approx(report["ref_loss"], rel=1e-6)
        assert report["predictions_equal"] == [True, True]
        assert report["sharded_at_rest"]
