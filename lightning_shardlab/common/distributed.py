"""What the two front doors share: the Trainer's ``ShardLabStrategy`` (trainer/strategy.py) and Fabric's
(fabric/strategy.py) take the same options, place ranks on devices the same way (several ranks per device:
the single-box proxy), choose the same backend and open the same process group.

Their options are common/options.py; ``ShardLabDistributed`` is the mixin both strategies put
before Lightning's ``ParallelStrategy`` (each front door has its own: ``lightning.pytorch`` and
``lightning.fabric``), so nothing here is written twice.
"""

from __future__ import annotations

import atexit
from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.utilities.distributed import (
    _destroy_dist_connection,
    _distributed_is_initialized,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.distributed import _init_dist_connection as _init_process_group
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from torch import Tensor

from lightning_shardlab.comm import collectives
from lightning_shardlab.comm.collectives import Comm
from lightning_shardlab.comm.mesh import Mesh
from lightning_shardlab.comm.store import open_store
from lightning_shardlab.core.config import ShardLabConfig
from lightning_shardlab.offload import check_offload, setup_offload
from lightning_shardlab.sharding.sharded_model import ShardedModel

NAMES = (
    ("shardlab", 3, "none"),
    ("shardlab_stage_1", 1, "none"),
    ("shardlab_stage_2", 2, "none"),
    ("shardlab_stage_3", 3, "none"),
    ("shardlab_stage_2_offload", 2, "auto"),  # as Lightning's deepspeed_stage_2_offload: the tier below the device
    ("shardlab_stage_3_offload", 3, "auto"),
)
# ranks started from this process (core/config.py's start_method), under each name above with its prefix replaced:
# "shardlab_spawn_stage_2", as Lightning's "ddp_spawn_find_unused_parameters_true"
START_PREFIXES = (("shardlab", "popen"), ("shardlab_spawn", "spawn"), ("shardlab_notebook", "fork"))
METRIC_OPS = {"mean": "mean", "avg": "mean", "sum": "sum", "max": "max", "min": "min", None: "mean"}
METRIC_OPS.update({ReduceOp.SUM: "sum", ReduceOp.MAX: "max", ReduceOp.MIN: "min"})


class ShardLabDistributed:
    """Devices, ranks, backend and process group, for a Lightning ``ParallelStrategy`` of either front door."""

    config: ShardLabConfig
    cluster_environment: Any
    local_rank: int
    global_rank: int
    world_size: int
    comm: Comm | None
    _num_nodes: int = 1

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:  # the Trainer sets this; Fabric sets ``_num_nodes``
        self._num_nodes = num_nodes

    @property
    def parallel_devices(self) -> list[torch.device] | None:
        return self._parallel_devices

    @parallel_devices.setter
    def parallel_devices(self, devices: list[torch.device] | None) -> None:
        # The single-box proxy: each device hosts ``ranks_per_device`` ranks.
        k = self.config.ranks_per_device
        self._parallel_devices = None if devices is None else [d for d in devices for _ in range(k)]

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def devices_shared(self) -> bool:
        return self.parallel_devices is not None and len(set(self.parallel_devices)) < len(self.parallel_devices)

    @property
    def process_group_backend(self) -> str:
        chosen = self.config.process_group_backend
        shared_gpu = self.root_device.type == "cuda" and self.devices_shared
        if chosen == "nccl" and shared_gpu:
            raise ValueError(
                "`process_group_backend='nccl'` cannot run several ranks on one GPU (NCCL refuses it)."
                " HINT: leave process_group_backend unset (gloo is chosen) or use ranks_per_device=1."
            )
        return chosen or ("nccl" if self.root_device.type == "cuda" and not shared_gpu else "gloo")

    @property
    def group_sizes(self) -> tuple[int, int | None]:
        """(shard group size, reshard group size or None): checked against the world, on every rank alike."""
        return self.config.group_sizes(self.world_size, self.num_processes)

    def open_process_group(self) -> Comm:
        """Join the process group and return this rank's ``Comm``. A world of one joins one too, as DDP does: a
        user's hook may build a ``DistributedSampler`` or call ``torch.distributed`` at any device count (its
        ``Comm`` still communicates nothing). The group sizes and the offload tier are checked first: a bad
        ``shard_group_size``, ``offload='cpu'`` on a CPU run or an unwritable ``offload_dir`` is refused before any
        collective."""
        _ = self.group_sizes
        check_offload(self.config, self.root_device)
        reset_seed()
        backend = self.process_group_backend
        timeout = timedelta(seconds=self.config.timeout_s)
        kwargs: dict[str, Any] = {"timeout": timeout}
        if backend == "nccl":
            kwargs["device_id"] = self.root_device
        assert self.cluster_environment is not None
        if not _distributed_is_initialized():
            env = self.cluster_environment  # on keys of its own (comm/store.py): torchrun restarts reuse the store
            kwargs["store"] = open_store(env.main_address, env.main_port, self.global_rank, self.world_size, timeout)
            _init_process_group(env, backend, **kwargs)
            if backend != "nccl":  # Lightning registers this for NCCL; gloo's threads also need an orderly end
                atexit.register(_destroy_dist_connection)
        return Comm(rank=self.global_rank, world_size=self.world_size, device=self.root_device)

    def setup_offload(self, sharded: ShardedModel, optimizers: list[Any]) -> None:
        """Collective (offload='disk': the space check): after ``shard_optimizer``, move masters and optimizer state
        to the offload tier (offload/); a no-op without offload."""
        setup_offload(sharded, [getattr(o, "_optimizer", o) for o in optimizers], self.config, self.num_processes)

    def open_mesh(self) -> Mesh:
        """Collective: the shard, replica and reshard groups (comm/mesh.py) over this rank's ``Comm``."""
        assert self.comm is not None
        return Mesh.build(self.comm, *self.group_sizes)

    # ---- the collectives Lightning asks for: through comm/collectives.py, so they are verified, counted and
    # watched by the watchdog; other groups and operations go to Lightning's helper ----

    def reduce_tensor(self, tensor: Any, group: Any | None, reduce_op: ReduceOp | str | None, label: str) -> Any:
        """In place, like Lightning's DDP: the sum, max, min or mean over ranks."""
        if not isinstance(tensor, Tensor):
            return tensor
        op = METRIC_OPS.get(reduce_op.lower() if isinstance(reduce_op, str) else reduce_op)
        if self.comm is None or group is not None or op is None or not _distributed_is_initialized():
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        collectives.all_reduce(tensor, self.comm, op="sum" if op == "mean" else op, label=label)
        if op != "mean":
            return tensor
        return tensor.div_(self.world_size) if tensor.is_floating_point() else tensor.copy_(tensor / self.world_size)

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if self.comm is not None and _distributed_is_initialized():
            collectives.barrier(self.comm)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if self.comm is None or not _distributed_is_initialized():
            return obj
        return collectives.broadcast_object(obj, self.comm, src)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        for prefix, start_method in START_PREFIXES:
            for name, stage, offload in NAMES:
                where = "" if offload == "none" else ", masters and optimizer state offloaded (cpu on GPU, disk on CPU)"
                started = "" if start_method == "popen" else f", ranks started by {start_method}"
                description = f"shardlab: ZeRO stage {stage} sharded data parallel{where}{started}"
                options = {"stage": stage, "offload": offload}
                if start_method != "popen":  # the default start method is not written into the registry's entry
                    options["start_method"] = start_method
                strategy_registry.register(
                    prefix + name[len("shardlab") :], cls, description=description, override=True, **options
                )
