"""A stage-3 parameter between steps: its real shape, no values here; read from the shards during fit, else refused.

At stage 3 each rank holds a slice of every flat parameter between steps. The module's parameters stay the
same objects for the whole run (the optimizer and callbacks hold them too); while their unit is sharded,
each one's ``.data`` is a *stub* (its real shape and dtype over a storage of 0 bytes, so it costs no memory)
and its class is ``ShardedAtRest``. What needs no values answers at once: ``shape``, ``dim()``, ``numel()``,
``dtype``, ``device``, ``requires_grad`` (read and set), ``.grad``, and where it lies (``untyped_storage()``,
``data_ptr()``, strides: the stub's, as memory accounting reads them). Every other tensor operation is a read of
its values: while the strategy serves reads (during fit; Fabric after setup) it is served from the ranks' shards,
as a collective every rank makes (sharding/shard_reads.py); otherwise it raises, naming the parameter, the code
that read it (a Lightning callback if one did) and the fix. When the unit is gathered the class is plain
``nn.Parameter`` again, so computing costs nothing extra.

``refuse_placeholders`` is the state-dict hook the sharded model installs; ``placeholders_allowed`` lets the
checkpoint code list the keys (``state_dict(keep_vars=True)``) without reading any value.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from lightning_shardlab.sharding.refused_optimizers import refused_under_construction

# what a parameter at rest still answers: its metadata, its flag and its gradient, never its values
METADATA = frozenset(
    {
        Tensor.shape.__get__,
        Tensor.ndim.__get__,
        Tensor.dtype.__get__,
        Tensor.device.__get__,
        Tensor.layout.__get__,
        Tensor.is_cuda.__get__,
        Tensor.is_meta.__get__,
        Tensor.is_sparse.__get__,
        Tensor.is_quantized.__get__,
        Tensor.requires_grad.__get__,
        Tensor.requires_grad.__set__,
        Tensor.grad.__get__,
        Tensor.grad.__set__,
        Tensor.is_leaf.__get__,
        Tensor.grad_fn.__get__,
        Tensor.data.__set__,
        Tensor.untyped_storage,  # the stub's: 0 bytes, what memory accounting sees
        Tensor.data_ptr,
        Tensor.storage_offset,
        Tensor.stride,
        Tensor.is_contiguous,
        Tensor.nbytes.__get__,
        Tensor.itemsize.__get__,
        Tensor.size,
        Tensor.dim,
        Tensor.numel,
        Tensor.nelement,
        Tensor.element_size,
        Tensor.is_floating_point,
        Tensor.is_complex,
        Tensor.requires_grad_,
        Tensor.get_device,
        Tensor.__hash__,
    }
)


class ShardedAtRest(nn.Parameter):
    """The class of a stage-3 parameter while its unit is sharded (see the module docstring)."""

    _shardlab_name: str = "?"
    _shardlab_rank: int = 0

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func not in METADATA:
            rest = next((a for a in _tensors(args, kwargs) if isinstance(a, ShardedAtRest)), None)
            if rest is not None:  # during fit its values are read from the shards (sharding/shard_reads.py)
                from lightning_shardlab.sharding.shard_reads import serve_at_rest

                return serve_at_rest(func, args, kwargs or {}, rest)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))

    def __deepcopy__(self, memo: dict) -> Any:
        raise at_rest_error(self, "deepcopy")

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise at_rest_error(self, "pickle")


def _tensors(args: tuple, kwargs: dict | None) -> Iterator[Any]:
    for a in (*args, *(kwargs or {}).values()):
        if isinstance(a, (list, tuple)):
            yield from a
        else:
            yield a


def at_rest_error(param: ShardedAtRest, what: str) -> Exception:
    strategy = _calling_strategy()
    if strategy is not None:
        return handed_over_error(param, strategy)
    refused = refused_under_construction(param._shardlab_rank)  # ZeroRedundancyOptimizer reads while it is made
    if refused is not None:
        return refused
    caller = _calling_callback()
    by = f" by {caller}" if caller else ""
    return RuntimeError(
        f"[rank {param._shardlab_rank}] parameter {param._shardlab_name!r} was read ({what}){by} while it is sharded"
        " (stage 3): between steps each rank holds only a slice of it, so its values are not here (a hook's read during"
        " fit is served from the shards, as a collective every rank makes; not here). HINT: read or"
        " change it inside `with trainer.strategy.gathered_params(writeback=True):` on every rank (Fabric:"
        " `fabric.strategy.gathered_params(...)`); for the whole state dict call trainer.strategy.full_state_dict()"
        " on every rank; or train with strategy='shardlab_stage_2', where every rank keeps the whole parameters."
    )


def handed_over_error(param: ShardedAtRest, strategy: str) -> RuntimeError:
    """A module a shardlab run left sharded (stage 3), set up by another strategy: its weights are on the ranks."""
    return RuntimeError(
        f"[rank {param._shardlab_rank}] {strategy} was given a module that a shardlab run left sharded (stage 3):"
        f" between steps each rank holds only a slice of its parameters ({param._shardlab_name!r} is one), so"
        " another strategy cannot set it up. HINT: get the weights out first, in one of these ways: fit it again"
        " with the same shardlab options (a new Trainer continues it); on every rank of the run,"
        " `trainer.strategy.full_state_dict()` (rank 0 gets the whole state dict) and load it into a new module;"
        " `MyModule.load_from_checkpoint(path)` of a checkpoint the run saved (either format, in any process); or"
        " `shardlab consolidate CHECKPOINT model.ckpt` for one plain file with the optimizer state too."
    )


def _calling_strategy() -> str | None:
    """Another Lightning strategy (not shardlab's) whose code is on the stack, e.g. DDP's ``model_to_device``."""
    for info in inspect.stack(context=0)[2:]:
        owner = info.frame.f_locals.get("self")
        kind = type(owner)
        if any(c.__name__ == "Strategy" and c.__module__.startswith("lightning.") for c in kind.__mro__):
            return None if kind.__module__.startswith("lightning_shardlab") else kind.__name__
    return None


def _calling_callback() -> str | None:
    """The Lightning callback whose code is on the stack (named in the error), if any."""
    for info in inspect.stack(context=0)[2:]:
        owner = info.frame.f_locals.get("self")
        if owner is not None and any(c.__name__ == "Callback" for c in type(owner).__mro__[1:]):
            return f"{type(owner).__name__}.{info.function}"
    return None


def refuse_placeholders(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    if not _listing.active and any(isinstance(v, ShardedAtRest) for v in state_dict.values()):
        raise RuntimeError(
            f"{type(module).__name__}.state_dict() was called while its parameters are sharded (stage 3): each"
            " rank holds only a slice. HINT: call trainer.strategy.full_state_dict() on every rank (rank 0 gets the"
            " whole model), or save a checkpoint with trainer.save_checkpoint()."
        )


class _Listing:
    active = False


_listing = _Listing()  # while True, placeholders may be listed (never read)


@contextmanager
def placeholders_allowed() -> Iterator[None]:
    """Let ``module.state_dict(keep_vars=True)`` list placeholders (to learn its keys)."""
    previous, _listing.active = _listing.active, True
    try:
        yield
    finally:
        _listing.active = previous
