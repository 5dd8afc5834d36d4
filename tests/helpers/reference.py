"""Helpers for comparing a sharded rank against an unsharded reference on the same global batch."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_shardlab import Comm
from lightning_shardlab.sharding.flat_param import FlatParam

FP32 = {"rtol": 1.3e-6, "atol": 1e-5}


def init_from_env() -> Comm:
    """Join the process group the launcher described (gloo), as a plain training script would."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world > 1 and not dist.is_initialized():  # a kept world may hold the group a Lightning fit opened
        dist.init_process_group("gloo", rank=rank, world_size=world)
    return Comm(rank=rank, world_size=world, device=torch.device("cpu"))


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def reference_flat(fp: FlatParam, reference: nn.Module, grads: bool = False) -> Tensor:
    """The reference's values (or grads) laid out like ``fp.full``: padding zero. 1-D, padded_numel."""
    named = dict(reference.named_parameters(remove_duplicate=False))
    parts = []
    for slot in fp.layout.slots:
        p = named[slot.name]
        t = p.grad if grads else p
        parts.append(torch.zeros(slot.numel) if t is None else t.detach().reshape(-1))
    parts.append(torch.zeros(fp.layout.padding))
    return torch.cat(parts)


def reference_shard(fp: FlatParam, reference: nn.Module, grads: bool = False) -> Tensor:
    start, end = fp.layout.shard_range(fp.rank)
    return reference_flat(fp, reference, grads)[start:end]


def mean_over_ranks(value: Tensor, comm: Comm) -> Tensor:
    value = value.detach().clone()
    if comm.world_size > 1:
        dist.all_reduce(value)
    return value / comm.world_size
