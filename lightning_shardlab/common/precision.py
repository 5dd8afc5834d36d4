"""Precision for sharded training: the recipe both front doors share, and what it tells the flat parameters.

| precision    | gathered, computed in     | master shard | grads kept in | reduced in (default) |
| ------------ | ------------------------- | ------------ | ------------- | -------------------- |
| "32-true"    | fp32                      | = the shard  | fp32          | fp32                 |
| "bf16-mixed" | bf16 copies, autocast     | fp32         | bf16          | fp32                 |
| "16-mixed"   | fp16 copies, autocast     | fp32         | fp16          | fp32; dynamic loss scale |
| "bf16-true"  | bf16 (module converted)   | = the shard  | bf16          | bf16                 |

With "bf16-mixed" and AdamW each rank holds 2 B compute copy + 2 B gradient + 4 B master + 8 B
moments = 16 B per parameter, divided by N at stage 3 (the ZeRO table). Gradient clipping takes
the global norm over every rank's shards; the fp16 loss scale (torch's GradScaler, common/grad_scaler.py)
skips a step when any rank overflowed.

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

from lightning_shardlab.common.grad_scaler import ShardedGradScaler
from lightning_shardlab.core.config import DTYPES, PrecisionPolicy
from lightning_shardlab.sharding.optimizer import clip_grad_norm_

if TYPE_CHECKING:
    from lightning_shardlab.sharding.sharded_model import ShardedModel

SUPPORTED = ("32-true", "bf16-mixed", "16-mixed", "bf16-true")
COMPUTE = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


class PrecisionRecipe(FabricPrecision):
    """Dtypes, autocast, input conversion, global clipping and the fp16 loss scale, for either front door."""

    def __init__(
        self, precision: str = "32-true", norm_type: float = 2.0, scaler: torch.amp.GradScaler | None = None
    ) -> None:
        if precision not in SUPPORTED:
            raise ValueError(
                f"`precision={precision!r}` is not supported by the shardlab strategy. Allowed: {', '.join(SUPPORTED)}."
            )
        super().__init__()
        self.precision = precision  # type: ignore[assignment]
        self.norm_type = norm_type
        # "16-mixed": torch's GradScaler where Lightning keeps it (common/grad_scaler.py); None otherwise
        self.scaler = ShardedGradScaler.like(scaler, "cpu", self.main_params) if precision == "16-mixed" else None
        self._device_type = "cpu"
        self._sharded: ShardedModel | None = None
        self.last_grad_norm: Tensor | None = None

    @property
    def device_type(self) -> str:
        """For autocast and the scaler; the strategy sets its root device's type."""
        return self._device_type

    @device_type.setter
    def device_type(self, device_type: str) -> None:
        if self.scaler is not None and device_type != self._device_type:
            self.scaler = ShardedGradScaler.like(self.scaler, device_type, self.main_params)
        self._device_type = device_type

    @property
    def sharded(self) -> ShardedModel | None:
        return self._sharded

    @sharded.setter
    def sharded(self, sharded: ShardedModel | None) -> None:
        """Set by the strategy once the model is sharded (the scaler reduces its overflow flag on its comm)."""
        self._sharded = sharded
        if self.scaler is not None:
            self.scaler.sharded = sharded

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
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        super().pre_backward(tensor, module)  # the Trainer's calls on_before_backward; Fabric's does nothing
        return tensor

    def _step_or_skip(self, optimizer: Optimizer, **kwargs: Any) -> Any:
        """After unscaling: the scaler steps, or (any rank overflowed) skips the step on every rank and drops its
        gradients; then it updates the scale, as Lightning's MixedPrecision does."""
        assert self.scaler is not None and self.sharded is not None
        overflow = self.scaler.overflowed(optimizer)
        stepped = self.scaler.step(optimizer, **kwargs)
        self.scaler.update()
        if overflow:
            self.sharded.skip_step()
        return stepped

    @override
    def state_dict(self) -> dict[str, Any]:
        return {} if self.scaler is None else self.scaler.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and state_dict:
            self.scaler.load_state_dict(state_dict)


def convert_plugin(
    plugin: Any, ours: type[PrecisionRecipe], lightning: tuple[type, ...], norm_type: float, front_door: str
) -> Any:
    """The shardlab plugin (class ``ours``) for what a front door chose: one of Lightning's plain plugins
    (``lightning``) with a supported name, or ours already; anything else is refused, naming the choices."""
    if plugin is None or isinstance(plugin, ours):
        return plugin or ours(norm_type=norm_type)
    name = getattr(plugin, "precision", type(plugin).__name__)
    if type(plugin) in lightning and name in SUPPORTED:
        return ours(name, norm_type, scaler=getattr(plugin, "scaler", None))  # a user's scaler: its settings kept
    raise ValueError(
        f"`{front_door}(precision={name!r})` is not supported by the shardlab strategy."
        f" Allowed: {', '.join(SUPPORTED)}."
    )
