"""``lightning_shardlab.fabric.ShardLabStrategy``: the Fabric glue. The same engine as the Trainer's strategy;
each method is a few lines that delegate to it.

    fabric = L.Fabric(accelerator="cpu", devices=2, strategy="shardlab")   # or ShardLabStrategy(stage=2, ...)
    fabric.launch()
    model = fabric.setup_module(model)                    # sharded here (one unit per repeated block)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters()))
    ...
    with fabric.no_backward_sync(model, enabled=accumulating):
        fabric.backward(loss)
    fabric.clip_gradients(model, optimizer, max_norm=1.0)  # the global norm
    optimizer.step()
    fabric.save("ckpt", {"model": model, "optimizer": optimizer, "step": step})   # sharded, atomic, verified
"""

from __future__ import annotations

import weakref
from collections.abc import Generator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from typing import Any

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies import ParallelStrategy
from lightning.fabric.strategies.launchers import _SubprocessScriptLauncher
from lightning.fabric.strategies.strategy import (
    _BackwardSyncControl,
    _Sharded,
    _validate_keys_for_strict_loading,
)
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.fabric.utilities.types import ReduceOp
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_shardlab.checkpoint import fabric_state
from lightning_shardlab.checkpoint import save_load as ckpt
from lightning_shardlab.checkpoint.rank_state import Owners
from lightning_shardlab.comm.collectives import Comm
from lightning_shardlab.common.distributed import ShardLabDistributed
from lightning_shardlab.common.options import OPTIONS_DOC, options_to_configs, with_options
from lightning_shardlab.common.process_start import refuse_in_notebook
from lightning_shardlab.core.config import Accumulation
from lightning_shardlab.fabric.precision import ShardLabFabricPrecision, fabric_precision
from lightning_shardlab.fabric.spawn_launcher import ShardLabFabricSpawnLauncher
from lightning_shardlab.sharding.build import shard_model
from lightning_shardlab.sharding.gathered import Modules, gathered_params
from lightning_shardlab.sharding.materialize import has_meta
from lightning_shardlab.sharding.optimizer import shard_optimizer
from lightning_shardlab.sharding.sharded_model import ShardedModel


