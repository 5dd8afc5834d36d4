"""Buckets: small consecutive blocks merged into one unit, so they pay one collective latency, not one each.

Block(4) has 4*17+17 + 17*4+4 = 157 parameters. With ``unit_bucket_params=313`` (two blocks' worth less one)
a bucket closes once it holds two blocks: four blocks become ``layers.0-1`` and ``layers.2-3``; three become
one bucket (the short last one joins the one before); blocks that altogether hold fewer than the threshold
make no units (the enclosing unit keeps them). Sharded on 2 ranks at stage 3, every step of four blocks in
two buckets equals the unsharded reference, with and without activation checkpointing inside a bucket, and
the ledger counts one all-gather per bucket per gather and one reduce-scatter per bucket.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

from lightning_shardlab import ShardLabConfig, shard_model, shard_optimizer
from lightning_shardlab.sharding.policy import choose_units
from tests.helpers.launch import run_ranks
from tests.helpers.reference import FP32, init_from_env, mean_over_ranks, reference_shard, shutdown
from tests.models import Block, Checkpointed, DictValues, TinyGPT

BLOCK = 4 * 17 + 17 + 17 * 4 + 4


def test_buckets_close_at_the_threshold_and_stay_inside_one_container() -> None:
    assert BLOCK == sum(p.numel() for p in DictValues().layers[0].parameters())
    choice = choose_units(_four_blocks(DictValues("dict")), ShardLabConfig(unit_bucket_params=2 * BLOCK - 1))
    assert choice.paths == ["", "layers.0-1", "layers.2-3"]
    assert choice.members == {"layers.0-1": ["layers.0", "layers.1"], "layers.2-3": ["layers.2", "layers.3"]}
    three = choose_units(DictValues(), ShardLabConfig(unit_bucket_params=2 * BLOCK - 1))
    assert three.paths == ["", "layers.0-2"]  # the last bucket, one block short, joins the one before
    assert choose_units(DictValues(), ShardLabConfig(unit_bucket_params=3 * BLOCK + 1)).paths == [""]
    assert choose_units(DictValues(), ShardLabConfig(unit_bucket_params=BLOCK)).paths == [
        "",
        *map("layers.{}".format, "012"),
    ]
    assert choose_units(DictValues(), ShardLabConfig(unit_bucket_params=0)).paths == [
        "",
        *map("layers.{}".format, "012"),
    ]
    # by default (1M parameters) a tiny model is one unit; unit_classes are the user's word
    assert choose_units(TinyGPT(n_layer=3), ShardLabConfig()).paths == [""]
    user = ShardLabConfig(unit_classes=("tests.models.basic.Block",))
    assert choose_units(DictValues(), user).paths == ["", "layers.0", "layers.1", "layers.2"]


def _four_blocks(model: nn.Module) -> nn.Module:
    """``Looped`` with a fourth block (its forward runs every block of the container)."""
    if isinstance(model.layers, nn.ModuleDict):
        model.layers["3"] = Block(4)
    else:
        model.layers.append(Block(4))
    return model


def bucket_parity(steps: int = 4, local_batch: int = 3) -> dict:
    comm = init_from_env()
    out = {}
    for model_class in (DictValues, Checkpointed):
        torch.manual_seed(0)
        reference = _four_blocks(model_class("dict" if model_class is DictValues else "list"))
        model = copy.deepcopy(reference)
        sharded = shard_model(model, ShardLabConfig(stage=3, unit_bucket_params=2 * BLOCK - 1), comm)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        shard_optimizer(optimizer, sharded)
        ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
        g = torch.Generator().manual_seed(1)
        counts = []
        for step in range(steps):
            x, y = (
                torch.randn(local_batch * comm.world_size, 4, generator=g),
                torch.randn(local_batch * comm.world_size, 4, generator=g),
            )
            mine = slice(comm.rank * local_batch, (comm.rank + 1) * local_batch)
            before = {k: t.count for k, t in comm.ledger.by_kind.items()}
            with sharded.step(keep_root_gathered=True):
                loss = F.mse_loss(model(x[mine]), y[mine])
            sharded.prepare_backward(loss)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            counts.append({k: t.count - before.get(k, 0) for k, t in comm.ledger.by_kind.items()})
            ref_loss = F.mse_loss(reference(x), y)
            ref_loss.backward()
            ref_optimizer.step()
            ref_optimizer.zero_grad()
            assert_close(mean_over_ranks(loss, comm), ref_loss.detach(), **FP32, msg=f"{model_class.__name__} {step}")
            for fp in sharded.flat_params:
                assert_close(fp.master, reference_shard(fp, reference), **FP32, msg=f"{fp.layout.name} {step}")
        out[model_class.__name__] = {"units": [u.name for u in sharded.units], "counts": counts[1:]}
    shutdown()
    return out


def test_a_bucket_trains_like_its_blocks_and_moves_one_message_per_gather() -> None:
    report = run_ranks("tests.test_buckets:bucket_parity", 2, {}, timeout=180)[0]
    for name, result in report.items():
        assert result["units"] == ["root", "layers.0-1", "layers.2-3"], name
        for counts in result["counts"]:
            # the root holds no parameters here; layers.0-1 is gathered for forward and again for backward,
            # layers.2-3 (last in forward) once; one reduce-scatter per bucket; one unused-parameter agreement
            assert counts.get("all_gather") == 3 and counts.get("reduce_scatter") == 2, (name, counts)
            assert counts.get("all_reduce") == 1, (name, counts)
