"""``ShardLabStrategy``: the Lightning glue. Each hook is a few lines that delegate to the modules below."""

from __future__ import annotations

import atexit
from collections.abc import Generator, Mapping
from contextlib import AbstractContextManager, contextmanager
from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.distributed import (
    _destroy_dist_connection,
    _distributed_is_initialized,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch import Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.callbacks import StochasticWeightAveraging, WeightAveraging
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_shardlab.checkpoint import io as ckpt
from lightning_shardlab.comm import collectives
from lightning_shardlab.comm.collectives import Comm
from lightning_shardlab.config import Accumulation, ShardLabConfig
from lightning_shardlab.guard.callback import ShardLabSanity
from lightning_shardlab.guard.guard import SanityConfig
from lightning_shardlab.precision import ShardLabPrecision, shardlab_precision
from lightning_shardlab.sharding.gathered import Modules, gathered_params
from lightning_shardlab.sharding.materialize import has_meta
from lightning_shardlab.sharding.optimizer import global_grad_norm, shard_optimizer
from lightning_shardlab.sharding.sharded_model import ShardedModel, shard_model

METRIC_OPS = {
    "mean": "mean",
    "avg": "mean",
    "sum": "sum",
    "max": "max",
    "min": "min",
    None: "mean",
    ReduceOp.SUM: "sum",
    ReduceOp.MAX: "max",
    ReduceOp.MIN: "min",
}


def refuse_unsharded_callbacks(callbacks: list[Any]) -> None:
    """Lightning's weight averaging deep-copies the whole module on every rank and reads its weights, which
    at stage 3 are placeholders: refused, on every rank, naming the sharded replacement."""
    for callback in callbacks:
        if isinstance(callback, (WeightAveraging, StochasticWeightAveraging)):
            raise ValueError(
                f"{type(callback).__name__} keeps an unsharded copy of the whole model on every rank, which the"
                " shardlab strategy does not support (at stage 3 the module holds only placeholders between steps)."
                " HINT: use"
                " lightning_shardlab.ShardLabEMA(decay=...), which keeps each rank's share of the average and gives"
                " EMAWeightAveraging's numbers."
            )


class ShardLabStrategy(ParallelStrategy):
    """Fully sharded data parallel training (ZeRO stages 1, 2 and 3) for any LightningModule.

    Args:
        stage: what is sharded at rest: 1 optimizer state, 2 + gradients, 3 + parameters (FSDP).
        unit_classes: import paths of module classes that each become a unit (gathered and freed
            together). Default: one unit per repeated block (e.g. each transformer block).
        min_unit_params: modules with fewer parameters are not made units.
        reshard_after_forward: stage 3: free gathered parameters after forward (False is torch's
            SHARD_GRAD_OP: keep them until the unit's backward, trading memory for one all-gather).
        accumulation: 'reduce' every micro-batch into gradient shards, or 'defer' to the last one.
        find_unused_parameters: leave the gradients of parameters that no rank used as None, like a single
            device and DDP (one small all-reduce per optimizer step). False trades that for a zero gradient.
        broadcast_buffers: before each training step, copy rank 0's buffers (BatchNorm statistics) to
            every rank, as DDP does.
        reduce_dtype: 'fp32', 'bf16' or 'fp16': what gradients are reduce-scattered in (default: fp32 under
            mixed precision, else the parameters' dtype).
        transport: 'auto', 'builtin' or 'pairwise': how gloo all-gathers and reduce-scatters travel ('auto'
            times torch's collectives against a direct pairwise exchange at setup and keeps the faster).
        gradient_clip_norm_type: the norm ``Trainer(gradient_clip_val=...)`` clips by (2, 1 or 'inf').
        ranks_per_device: several ranks on one device (the single-box proxy).
        process_group_backend: 'gloo' or 'nccl' (default: gloo on CPU and for shared GPUs, else NCCL).
        timeout_s: process group timeout, seconds.
        elementwise_optimizers: import paths of extra optimizer classes to treat as elementwise.
        state_dict_type: checkpoints are 'sharded' (a directory: every rank writes its own slices) or 'full'
            (one plain Lightning file gathered on rank 0). Loading reads either at any world size and stage.
        sanity_every_n_steps: before every K-th training batch compare collective fingerprints, replicated
            state and batches across ranks (one tiny all-gather each); 0: off. See docs/sanity.md.
        strict_collectives: debug mode: compare every collective's fingerprint across ranks before it runs.
        verify_collectives: every collective carries its fingerprint in a header checked before its payload
            is used, so ranks that part raise a named error at that collective (not a hang or gloo's abort).
        collective_timeout_s: end the run on every rank, with a report of what each rank waits on, when a
            collective has not finished after this long (None: no watchdog).
        handle_sigterm: SIGTERM on any rank stops every rank after the same step.
    """

    strategy_name = "shardlab"

    def __init__(
        self,
        stage: int = 3,
        unit_classes: list[str] | None = None,
        min_unit_params: int = 0,
        reshard_after_forward: bool = True,
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
        sanity_every_n_steps: int = 10,
        strict_collectives: bool = False,
        verify_collectives: bool = True,
        collective_timeout_s: float | None = 300.0,
        handle_sigterm: bool = True,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        self.config = ShardLabConfig(
            stage=stage,
            unit_classes=unit_classes or (),
            min_unit_params=min_unit_params,
            reshard_after_forward=reshard_after_forward,
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
        )
        super().__init__(accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin)
        self.num_nodes = 1
        self.comm: Comm | None = None
        self.sharded: ShardedModel | None = None
        self.sanity_config = SanityConfig(
            every_n_steps=sanity_every_n_steps,
            strict_collectives=strict_collectives,
            verify_collectives=verify_collectives,
            collective_timeout_s=collective_timeout_s,
            handle_sigterm=handle_sigterm,
        )

    # ---- devices, ranks, process group ----

    @property
    @override
    def parallel_devices(self) -> list[torch.device] | None:
        return self._parallel_devices

    @parallel_devices.setter
    @override
    def parallel_devices(self, devices: list[torch.device] | None) -> None:
        # The single-box proxy: each device hosts ``ranks_per_device`` ranks.
        k = self.config.ranks_per_device
        self._parallel_devices = None if devices is None else [d for d in devices for _ in range(k)]

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        return True

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

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

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    @override
    def setup_environment(self) -> None:
        if self.lightning_module is not None and self.lightning_module._trainer is not None:
            refuse_unsharded_callbacks(self.lightning_module.trainer.callbacks)  # before any collective
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        backend = self.process_group_backend
        kwargs: dict[str, Any] = {"timeout": timedelta(seconds=self.config.timeout_s)}
        if backend == "nccl":
            kwargs["device_id"] = self.root_device
        assert self.cluster_environment is not None
        if self.world_size > 1 and not _distributed_is_initialized():  # a world of one communicates nothing
            _init_dist_connection(self.cluster_environment, backend, **kwargs)
            if backend != "nccl":  # Lightning registers this for NCCL; gloo's threads also need an orderly end
                atexit.register(_destroy_dist_connection)
        self.comm = Comm(rank=self.global_rank, world_size=self.world_size, device=self.root_device)

    # ---- precision ----

    @property
    @override
    def precision_plugin(self) -> ShardLabPrecision:
        plugin = self._precision_plugin
        return (
            plugin
            if isinstance(plugin, ShardLabPrecision)
            else ShardLabPrecision(norm_type=self.config.gradient_clip_norm_type)
        )

    @precision_plugin.setter
    @override
    def precision_plugin(self, plugin: Precision | None) -> None:
        self._precision_plugin = (
            None if plugin is None else shardlab_precision(plugin, self.config.gradient_clip_norm_type)
        )

    # ---- setup: shard the module, then rewrite the optimizers ----

    @override
    def setup(self, trainer: Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        assert self.comm is not None and self.lightning_module is not None
        plugin = self.precision_plugin
        plugin.device_type = self.root_device.type
        self.sharded = shard_model(
            self.lightning_module, self.config, self.comm, plugin.policy(self.config.reduce_dtype)
        )
        self.comm = self.sharded.comm  # a module sharded by an earlier Trainer keeps its comm and ledger
        if self._sanity_driver(trainer).config.verify_collectives:
            self.sharded.verify_collectives()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        plugin.sharded = self.sharded

    def _sanity_driver(self, trainer: Trainer) -> ShardLabSanity:
        """The one driver of the sanity checks: the user's ``ShardLabSanity`` with its options, else one with the
        strategy's (added to the Trainer's callbacks, so it runs in fit like any callback)."""
        for callback in trainer.callbacks:
            if isinstance(callback, ShardLabSanity):
                return callback
        driver = ShardLabSanity.from_config(self.sanity_config)
        trainer.callbacks.append(driver)
        return driver

    @override
    def setup_optimizers(self, trainer: Trainer) -> None:
        super().setup_optimizers(trainer)
        assert self.sharded is not None
        for optimizer in self.optimizers:
            shard_optimizer(optimizer, self.sharded)

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        # once sharded, the flat parameters already live on the device; meta parameters are built there
        if self.sharded is None and not has_meta(self.model):
            self.model.to(self.root_device)

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """``trainer.init_module(empty_init=True)``: parameters on the meta device, built unit by unit at setup."""
        with torch.device("meta") if empty_init else self.root_device, self.precision_plugin.tensor_init_context():
            yield

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        """``configure_model`` creates parameters on the meta device: no rank ever holds the whole model;
        setup initialises each module with its ``reset_parameters()`` and keeps only this rank's shards."""
        with torch.device("meta"):
            yield

    # ---- steps ----

    def _broadcast_buffers(self) -> None:
        """Rank 0's buffers on every rank before each forward of fit (training and validation), as DDP does."""
        assert self.sharded is not None and self.lightning_module is not None
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        if fitting and self.config.broadcast_buffers and self.world_size > 1:
            self.sharded.broadcast_buffers()

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        assert self.sharded is not None and self.lightning_module is not None
        self._broadcast_buffers()
        # automatic optimisation runs backward after the step: the root stays gathered for it
        with self.sharded.step(keep_root_gathered=self.lightning_module.automatic_optimization):
            return super().training_step(*args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        assert self.sharded is not None
        self._broadcast_buffers()
        with self.sharded.step(keep_root_gathered=False):
            return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        assert self.sharded is not None
        with self.sharded.step(keep_root_gathered=False):
            return super().test_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        assert self.sharded is not None
        with self.sharded.step(keep_root_gathered=False):
            return super().predict_step(*args, **kwargs)

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        assert self.sharded is not None
        self.sharded.prepare_backward(closure_loss)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning's signal that no optimizer step follows this backward (a micro-batch of accumulation)."""
        if self.sharded is None:
            yield
            return
        defer = self.config.accumulation is Accumulation.DEFER
        with self.sharded.no_sync() if defer else self.sharded.accumulating():
            yield

    def grad_norm(self, norm_type: float | str = 2.0, optimizer: Optimizer | None = None) -> Tensor:
        """Collective: the global norm of the current gradients (of ``optimizer``'s parameters, or all).

        Equals what DDP users get from ``lightning.pytorch.utilities.grad_norm`` or torch's
        ``clip_grad_norm_`` on the unsharded gradients; call it on every rank, e.g. in
        ``on_before_optimizer_step``, and log it.
        """
        assert self.comm is not None
        optimizers = [optimizer] if optimizer is not None else self.optimizers
        params = [p for opt in optimizers for group in opt.param_groups for p in group["params"]]
        return global_grad_norm(params, float(norm_type), self.comm)

    # ---- collectives Lightning asks for (metrics, barriers) ----

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        """Metrics (``self.log(..., sync_dist=True)``) and Lightning's decisions: through comm/collectives.py, so they
        are verified and the watchdog sees them wait; other groups and operations go to Lightning's helper."""
        if not isinstance(tensor, Tensor):
            return tensor
        op = METRIC_OPS.get(reduce_op.lower() if isinstance(reduce_op, str) else reduce_op)
        if self.comm is None or group is not None or op is None or not _distributed_is_initialized():
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        collectives.all_reduce(tensor, self.comm, op="sum" if op == "mean" else op, label="metrics")
        if op != "mean":
            return tensor
        return tensor.div_(self.world_size) if tensor.is_floating_point() else tensor.copy_(tensor / self.world_size)

    @override
    def barrier(self, name: str | None = None) -> None:
        if self.comm is not None and _distributed_is_initialized():
            collectives.barrier(self.comm)

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if self.comm is None or not _distributed_is_initialized():
            return obj
        return collectives.broadcast_object(obj, self.comm, src)

    # ---- state dicts and checkpoints ("sharded" directories or "full" files: checkpoint/io.py) ----

    def full_state_dict(self, ema: bool = False) -> dict[str, Any]:
        """Collective: the unsharded ``module.state_dict()`` (CPU tensors) on global rank 0, ``{}`` elsewhere;
        with ``ema=True``, the averaged weights of ``ShardLabEMA``."""
        assert self.sharded is not None, "full_state_dict() needs the model set up by trainer.fit/validate/..."
        return ckpt.full_state_dict(self.sharded, ema=ema)

    def gathered_params(self, modules: Modules = None, writeback: bool = False) -> AbstractContextManager[None]:
        """Collective: ``with trainer.strategy.gathered_params(modules=None, writeback=False):`` gives the
        module the full weights (fp32 masters) of the units owning ``modules``' parameters (every unit if None)
        for the block; with ``writeback=True`` changes made inside go back to every rank's shards
        (sharding/gathered.py)."""
        assert self.sharded is not None, "gathered_params() needs the model set up by trainer.fit/validate/..."
        return gathered_params(self.sharded, modules, writeback)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.sharded is not None
        return ckpt.module_state(self.sharded)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        assert self.sharded is not None
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        return ckpt.optimizer_state(optimizer, self.sharded)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Collective: written atomically, by every rank (sharded) or by rank 0 (full)."""
        assert self.sharded is not None, "save_checkpoint() needs the model set up by trainer.fit/validate/..."
        ckpt.save(
            checkpoint,
            filepath,
            self.sharded,
            self.optimizers,
            self.precision_plugin.precision,
            self.checkpoint_io,
            storage_options,
        )

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Collective: either format, verified, the same verdict on every rank; per-rank entries restored."""
        assert self.sharded is not None and self.lightning_module is not None
        trainer = self.lightning_module.trainer
        return ckpt.load(checkpoint_path, self.sharded, trainer, weights_only, self.checkpoint_io)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            ckpt.remove(filepath, self.checkpoint_io)

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # loading slices the checkpoint into shards, so the layout must exist first

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        assert self.sharded is not None
        ckpt.load_model(self.sharded, checkpoint, strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        assert self.sharded is not None
        ckpt.load_optimizers(self.optimizers, self.sharded, checkpoint)

    # ---- teardown ----

    @override
    def teardown(self) -> None:
        # The module stays sharded (placeholders, hooks) so later validate/test/predict reuse it; the
        # base teardown's module.cpu() would try to copy the meta placeholders.
        assert self.cluster_environment is not None and self.accelerator is not None
        if self.sharded is not None:
            self.sharded.wait_gathers()  # the refresh after the last optimizer step may still be travelling
        lm = self.lightning_module
        if (
            lm is not None
            and lm._trainer is not None
            and lm._trainer.state.fn == TrainerFn.FITTING
            and self._layer_sync
        ):
            self.model = self._layer_sync.revert(self.model)
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        entries = [("shardlab", 3), ("shardlab_stage_1", 1), ("shardlab_stage_2", 2), ("shardlab_stage_3", 3)]
        for name, stage in entries:
            strategy_registry.register(
                name, cls, description=f"shardlab: ZeRO stage {stage} sharded data parallel", override=True, stage=stage
            )
