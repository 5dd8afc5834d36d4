"""Precision for sharded training: the recipe both front doors share, and what it tells the flat parameters.

| precision    | gathered, computed in     | master shard | grads kept in | reduced in (default) |
| ------------ | ------------------------- | ------------ | ------------- | -------------------- |
| "32-true"    | fp32                      | = the shard  | fp32          | fp32                 |
| "bf16-mixed" | bf16 copies, autocast     | fp32         | bf16          | fp32                 |
| "16-mixed"   | fp16 copies, autocast     | fp32         | fp16          | fp32; dynamic loss scale |
| "bf16-true"  | bf16 (module converted)   | = the shard  | bf16          | bf16                 |

With "bf16-mixed" and AdamW each rank holds 2 B compute copy + 2 B gradient + 4 B master + 8 B
moments = 16 B per parameter, divided by N at stage 3 (the ZeRO table). Gradient clipping takes
the global norm over every rank's shards; the fp16 loss scale skips a step when any rank overflowed.

``PrecisionRecipe`` is all of that on ``lightning.fabric``'s plugin interface; trainer/precision.py adds the
Trainer's hooks and fabric/precision.py Fabric's, so the two plugins differ only where Lightning's two APIs do.
``convert_plugin`` turns what either front door chose into its shardlab plugin.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.plugins.precision import Precision as FabricPrecision
from lightning.fabric.plugins.precision.utils import _convert_fp_tensor, _DtypeContextManager
from lightning_utilities import apply_to_collection
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_shardlab.comm import collectives
from lightning_shardlab.core.config import DTYPES, PrecisionPolicy
from lightning_shardlab.sharding.optimizer import clip_grad_norm_

if TYPE_CHECKING:
    from lightning_shardlab.sharding.sharded_model import ShardedModel

SUPPORTED = ("32-true", "bf16-mixed", "16-mixed", "bf16-true")
COMPUTE = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


class DynamicLossScale:
    """fp16's loss scale: halve it on overflow (and skip the step), double it after ``interval`` good steps."""

    def __init__(self, scale: float = 2.0**16, interval: int = 2000) -> None:
        self.scale, self.interval, self.good_steps = scale, interval, 0

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale, self.good_steps = self.scale / 2, 0
        else:
            self.good_steps += 1
            if self.good_steps == self.interval:
                self.scale, self.good_steps = self.scale * 2, 0


class PrecisionRecipe(FabricPrecision):
    """Dtypes, autocast, input conversion, global clipping and the fp16 loss scale, for either front door."""

    def __init__(self, precision: str = "32-true", norm_type: float = 2.0) -> None:
        if precision not in SUPPORTED:
            raise ValueError(
                f"`precision={precision!r}` is not supported by the shardlab strategy. Allowed: {', '.join(SUPPORTED)}."
            )
        super().__init__()
        self.precision = precision  # type: ignore[assignment]
        self.norm_type = norm_type
        self.device_type = "cpu"  # for autocast; the strategy sets its root device's type
        self.loss_scale = DynamicLossScale() if precision == "16-mixed" else None
        self.sharded: ShardedModel | None = None  # set by the strategy once the model is sharded
        self.last_grad_norm: Tensor | None = None

    @property
    def compute_dtype(self) -> torch.dtype | None:
        return COMPUTE.get(self.precision)

    def policy(self, reduce_dtype: str | None) -> PrecisionPolicy:
        return PrecisionPolicy(self.compute_dtype, DTYPES[reduce_dtype] if reduce_dtype else None)

    # ---- where tensors are made and computed ----

    @override
    def convert_module(self, module: Module) -> Module:
        return module.to(torch.bfloat16) if self.precision == "bf16-true" else module

    @override
    def tensor_init_context(self) -> AbstractContextManager:
        return _DtypeContextManager(torch.bfloat16) if self.precision == "bf16-true" else nullcontext()

    @override
    def module_init_context(self) -> AbstractContextManager:
        return self.tensor_init_context()

    @override
    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        if self.compute_dtype is not None:  # the gathered copies are already low precision; autocast
            with torch.autocast(self.device_type, dtype=self.compute_dtype, cache_enabled=False):
                yield  # keeps softmax, norms and losses in fp32 and matches the inputs to them
        else:
            with self.tensor_init_context():
                yield

    @override
    def convert_input(self, data: Any) -> Any:
        if self.precision != "bf16-true":
            return data
        return apply_to_collection(data, function=_convert_fp_tensor, dtype=Tensor, dst_type=torch.bfloat16)

    # ---- gradients: global clipping, fp16 loss scaling ----

    @override
    def main_params(self, optimizer: Optimizer) -> list[Tensor]:  # type: ignore[override]
        """What the gradients are read from: the master views of the optimizer's parameters (clip by value)."""
        assert self.sharded is not None
        return self.sharded.masters(super().main_params(optimizer))

    def clip_by_global_norm(self, optimizer: Optimizer, max_norm: float, norm_type: float | None = None) -> Tensor:
        """Collective: clip ``optimizer``'s gradients by their global norm; returns the norm before clipping."""
        assert self.sharded is not None, "the strategy connects the precision plugin before training"
        params = self.main_params(optimizer)
        norm = self.norm_type if norm_type is None else norm_type
        self.last_grad_norm = clip_grad_norm_(params, max_norm, norm, self.sharded.mesh.shard)
        return self.last_grad_norm

    @override
    def pre_backward(self, tensor: Tensor, module: Any) -> Any:
        if self.loss_scale is not None:
            tensor = tensor * self.loss_scale.scale
        super().pre_backward(tensor, module)  # the Trainer's calls on_before_backward; Fabric's does nothing
        return tensor

    def _unscale(self, optimizer: Optimizer) -> bool:
        """Divide the gradients by the loss scale; True when any rank saw inf or nan (one all-reduce)."""
        assert self.sharded is not None and self.loss_scale is not None
        grads = [p.grad for p in self.main_params(optimizer) if p.grad is not None]
        bad = torch.zeros((), dtype=torch.int32, device=self.sharded.comm.device)
        for g in grads:
            g.mul_(1.0 / self.loss_scale.scale)
            bad |= (~torch.isfinite(g)).any().int().to(bad.device)
        return bool(collectives.all_reduce(bad, self.sharded.comm, op="max", label="loss scale overflow"))

    def _step_or_skip(self, optimizer: Optimizer, overflow: bool, **kwargs: Any) -> Any:
        """After unscaling: step, or (any rank overflowed) skip the step on every rank, as GradScaler does."""
        assert self.loss_scale is not None and self.sharded is not None
        self.loss_scale.update(overflow)
        if overflow:
            self.sharded.skip_step()
            return None
        return optimizer.step(**kwargs)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {} if self.loss_scale is None else dict(vars(self.loss_scale))

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.loss_scale is not None and state_dict:
            vars(self.loss_scale).update(state_dict)


def convert_plugin(
    plugin: Any, ours: type[PrecisionRecipe], lightning: tuple[type, ...], norm_type: float, front_door: str
) -> Any:
    """The shardlab plugin (class ``ours``) for what a front door chose: one of Lightning's plain plugins
    (``lightning``) with a supported name, or ours already; anything else is refused, naming the choices."""
    if plugin is None or isinstance(plugin, ours):
        return plugin or ours(norm_type=norm_type)
    name = getattr(plugin, "precision", type(plugin).__name__)
    if type(plugin) in lightning and name in SUPPORTED:
        return ours(name, norm_type)
    raise ValueError(
        f"`{front_door}(precision={name!r})` is not supported by the shardlab strategy."
        f" Allowed: {', '.join(SUPPORTED)}."
    )
