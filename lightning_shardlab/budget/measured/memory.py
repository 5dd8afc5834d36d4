"""The budget, measured: the bytes this rank holds right now, read from the storages of its real tensors.

Each storage is counted once, by category (the same categories predict.py uses); nothing is estimated.
``error_feedback`` is the int8 reductions' residuals (``reduce_dtype='int8'``, docs/slow_links.md): 0 otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.utils._pytree import tree_leaves

from lightning_shardlab.sharding.flat_param import FlatParam

MEMORY_CATEGORIES = ("params", "grads", "master", "optimizer_state", "error_feedback", "padding")


def _storage_bytes(tensors: Iterable[Tensor], seen: set[int]) -> int:
    total = 0
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() == 0 or t.is_meta:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def category_tensors(flat_params: list[FlatParam], optimizers: Iterable[Optimizer] = ()) -> dict[str, list[Tensor]]:
    """The real tensors behind each category but padding (a storage shared by two categories counts in the
    first: the fp32 master *is* the shard)."""
    state = [v for opt in optimizers for s in opt.state.values() for v in s.values() if isinstance(v, Tensor)]
    return {
        "params": [t for fp in flat_params for t in (fp.full, fp.shard)],
        "master": [fp.master for fp in flat_params],
        "grads": [fp.grad_shard for fp in flat_params if fp.grad_shard is not None]
        + [p.grad for fp in flat_params for p in fp.params if p.grad is not None],
        "optimizer_state": state,
        "error_feedback": [fp.residual for fp in flat_params if fp.residual is not None],
    }


def measure_memory(
    flat_params: list[FlatParam], optimizers: Iterable[Optimizer] = (), keep: Callable[[Tensor], bool] | None = None
) -> dict[str, int]:
    """Bytes this rank holds right now, by category, read from the storages of the real tensors (only those
    ``keep`` accepts, if given: e.g. the ones in one tier, budget/measured/tiers.py).

    ``params`` counts the compute copies (shards, and full buffers while they are allocated);
    ``padding`` is the part of ``params`` and ``grads`` that pads flat parameters to the world size.
    """
    seen: set[int] = set()
    out = dict.fromkeys(MEMORY_CATEGORIES, 0)
    for category, tensors in category_tensors(flat_params, optimizers).items():
        out[category] = _storage_bytes([t for t in tensors if keep is None or keep(t)], seen)
    out["padding"] = sum(_padding_bytes(fp) for fp in flat_params)
    return out


def _padding_bytes(fp: FlatParam) -> int:
    in_shard = fp.layout.padding_in_shard(fp.rank)
    held = fp.layout.padding if fp.full.untyped_storage().nbytes() > 0 else 0
    if fp.shard.untyped_storage().data_ptr() != fp.full.untyped_storage().data_ptr():
        held += in_shard  # a shard of its own (stage 3)
    grads = in_shard * fp.grad_shard.element_size() if fp.grad_shard is not None else 0
    return held * fp.layout.dtype.itemsize + grads


def live_storages(
    flat_params: list[FlatParam], optimizers: Iterable[Optimizer] = (), batch: Any = None
) -> list[torch.UntypedStorage]:
    """Every storage of model state this rank holds right now, and the batch's, each once: what is live as a step
    starts (budget/measured/step_peak.py)."""
    tensors = [t for ts in category_tensors(flat_params, optimizers).values() for t in ts]
    tensors += [t for t in tree_leaves(batch) if isinstance(t, Tensor)]
    storages = {}
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes() and not t.is_meta:
            storages.setdefault(storage.data_ptr(), storage)
    return list(storages.values())
