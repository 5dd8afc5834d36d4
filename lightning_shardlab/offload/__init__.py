"""Offload: master shards and optimizer state live below the device, in host memory or on disk.

``offload='cpu'`` (host.py, a GPU run) and ``offload='disk'`` (disk.py, mapped_files.py, stepping.py: any run, the
CPU's included) keep the engine's tensors and arithmetic; only where the master shards and the optimizer
state live changes, so an offloaded run equals one without offload. ``setup_offload`` is what both
strategies call once the optimizers are sharded; space.py checks ``offload_dir`` before training.
"""

from __future__ import annotations

from torch.optim import Optimizer

from lightning_shardlab.core.config import ShardLabConfig
from lightning_shardlab.offload.disk import DiskOffload
from lightning_shardlab.offload.host import HostOffload
from lightning_shardlab.offload.space import agree_space, bytes_needed, check_writable
from lightning_shardlab.sharding.sharded_model import ShardedModel

__all__ = ["DiskOffload", "HostOffload", "check_offload", "setup_offload"]


def check_offload(config: ShardLabConfig, device: object) -> str:
    """Before the process group opens, on every rank: the tier ('none', 'cpu' or 'disk'); a bad choice or an
    unusable ``offload_dir`` is a ``ValueError`` naming the option and the fix."""
    tier = config.offload_tier(device)  # type: ignore[arg-type]
    if tier == "disk":
        check_writable(config.offload_dir)
    return tier


def setup_offload(sharded: ShardedModel, optimizers: list[Optimizer], config: ShardLabConfig, local_ranks: int) -> None:
    """Collective (disk: the space check): move the masters to the tier and make each optimizer step there.
    A module sharded by an earlier Trainer keeps its tier; each new optimizer is attached to it."""
    tier = config.offload_tier(sharded.comm.device)
    if tier == "none" or not optimizers:
        return
    if sharded.offload is None:
        if tier == "disk":
            directory = check_writable(config.offload_dir)
            need = bytes_needed(sharded.flat_params, optimizers, DiskOffload.moves_master)
            agree_space(directory, need, local_ranks, sharded.comm)
            sharded.offload = DiskOffload(sharded, directory)
        else:
            sharded.offload = HostOffload(sharded)
        sharded.offload.move_masters()
    for optimizer in optimizers:
        sharded.offload.attach(optimizer)
