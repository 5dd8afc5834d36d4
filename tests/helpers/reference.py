"""Helpers for comparing a sharded rank against an unsharded reference on the same global batch."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
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


def _sum_in_order(parts: list[Tensor]) -> Tensor:
    total = parts[0].clone()
    for part in parts[1:]:
        total.add_(part)
    return total


def rank_order_mean(shard_group_size: int | None, bucket: dist.GradBucket) -> torch.futures.Future:
    """A DDP communication hook: the mean of the bucket's gradients summed as shardlab's verified collectives
    sum them, in rank order: inside each shard group of ``shard_group_size`` ranks (its sum divided by the
    group's size), then across the groups (divided by their count)."""
    grads = bucket.buffer()
    parts = [torch.empty_like(grads) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, grads)
    g = shard_group_size or len(parts)
    means = [_sum_in_order(parts[k * g : (k + 1) * g]).div_(g) for k in range(len(parts) // g)]
    mean = _sum_in_order(means).div_(len(means)) if len(means) > 1 else means[0]
    done: torch.futures.Future = torch.futures.Future()
    done.set_result(mean)
    return done


# DDP checks the hook's annotations as objects (this module's are strings)
rank_order_mean.__annotations__.update({"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]})


class RankOrderDDP(DDPStrategy):
    """Lightning's DDP, its gradients averaged in shardlab's order of summation (``rank_order_mean``). The
    reference for updates that round to bfloat16 (torch's Muon): with DDP's own all-reduce the mean over more
    than two ranks can differ in its last fp32 bit, which one bfloat16 rounding can turn into a whole step.

    ``ranks_per_device`` > 1: that many ranks share each device, as shardlab's proxy runs them (NCCL refuses two
    ranks on one GPU, so they talk over gloo, which DDP drives with CUDA tensors too): the reference for ranks that
    share the one GPU a machine has."""

    def __init__(self, shard_group_size: int | None = None, ranks_per_device: int = 1) -> None:
        self.ranks_per_device = ranks_per_device
        super().__init__(process_group_backend="gloo" if ranks_per_device > 1 else None)
        self.shard_group_size = shard_group_size

    @DDPStrategy.parallel_devices.setter
    def parallel_devices(self, devices: list[torch.device] | None) -> None:
        k = self.ranks_per_device
        self._parallel_devices = None if devices is None else [d for d in devices for _ in range(k)]

    def _register_ddp_hooks(self) -> None:  # Lightning registers hooks on CUDA only
        self.model.register_comm_hook(self.shard_group_size, rank_order_mean)