class ShardLabStrategy(ShardLabDistributed, ParallelStrategy, _Sharded):
    __doc__ = (
        """Fully sharded data parallel training (ZeRO stages 1, 2 and 3) for Fabric loops.

    ``L.Fabric(strategy=ShardLabStrategy(stage=2, ...))``, or by name: ``"shardlab"`` (stage 3),
    ``"shardlab_stage_1"``, ``"shardlab_stage_2"``, ``"shardlab_stage_3"``; ``"shardlab_spawn"`` and
    ``"shardlab_notebook"`` (and their stage suffixes) start the ranks from this process for
    ``fabric.launch(train)`` (docs/notebooks.md). The same options and engine as the
    Trainer's ``lightning_shardlab.ShardLabStrategy``. Each module given to ``fabric.setup``/``setup_module`` is
    sharded; its optimizers step their master shards. A checkpoint holds one module (with its optimizers and
    any plain objects).

    Args:"""
        + OPTIONS_DOC
    )

    @with_options
    def __init__(
        self,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
        **options: Any,
    ) -> None:
        self.config, self.sanity_config = options_to_configs(options, "lightning_shardlab.fabric.ShardLabStrategy")
        if self.config.async_save:
            raise ValueError(
                "`async_save=True` is for the Trainer, whose end of fit completes the last save; a Fabric loop has"
                " no such point. HINT: leave async_save off with Fabric (fabric.save writes synchronously)."
            )
        super().__init__(accelerator, parallel_devices, cluster_environment, checkpoint_io, precision)
        self._backward_sync_control = _NoBackwardSync(self)
        self.comm: Comm | None = None
        self.sharded_models: dict[int, ShardedModel] = {}  # id(module) -> its sharded model
        self._optimizers: dict[int, ShardedModel] = {}  # id(optimizer) -> the sharded model it steps
        self._replaced: dict[int, tuple[weakref.ref, Tensor]] = {}  # id(original param) -> (it, what replaced it)

    # ---- devices, ranks, process group (common/distributed.py) ----

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        refuse_in_notebook(self.config.start_method, self.cluster_environment.creates_processes_externally)
        if self.config.start_method != "popen":  # fabric.launch(fn): ranks started from this process
            self._launcher = ShardLabFabricSpawnLauncher(self, start_method=self.config.start_method)
        elif not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        assert self.cluster_environment is not None
        self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
        self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank
        self.comm = self.open_process_group()

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    # ---- precision ----

    @property
    @override
    def precision(self) -> ShardLabFabricPrecision:
        if not isinstance(self._precision, ShardLabFabricPrecision):
            self._precision = fabric_precision(self._precision, self._norm_type)  # kept: it holds the sharded model
        return self._precision

    @precision.setter
    @override
    def precision(self, plugin: Precision | None) -> None:
        self._precision = None if plugin is None else fabric_precision(plugin, self._norm_type)

    @property
    def _norm_type(self) -> float:
        return self.config.gradient_clip_norm_type

    # ---- modules and optimizers ----

    @override
    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        """``fabric.init_module(empty_init=True)``: parameters on the meta device, built unit by unit at setup."""
        stack = ExitStack()
        stack.enter_context(torch.device("meta") if empty_init else self.root_device)
        stack.enter_context(self.precision.module_init_context())
        return stack

    @override
    @contextmanager
    def module_sharded_context(self) -> Generator[None, None, None]:
        with torch.device("meta"):
            yield

    @override
    def module_to_device(self, module: nn.Module) -> None:
        # once sharded, the flat parameters live on the device; meta parameters are built there
        if id(module) not in self.sharded_models and not has_meta(module):
            module.to(self.root_device)

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        assert self.comm is not None, "fabric.launch() first: the process group is not open"
        plugin = self.precision
        plugin.device_type = self.root_device.type
        before = [(weakref.ref(p), name) for name, p in module.named_parameters(remove_duplicate=False)]
        sharded = shard_model(module, self.config, self.open_mesh(), plugin.policy(self.config.reduce_dtype))
        self.comm = sharded.comm
        if self.sanity_config.verify_collectives:
            sharded.verify_collectives()
        sharded.reads.open()  # a loop of the user's own: gradients (and stage-3 weights) read from the shards
        self.sharded_models[id(module)] = sharded
        plugin.sharded = sharded
        # an optimizer made before the module was sharded holds its original parameters: remember their names
        now = dict(module.named_parameters(remove_duplicate=False))
        self._replaced.update({id(p()): (p, now[name]) for p, name in before if p() is not None})
        return module

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Optimizers made before their module was sharded (``fabric.setup(model, optimizer)``) keep the module's
        parameter objects; a parameter made on the meta device was replaced by its identity for the run, and the
        optimizer is pointed at that one, by name. Then they step master shards."""
        for group in optimizer.param_groups:
            group["params"] = [self._current(p) for p in group["params"]]
        sharded = self._owner_of(optimizer)
        shard_optimizer(optimizer, sharded)
        self.setup_offload(sharded, [optimizer])
        self._optimizers[id(optimizer)] = sharded
        return optimizer

    def _current(self, param: Tensor) -> Tensor:
        ref, now = self._replaced.get(id(param), (None, param))
        return now if ref is not None and ref() is param else param

    def _owner_of(self, optimizer: Optimizer) -> ShardedModel:
        params = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for sharded in self.sharded_models.values():
            if params & set(sharded.master_params_by_id()):
                return sharded
        raise ValueError(
            f"{type(optimizer).__name__} was set up before its module: no module set up by the shardlab strategy holds"
            " its parameters. HINT: `model, optimizer = fabric.setup(model, optimizer)` in one call (any stage); at"
            " stages 1-2 also `model = fabric.setup_module(model)` first, then an optimizer over `model.parameters()`"
            " and `optimizer = fabric.setup_optimizers(optimizer)`."
        )

    def sharded_model(self, module: nn.Module | None = None) -> ShardedModel:
        """The sharded model of ``module`` (a module set up by this strategy, or the Fabric wrapper of one;
        None: the only one). What the sanity guard, the budget and the vitals read."""
        module = getattr(module, "_forward_module", module)
        if module is None and len(self.sharded_models) == 1:
            return next(iter(self.sharded_models.values()))
        if module is not None and id(module) in self.sharded_models:
            return self.sharded_models[id(module)]
        raise ValueError(
            f"{type(module).__name__ if module is not None else 'no module'} is not set up by the shardlab strategy"
            f" ({len(self.sharded_models)} modules are). HINT: `model = fabric.setup(model, ...)` and pass that model."
        )

    # ---- steps ----

    @override
    def backward(self, tensor: Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        sharded = self.sharded_model(module) if module is not None or len(self.sharded_models) == 1 else None
        self.precision.pre_backward(tensor, module)  # Fabric's MixedPrecision scales the loss in its backward
        if sharded is not None:
            sharded.prepare_backward(tensor)
        else:  # several models: the root of every model announces itself when backward reaches it
            for each in self.sharded_models.values():
                each.prepare_backward(tensor)
        self.precision.backward(tensor, module, *args, **kwargs)
        self.precision.post_backward(tensor, module)

    @override
    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        """Collective: clip by the global norm over every rank's shards, as torch does on unsharded gradients."""
        self.precision.unscale_gradients(optimizer)
        norm = self.precision.clip_by_global_norm(optimizer, float(max_norm), float(norm_type))
        if error_if_nonfinite and not torch.isfinite(norm):
            raise RuntimeError(
                f"The total norm of order {float(norm_type)} for gradients from `parameters` is non-finite, so it"
                " cannot be clipped. HINT: pass error_if_nonfinite=False to fabric.clip_gradients to clip anyway."
            )
        return norm

    # ---- collectives Fabric offers (through comm/collectives.py: verified, counted, watched) ----

    @override
    def all_reduce(self, tensor: Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        """``fabric.all_reduce``: verified, counted and watched like every collective (common/distributed.py)."""
        return self.reduce_tensor(tensor, group, reduce_op, "fabric all_reduce")

    # ---- weights and checkpoints (checkpoint/fabric_state.py lays Fabric's state out like a Trainer's) ----

    def full_state_dict(self, module: nn.Module | None = None) -> dict[str, Any]:
        """Collective: the unsharded ``module.state_dict()`` (CPU tensors) on global rank 0, ``{}`` elsewhere."""
        return ckpt.full_state_dict(self.sharded_model(module))

    def gathered_params(
        self, module: nn.Module | None = None, modules: Modules = None, writeback: bool = False
    ) -> AbstractContextManager[None]:
        """Collective: full weights of ``module`` between steps, as the Trainer strategy's ``gathered_params``."""
        return gathered_params(self.sharded_model(module), modules, writeback)

    @override
    def get_module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        return ckpt.module_state(self.sharded_model(module))

    @override
    def get_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return ckpt.optimizer_state(optimizer, self._optimizers[id(optimizer)])

    @override
    def save_checkpoint(
        self, path: Any, state: dict[str, Any], storage_options: Any | None = None, filter: dict | None = None
    ) -> None:
        """Collective: ``fabric.save(path, state)``, sharded (a directory every rank writes its slices into) or
        full (one file on rank 0, in the user's keys), atomically."""
        if filter is not None:
            raise ValueError("fabric.save(filter=...) is not supported by the shardlab strategy. HINT: save it all.")
        key, optimizer_keys, rest = fabric_state.split_state(state, "fabric.save")
        sharded = self.sharded_model(state[key])
        optimizers = [state[k] for k in optimizer_keys]
        checkpoint = {k: fabric_state.plain(v) for k, v in rest.items()}
        checkpoint["state_dict"] = self.get_module_state_dict(state[key])
        checkpoint["optimizer_states"] = [self.get_optimizer_state(o) for o in optimizers]
        checkpoint[fabric_state.FABRIC_KEYS] = {"module": key, "optimizers": optimizer_keys}
        ckpt.save(
            checkpoint,
            path,
            sharded,
            optimizers,
            self.precision.precision,
            self.checkpoint_io,
            storage_options,
            reshape=fabric_state.to_user_shape,
        )

    @override
    def load_checkpoint(
        self,
        path: Any,
        state: nn.Module | Optimizer | dict[str, Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Collective: ``fabric.load(path, state)`` of either format, at any world size and stage; with a module
        (``fabric.load_raw``), only its weights, from a Fabric or Trainer checkpoint or a plain state dict file."""
        if isinstance(state, nn.Module):
            self._load_weights(path, state, strict, weights_only)
            return {}
        if not state or isinstance(state, Optimizer):
            raise ValueError(
                "the shardlab strategy restores into the objects it sharded: `fabric.load(path, {'model': model,"
                " 'optimizer': optimizer, ...})`. HINT: to read a checkpoint without a run, use `shardlab"
                " consolidate` (sharded) or torch.load (full)."
            )
        key, optimizer_keys, _ = fabric_state.split_state(state, "fabric.load")
        sharded = self.sharded_model(state[key])
        checkpoint = self._read(path, sharded, state[key], weights_only)
        checkpoint = fabric_state.to_layout(checkpoint, state)
        ckpt.load_model(sharded, checkpoint, strict)
        if optimizer_keys:
            saved_keys = fabric_state.saved_optimizer_keys(checkpoint, optimizer_keys)
            ckpt.load_optimizers([state[k] for k in saved_keys], sharded, checkpoint)
        plain_keys = [k for k in state if k != key and k not in optimizer_keys]
        return fabric_state.restore_plain(state, checkpoint, plain_keys, strict, _validate_keys_for_strict_loading)

    def _read(self, path: Any, sharded: ShardedModel, module: nn.Module, weights_only: bool | None) -> dict[str, Any]:
        return ckpt.load(path, sharded, Owners(module), weights_only, self.checkpoint_io)

    def _load_weights(self, path: Any, module: nn.Module, strict: bool, weights_only: bool | None) -> None:
        sharded = self.sharded_model(module)
        ckpt.load_weights(path, sharded, Owners(module), weights_only, self.checkpoint_io, strict)

    # ---- teardown ----

    @override
    def teardown(self) -> None:
        for sharded in self.sharded_models.values():
            sharded.wait_gathers()  # the refresh after the last optimizer step may still be travelling
        super().teardown()


class _NoBackwardSync(_BackwardSyncControl):
    """``fabric.no_backward_sync(model, enabled)``: a micro-batch that no optimizer step follows."""

    def __init__(self, strategy: ShardLabStrategy) -> None:
        self.strategy = strategy

    @override
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        if not enabled:
            return nullcontext()
        sharded = self.strategy.sharded_model(module)
        defer = sharded.config.accumulation is Accumulation.DEFER
        return sharded.no_sync() if defer else sharded.accumulating()
