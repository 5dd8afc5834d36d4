"""Parity: a sharded run equals an unsharded reference on the same global batch, every step.

Each rank also runs the reference (tiny models), and after every backward and every optimizer step
compares its grad shard and master shard with the same slice of the reference's flat gradient and
parameters; the loss averaged over ranks must equal the reference's loss on the global batch.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from lightning_shardlab import ShardLabConfig, shard_model, shard_optimizer
from tests.helpers.launch import run_ranks
from tests.helpers.reference import FP32, init_from_env, mean_over_ranks, reference_shard, shutdown
from tests.models import OddNet, regression_batches

OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
}


def core_parity(
    stage: int,
    steps: int = 10,
    local_batch: int = 3,
    reshard_after_forward: bool = True,
    transport: str = "auto",
    unit_bucket_params: int = 1_000_000,
) -> dict:
    """Worker: train OddNet sharded and unsharded with each optimizer; assert equality every step."""
    comm = init_from_env()
    report = {}
    for name, make_optimizer in OPTIMIZERS.items():
        torch.manual_seed(0)
        reference = OddNet()
        model = copy.deepcopy(reference)
        config = ShardLabConfig(
            stage=stage,
            reshard_after_forward=reshard_after_forward,
            transport=transport,
            unit_bucket_params=unit_bucket_params,
        )
        sharded = shard_model(model, config, comm)
        optimizer = make_optimizer(model.parameters())
        shard_optimizer(optimizer, sharded)
        ref_optimizer = make_optimizer(reference.parameters())
        mine = slice(comm.rank * local_batch, (comm.rank + 1) * local_batch)
        worst = 0.0
        for step, (x, y) in enumerate(regression_batches(steps, local_batch * comm.world_size)):
            optimizer.zero_grad()
            ref_optimizer.zero_grad()
            with sharded.step(keep_root_gathered=True):
                loss = F.mse_loss(model(x[mine]), y[mine])
            sharded.prepare_backward(loss)
            loss.backward()
            ref_loss = F.mse_loss(reference(x), y)
            ref_loss.backward()
            assert_close(mean_over_ranks(loss, comm), ref_loss.detach(), **FP32, msg=f"{name} loss, step {step}")
            for fp in sharded.flat_params:
                assert fp.grad_shard is not None, f"{fp.layout.name} got no gradient at step {step}"
                expected = reference_shard(fp, reference, grads=True)
                assert_close(fp.grad_shard, expected, **FP32, msg=f"{name} grad shard {fp.layout.name}, step {step}")
            optimizer.step()
            ref_optimizer.step()
            for fp in sharded.flat_params:
                expected = reference_shard(fp, reference)
                assert_close(fp.master, expected, **FP32, msg=f"{name} master shard {fp.layout.name}, step {step}")
                worst = max(worst, (fp.master - expected).abs().max().item())
        report[name] = {"max_abs_diff": worst, "units": [u.name for u in sharded.units]}
    shutdown()
    return report


@pytest.mark.parametrize(("world_size", "buckets"), [(1, True), (2, False), (3, True), (4, False)])
def test_stage3_matches_unsharded_reference_every_step(world_size: int, buckets: bool) -> None:
    kwargs = {"stage": 3} if buckets else {"stage": 3, "unit_bucket_params": 0}
    reports = run_ranks("tests.test_parity:core_parity", world_size, kwargs, timeout=180)
    for report in reports:
        assert set(report) == {"adamw", "sgd"}
        # by default containers of blocks smaller than unit_bucket_params make no units (one unit: the root);
        # with unit_bucket_params=0 each block and each gate is a unit; the rest is the root unit
        per_block = ["root", "blocks.0", "blocks.1", "gates.0", "gates.1"]
        assert report["adamw"]["units"] == (["root"] if buckets else per_block)


def test_stage3_keep_gathered_after_forward_matches_reference() -> None:
    run_ranks("tests.test_parity:core_parity", 3, {"stage": 3, "reshard_after_forward": False, "steps": 4}, timeout=120)


def initial_values_come_from_rank_0() -> dict:
    """Every rank initialises differently; after setup all hold rank 0's values (and buffers)."""
    from lightning_shardlab.checkpoint.save_load import full_state_dict

    comm = init_from_env()
    torch.manual_seed(comm.rank)
    model = OddNet()
    model.register_buffer("counter", torch.full((3,), float(comm.rank)))
    original = {k: v.clone() for k, v in model.state_dict().items()}
    sharded = shard_model(model, ShardLabConfig(), comm)
    state = full_state_dict(sharded)
    buffer = model.counter.clone()
    shutdown()
    return {"original": original, "gathered": state, "buffer": buffer}


def test_rank_0_initial_values_are_broadcast() -> None:
    reports = run_ranks("tests.test_parity:initial_values_come_from_rank_0", 3, timeout=90)
    rank0 = reports[0]
    assert set(rank0["gathered"]) == set(rank0["original"])
    for key, value in rank0["original"].items():
        assert torch.equal(rank0["gathered"][key], value), key
    assert not torch.equal(reports[1]["original"]["inp.weight"], rank0["original"]["inp.weight"])
    assert all(torch.equal(r["buffer"], torch.zeros(3)) for r in reports)
