"""The layout is pure: shard k is the k-th slice, padding is < world size and zero, views alias the buffer."""

from __future__ import annotations

import pytest
import torch

from lightning_shardlab.sharding.flat_param import FlatParam, FlatParamLayout, alloc_storage, free_storage
from lightning_shardlab.sharding.placeholders import ShardedAtRest

SHAPES = [(("a.weight",), (7, 15)), (("a.bias",), (7,)), (("b.w", "c.w"), (1,)), (("d",), (17, 3))]


def layout(world_size: int) -> FlatParamLayout:
    return FlatParamLayout.build("unit", torch.float32, True, [(f, torch.Size(s)) for f, s in SHAPES], world_size)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 200])
def test_padding_and_shard_ranges(world_size: int) -> None:
    lay = layout(world_size)
    numel = 7 * 15 + 7 + 1 + 17 * 3
    assert lay.numel == numel
    assert lay.padded_numel % world_size == 0 and 0 <= lay.padding < world_size
    assert lay.padded_numel == numel + lay.padding
    ranges = [lay.shard_range(r) for r in range(world_size)]
    assert ranges[0][0] == 0 and ranges[-1][1] == lay.padded_numel
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # contiguous, in rank order


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 200])
def test_slots_split_across_shards_cover_each_parameter_once(world_size: int) -> None:
    lay = layout(world_size)
    for slot in lay.slots:
        covered = []
        for rank in range(world_size):
            lo, hi = lay.slot_in_shard(slot, rank)
            start = lay.shard_range(rank)[0]
            covered.extend(range(start + lo, start + hi))
        assert covered == list(range(slot.offset, slot.offset + slot.numel))


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_shard_k_is_kth_slice_and_padding_zero(world_size: int) -> None:
    lay = layout(world_size)
    values = [torch.randn(s) for _, s in SHAPES]
    expected_full = torch.cat([v.reshape(-1) for v in values] + [torch.zeros(lay.padding)])
    for rank in range(world_size):
        fp = FlatParam(lay, rank, torch.device("cpu"), resident_full=False)
        fp.load(fp.flatten(values))
        start, end = lay.shard_range(rank)
        assert torch.equal(fp.shard, expected_full[start:end])
        assert fp.master is fp.shard  # fp32: the master is the shard itself
        for slot, master in zip(lay.slots, fp.master_params):
            lo, hi = lay.slot_in_shard(slot, rank)
            assert torch.equal(master, expected_full[start + lo : start + hi])
            assert master.untyped_storage().data_ptr() == fp.shard.untyped_storage().data_ptr()
        assert torch.equal(fp.flatten(values)[lay.numel :], torch.zeros(lay.padding))


def test_unsharded_views_alias_full_buffer_through_free_and_alloc() -> None:
    lay = layout(2)
    fp = FlatParam(lay, 0, torch.device("cpu"), resident_full=False)
    fp.show_views()
    weight = fp.params[0]
    version = weight._version
    assert weight.shape == (7, 15)
    free_storage(fp.full)
    assert fp.full.untyped_storage().size() == 0
    alloc_storage(fp.full)
    fp.full.fill_(3.0)  # the all-gather writes here
    assert torch.equal(weight, torch.full((7, 15), 3.0))  # the same storage object, grown back
    # writing the buffer does not bump the views' version counters (autograd saved them)
    assert weight._version == version


def test_stubs_keep_original_shapes_and_hold_no_memory() -> None:
    fp = FlatParam(layout(3), 1, torch.device("cpu"), resident_full=False)
    params = list(fp.params)
    fp.show_stubs()
    assert [tuple(p.shape) for p in fp.params] == [s for _, s in SHAPES]
    assert all(isinstance(p, ShardedAtRest) for p in fp.params)
    assert all(a is b for a, b in zip(fp.params, params))  # the same objects: only their data changed
    assert all(s.untyped_storage().nbytes() == 0 for s in fp.stubs)  # no memory


def test_resident_full_shard_is_a_view() -> None:
    fp = FlatParam(layout(2), 1, torch.device("cpu"), resident_full=True)
    start, _ = fp.layout.shard_range(1)
    assert fp.shard.data_ptr() == fp.full[start:].data_ptr()
    assert not fp.gathers


def test_mixed_precision_tensors_have_their_dtypes() -> None:
    lay = layout(3)
    values = [torch.randn(s) for _, s in SHAPES]
    fp = FlatParam(lay, 1, torch.device("cpu"), resident_full=False, compute_dtype=torch.bfloat16)
    fp.load(fp.flatten(values))
    start, end = lay.shard_range(1)
    exact = fp.flatten(values)[start:end]
    assert fp.master.dtype == torch.float32 and torch.equal(fp.master, exact)  # the master keeps every bit
    assert fp.shard.dtype == torch.bfloat16 and torch.equal(fp.shard, exact.bfloat16())
    assert fp.full.dtype == fp.grad_dtype == torch.bfloat16
    assert fp.reduce_dtype == torch.float32  # reduced in fp32 unless asked otherwise
    fp.show_views()
    assert all(p.dtype == torch.bfloat16 for p in fp.params)  # the module computes in the compute dtype
