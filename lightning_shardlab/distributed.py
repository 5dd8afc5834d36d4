"""What the two front doors share: the Trainer's ``ShardLabStrategy`` (strategy.py) and Fabric's
(fabric/strategy.py) take the same options, place ranks on devices the same way (several ranks per device:
the single-box proxy), choose the same backend and open the same process group.

``options_to_configs`` is the one list of options; ``ShardLabDistributed`` is the mixin both strategies put
before Lightning's ``ParallelStrategy`` (each front door has its own: ``lightning.pytorch`` and
``lightning.fabric``), so nothing here is written twice.
"""

from __future__ import annotations

import atexit
import inspect
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
from lightning_shardlab.config import ShardLabConfig
from lightning_shardlab.guard.guard import SanityConfig
from lightning_shardlab.offload import check_offload, setup_offload
from lightning_shardlab.sharding.sharded_model import ShardedModel

OPTIONS_DOC = """
        stage: what is sharded at rest: 1 optimizer state, 2 + gradients, 3 + parameters (FSDP).
        unit_classes: import paths of module classes that each become a unit (gathered and freed
            together). Default: one unit per repeated block (e.g. each transformer block).
        min_unit_params: modules with fewer parameters are not made units.
        unit_bucket_params: consecutive repeated blocks smaller than this are merged into one unit of at least
            this many parameters, so small blocks do not pay a collective latency each (0: a unit per block).
        reshard_after_forward: stage 3: free gathered parameters after forward (False is torch's
            SHARD_GRAD_OP: keep them until the unit's backward, trading memory for one all-gather); an int k
            keeps them sharded over k consecutive ranks, so backward all-gathers stay inside those k (hpZ).
        shard_group_size: hybrid sharding: consecutive groups of this many ranks each shard the model, and the
            groups are replicas (gradient shards averaged across groups). 'node': the devices of one node.
            None (default): every rank shards the model.
        accumulation: 'reduce' every micro-batch into gradient shards, or 'defer' to the last one.
        find_unused_parameters: leave the gradients of parameters that no rank used as None, like a single
            device and DDP (one small all-reduce per optimizer step). False trades that for a zero gradient.
        broadcast_buffers: before each training step, copy rank 0's buffers (BatchNorm statistics) to
            every rank, as DDP does.
        reduce_dtype: 'fp32', 'bf16' or 'fp16': what gradients are reduce-scattered in (default: fp32 under
            mixed precision, else the parameters' dtype).
        transport: 'auto', 'builtin' or 'pairwise': how gloo all-gathers and reduce-scatters travel ('auto'
            times torch's collectives against a direct pairwise exchange at setup and keeps the faster).
        gradient_clip_norm_type: the norm the Trainer's ``gradient_clip_val`` clips by (2, 1 or 'inf').
        ranks_per_device: several ranks on one device (the single-box proxy).
        process_group_backend: 'gloo' or 'nccl' (default: gloo on CPU and for shared GPUs, else NCCL).
        timeout_s: process group timeout, seconds.
        elementwise_optimizers: import paths of extra optimizer classes to treat as elementwise.
        state_dict_type: checkpoints are 'sharded' (a directory: every rank writes its own slices) or 'full'
            (one plain file gathered on rank 0). Loading reads either at any world size and stage.
        offload: where master shards and optimizer state live: 'none' (default), 'cpu' (pinned host memory on a
            GPU run, the optimizer steps on the CPU), 'disk' (memory-mapped files under offload_dir, one flat
            parameter at a time), 'auto' (the tier below the device: 'cpu' on a GPU, 'disk' on a CPU run).
        offload_dir: offload='disk': the directory of the files (default: the system's temporary directory);
            checked writable, and large enough for the layout, before training.
        async_save: sharded checkpoints are written on a background thread (from host copies taken at the save)
            while training goes on; the next save, a load or the end of fit completes them (Trainer only).
        sanity_every_n_steps: before every K-th training batch compare collective fingerprints, replicated
            state and batches across ranks (one tiny all-gather each); 0: off. See docs/sanity.md.
        strict_collectives: debug mode: compare every collective's fingerprint across ranks before it runs.
        verify_collectives: every collective carries its fingerprint in a header checked before its payload
            is used, so ranks that part raise a named error at that collective (not a hang or gloo's abort).
        collective_timeout_s: end the run on every rank, with a report of what each rank waits on, when a
            collective has not finished after this long (None: no watchdog).
        handle_sigterm: SIGTERM on any rank stops every rank after the same step.
"""


