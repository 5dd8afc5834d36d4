"""``ShardLabStrategy``: the Lightning glue. Each hook is a few lines that delegate to the modules below."""

from __future__ import annotations

import gc
from collections.abc import Generator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch import Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_shardlab.checkpoint import save_load as ckpt
from lightning_shardlab.checkpoint.async_save import AsyncSaver
from lightning_shardlab.checkpoint.rank_state import Owners
from lightning_shardlab.comm.collectives import Comm
from lightning_shardlab.common.distributed import ShardLabDistributed
from lightning_shardlab.common.options import OPTIONS_DOC, options_to_configs, with_options
from lightning_shardlab.common.process_start import refuse_in_notebook
from lightning_shardlab.core.config import Accumulation, Stage
from lightning_shardlab.guard.callback import ShardLabSanity
from lightning_shardlab.sharding.build import shard_model, sharded_model_of_module
from lightning_shardlab.sharding.gathered import Modules, gathered_params
from lightning_shardlab.sharding.materialize import has_meta
from lightning_shardlab.sharding.optimizer import global_grad_norm, shard_optimizer
from lightning_shardlab.sharding.sharded_model import ShardedModel
from lightning_shardlab.trainer.averaging_subclasses import SHARDED, shard_weight_averaging
from lightning_shardlab.trainer.checkpoint_io import settle_state_dict_type
from lightning_shardlab.trainer.compiled import accept_compiled_modules
from lightning_shardlab.trainer.ema import ShardLabEMA
from lightning_shardlab.trainer.lightning_callbacks import gather_for_weight_readers, restore_param_groups
from lightning_shardlab.trainer.loop_collectives import verify_sigterm_broadcast
from lightning_shardlab.trainer.precision import ShardLabPrecision, shardlab_precision
from lightning_shardlab.trainer.spawn_launcher import ShardLabSpawnLauncher


def refuse_unsharded_callbacks(callbacks: list[Any], rank: int | None = None) -> None:
    """Lightning's weight averaging (``WeightAveraging``, ``EMAWeightAveraging``, ``StochasticWeightAveraging``) and
    users' subclasses of it run with the average sharded (trainer/averaging_subclasses.py); a subclass whose own code
    reads the whole averaged module is refused, on every rank, naming its method. One average per model."""
    shard_weight_averaging(callbacks, rank)
    averaging = [type(c).__name__ for c in callbacks if isinstance(c, (ShardLabEMA, *SHARDED))]
    if len(averaging) > 1:
        raise ValueError(
            f"{'' if rank is None else f'[rank {rank}] '}callbacks {averaging} each keep an average of the weights;"
            " the shardlab strategy keeps one per model. HINT: use one of them."
        )


