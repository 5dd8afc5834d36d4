"""``offload='cpu'`` (a GPU run): master shards, optimizer state and the step's fp32 gradient in host memory.

Each trainable flat parameter's master moves to pinned host memory (in fp32 training too: the device keeps
its compute shard, the host the master the optimizer updates). The optimizer then finds host tensors in its
param groups and makes its state there; it steps on the CPU (torch's foreach kernels unless the user chose).
The gradient reaches it as ``master_grad``, a pinned host copy of the grad shard made when gradients are
shown (sharding/gradients.py); after the step ``shard_from_master`` copies each updated master to the device
without waiting, so the copy overlaps the Python work that starts the next forward, and the all-gathers,
queued behind it on the device, see the new values. Nothing else changes: collectives still move device
tensors (the global norm, the guard's digests and full state dicts carry host values to the device first).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_shardlab.sharding.flat_param import FlatParam
from lightning_shardlab.sharding.sharded_model import ShardedModel


class HostOffload:
    """The host tier of one sharded model (a GPU run): masters and optimizer state in host memory."""

    tier = "host"
    step_seconds = 0.0  # the host tier's steps are not timed apart

    def __init__(self, sharded: ShardedModel) -> None:
        self.sharded = sharded

    @staticmethod
    def moves_master(fp: FlatParam) -> bool:
        return fp.layout.requires_grad

    def move_masters(self) -> None:
        for fp in self.sharded.flat_params:
            if self.moves_master(fp) and fp.master.device.type != "cpu":
                host = torch.empty(fp.layout.shard_numel, dtype=fp.master.dtype, pin_memory=True)
                fp.move_master(host)

    def holds(self, tensor: Tensor) -> bool:
        return tensor.device.type == "cpu"

    def attach(self, optimizer: Optimizer) -> None:
        for group in optimizer.param_groups:  # the CPU's multi-tensor kernels, unless the user chose
            if group.get("foreach") is None and not group.get("fused"):
                group["foreach"] = True

    def settle_all(self, optimizer: Optimizer) -> None:
        """After ``load_state_dict``: the state was made beside the (host) master views already."""

    def state_file(self, optimizer: Optimizer, fp: FlatParam, key: str) -> Tensor | None:
        return None  # host memory: no file to write a checkpoint from