def options_to_configs(
    stage: int = 3,
    unit_classes: list[str] | None = None,
    min_unit_params: int = 0,
    unit_bucket_params: int = 1_000_000,
    reshard_after_forward: bool | int = True,
    shard_group_size: int | str | None = None,
    accumulation: str = "reduce",
    find_unused_parameters: bool = True,
    broadcast_buffers: bool = True,
    reduce_dtype: str | None = None,
    transport: str = "auto",
    gradient_clip_norm_type: float | str = 2.0,
    ranks_per_device: int = 1,
    process_group_backend: str | None = None,
    timeout_s: float = 1800.0,
    elementwise_optimizers: list[str] | None = None,
    state_dict_type: str = "sharded",
    offload: str = "none",
    offload_dir: str | None = None,
    async_save: bool = False,
    sanity_every_n_steps: int = 10,
    strict_collectives: bool = False,
    verify_collectives: bool = True,
    collective_timeout_s: float | None = 300.0,
    handle_sigterm: bool = True,
) -> tuple[ShardLabConfig, SanityConfig]:
    """Every option of both strategies (``OPTIONS_DOC``), checked: the engine's config and the guard's."""
    config = ShardLabConfig(
        stage=stage,
        unit_classes=unit_classes or (),
        min_unit_params=min_unit_params,
        unit_bucket_params=unit_bucket_params,
        reshard_after_forward=reshard_after_forward,
        shard_group_size=shard_group_size,
        accumulation=accumulation,
        find_unused_parameters=find_unused_parameters,
        broadcast_buffers=broadcast_buffers,
        reduce_dtype=reduce_dtype,
        transport=transport,
        gradient_clip_norm_type=gradient_clip_norm_type,
        ranks_per_device=ranks_per_device,
        process_group_backend=process_group_backend,
        timeout_s=timeout_s,
        elementwise_optimizers=elementwise_optimizers or (),
        state_dict_type=state_dict_type,
        offload=offload,
        offload_dir=offload_dir,
        async_save=async_save,
    )
    sanity = SanityConfig(
        every_n_steps=sanity_every_n_steps,
        strict_collectives=strict_collectives,
        verify_collectives=verify_collectives,
        collective_timeout_s=collective_timeout_s,
        handle_sigterm=handle_sigterm,
    )
    return config, sanity


OPTIONS = tuple(inspect.signature(options_to_configs).parameters)
NAMES = (
    ("shardlab", 3, "none"),
    ("shardlab_stage_1", 1, "none"),
    ("shardlab_stage_2", 2, "none"),
    ("shardlab_stage_3", 3, "none"),
    ("shardlab_stage_2_offload", 2, "auto"),  # as Lightning's deepspeed_stage_2_offload: the tier below the device
    ("shardlab_stage_3_offload", 3, "auto"),
)
METRIC_OPS = {"mean": "mean", "avg": "mean", "sum": "sum", "max": "max", "min": "min", None: "mean"}
METRIC_OPS.update({ReduceOp.SUM: "sum", ReduceOp.MAX: "max", ReduceOp.MIN: "min"})


def check_option_names(options: dict[str, Any], who: str) -> None:
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ValueError(f"{who} got unknown option(s) {', '.join(map(repr, unknown))}. Allowed: {', '.join(OPTIONS)}.")


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
        """Join the process group (a world of one communicates nothing) and return this rank's ``Comm``.
        The group sizes and the offload tier are checked first: a bad ``shard_group_size``, ``offload='cpu'`` on a
        CPU run or an unwritable ``offload_dir`` is refused before any collective."""
        _ = self.group_sizes
        check_offload(self.config, self.root_device)
        reset_seed()
        backend = self.process_group_backend
        kwargs: dict[str, Any] = {"timeout": timedelta(seconds=self.config.timeout_s)}
        if backend == "nccl":
            kwargs["device_id"] = self.root_device
        assert self.cluster_environment is not None
        if self.world_size > 1 and not _distributed_is_initialized():
            _init_process_group(self.cluster_environment, backend, **kwargs)
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
        for name, stage, offload in NAMES:
            where = "" if offload == "none" else ", masters and optimizer state offloaded (cpu on a GPU, disk on CPU)"
            description = f"shardlab: ZeRO stage {stage} sharded data parallel{where}"
            strategy_registry.register(name, cls, description=description, override=True, stage=stage, offload=offload)