class ShardLabStrategy(ShardLabDistributed, ParallelStrategy):
    __doc__ = (
        """Fully sharded data parallel training (ZeRO stages 1, 2 and 3) for any LightningModule.

    ``Trainer(strategy=ShardLabStrategy(stage=2, ...))``, or by name: ``"shardlab"`` (stage 3),
    ``"shardlab_stage_1"``, ``"shardlab_stage_2"``, ``"shardlab_stage_3"``; in a notebook ``"shardlab_notebook"``
    (ranks forked from the kernel), from a script also ``"shardlab_spawn"``, each with the same stage suffixes
    (docs/notebooks.md). Fabric's twin takes the same options (``lightning_shardlab.fabric.ShardLabStrategy``).

    Args:"""
        + OPTIONS_DOC
    )

    strategy_name = "shardlab"

    @with_options
    def __init__(
        self,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        **options: Any,
    ) -> None:
        self.config, self.sanity_config = options_to_configs(options, "ShardLabStrategy")
        self._format_asked = "state_dict_type" in options  # else a user's CheckpointIO plugin decides it
        super().__init__(accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin)
        self.comm: Comm | None = None
        self.sharded: ShardedModel | None = None
        self._saver: AsyncSaver | None = None  # async_save (or Lightning's AsyncCheckpointIO): the save in flight

    # ---- devices, ranks, process group (common/distributed.py) ----

    @property
    def is_distributed(self) -> bool:
        return True

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        refuse_in_notebook(self.config.start_method, self.cluster_environment.creates_processes_externally)
        if self.config.start_method != "popen":  # as Lightning's DDP: ranks started from this process
            self._launcher = ShardLabSpawnLauncher(self, start_method=self.config.start_method)
        elif not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    @override
    def setup_environment(self) -> None:
        if self.lightning_module is not None and self.lightning_module._trainer is not None:
            rank = self.node_rank * self.num_processes + self.local_rank  # as set_world_ranks will set it
            refuse_unsharded_callbacks(self.lightning_module.trainer.callbacks, rank)  # before any collective
        self.config = settle_state_dict_type(self.config, self._checkpoint_io, self._format_asked)
        super().setup_environment()
        self.set_world_ranks()
        self.comm = self.open_process_group()

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
            self.lightning_module, self.config, self.open_mesh(), plugin.policy(self.config.reduce_dtype)
        )
        self.comm = self.sharded.comm  # a module sharded by an earlier Trainer keeps its comm and ledger
        if self._sanity_driver(trainer).config.verify_collectives:
            self.sharded.verify_collectives()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            self.sharded.reads.open()  # hooks read gradients and stage-3 weights from the shards until fit ends
            verify_sigterm_broadcast(trainer, self.sharded.comm)  # a read on some ranks only meets it
        self.setup_precision_plugin()
        plugin.sharded = self.sharded
        if (
            self.sharded.config.stage is Stage.PARAMETERS
        ):  # ModelPruning, BaseFinetuning (trainer/lightning_callbacks.py)
            gather_for_weight_readers(trainer.callbacks, lambda writeback: self.gathered_params(writeback=writeback))

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
        self.setup_offload(self.sharded, self.optimizers)

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        # once sharded (by this strategy, or by an earlier Trainer's: a second fit of the same module), the flat
        # parameters already live on the device; meta parameters are built there
        sharded = self.sharded or sharded_model_of_module(self.model)
        if sharded is None and not has_meta(self.model):
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
        assert self.sharded is not None
        optimizers = [optimizer] if optimizer is not None else self.optimizers
        params = self.sharded.masters(p for opt in optimizers for group in opt.param_groups for p in group["params"])
        return global_grad_norm(params, float(norm_type), self.sharded.mesh.shard)  # the replicas hold the same

    # ---- collectives Lightning asks for (metrics, barriers) ----

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        """Metrics (``self.log(..., sync_dist=True)``) and Lightning's decisions (common/distributed.py)."""
        return self.reduce_tensor(tensor, group, reduce_op, "metrics")

    # ---- state dicts and checkpoints ("sharded" directories or "full" files: checkpoint/save_load.py) ----

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
            saver=self.saver,
        )

    @property
    def saver(self) -> AsyncSaver | None:
        """The background writer of ``async_save=True``, or of Lightning's ``AsyncCheckpointIO`` plugin (sharded
        checkpoints: their files are ours to write); None when saves are synchronous."""
        if self._saver is None and (self.config.async_save or isinstance(self.checkpoint_io, AsyncCheckpointIO)):
            if self.config.state_dict_type == "full":
                raise ValueError(
                    "async_save (or AsyncCheckpointIO) writes sharded checkpoints in the background, not"
                    " state_dict_type='full' files. HINT: use state_dict_type='sharded' (the default), and"
                    " `shardlab consolidate` for one file later."
                )
            self._saver = AsyncSaver()
        return self._saver

    def wait_for_checkpoint(self) -> None:
        """Collective: complete the checkpoint in flight (async_save), raising its failure on every rank."""
        if self._saver is not None:
            self._saver.wait()

    @override
    def on_train_end(self) -> None:
        self.wait_for_checkpoint()
        if self.sharded is not None:  # after every hook of training: a read some ranks made alone meets this call
            self.sharded.reads.close(last_call=True)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """A save in flight is completed as soon as every rank has written its files (checkpoint/async_save.py)."""
        super().on_train_batch_start(batch, batch_idx)
        if self._saver is not None and self.sharded is not None:
            self._saver.conclude_if_written(self.sharded.comm)

    @override
    def on_exception(self, exception: BaseException) -> None:
        if self.sharded is not None:
            self.sharded.reads.close(last_call=False)
        if self._saver is not None:  # no collective now: the save in flight is left incomplete, the last stays
            self._saver.abandon()

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Collective: either format, verified, the same verdict on every rank; per-rank entries restored."""
        assert self.sharded is not None and self.lightning_module is not None
        self.wait_for_checkpoint()
        owners = Owners.of(self.lightning_module.trainer)
        return ckpt.load(checkpoint_path, self.sharded, owners, weights_only, self.checkpoint_io)

    def load_raw(self, filepath: Any, strict: bool = True, weights_only: bool | None = None) -> None:
        """Collective: load only the module's weights, from a checkpoint of either front door (a Fabric one
        included) or a plain state dict file, e.g. in ``on_fit_start``; optimizer and loops stay as they are."""
        assert self.sharded is not None and self.lightning_module is not None, "load_raw() needs the model set up"
        owners = Owners(self.lightning_module)
        ckpt.load_weights(filepath, self.sharded, owners, weights_only, self.checkpoint_io, strict)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        def remove() -> None:
            if self.is_global_zero:
                ckpt.remove(filepath, self.checkpoint_io)

        if self._saver is not None:
            self._saver.after(remove)  # the old one goes once the checkpoint in flight is complete
        else:
            remove()

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
        restore_param_groups(
            self.lightning_module.trainer
        )  # a finetuning callback's added groups (trainer/lightning_callbacks.py)
        ckpt.load_optimizers(self.optimizers, self.sharded, checkpoint)

    # ---- teardown ----

    @override
    def teardown(self) -> None:
        # The module stays sharded (parameters at rest, hooks) so later validate/test/predict reuse it; the
        # base teardown's module.cpu() would try to copy parameters at rest, which refuse to be read.
        assert self.cluster_environment is not None and self.accelerator is not None
        if self.sharded is not None:
            self.sharded.wait_gathers()  # the refresh after the last optimizer step may still be travelling
            self.wait_for_checkpoint()
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
        # What an earlier fit left (its trainer, callbacks, a model no longer used) lives in reference cycles:
        # collected now, so that its memory goes with it rather than at some collection in the middle of the next
        # fit (the guard's store connections go back to their pool when its checks close: guard/side_channel.py)
        gc.collect()


accept_compiled_modules(ShardLabStrategy)  # trainer.fit(torch.compile(model)) (trainer/compiled.py)
