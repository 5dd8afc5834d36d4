"""Independent counts taken by the tests (never by asking the package): live storages, collective calls."""

from __future__ import annotations

import gc
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

COLLECTIVES = (
    "all_gather_single",
    "reduce_scatter_single",
    "all_reduce",
    "broadcast",
    "all_gather_object",
    "broadcast_object_list",
    "all_gather",
    "reduce_scatter",
    "barrier",
    "all_gather_into_tensor",
)


def live_cpu_bytes(exclude: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of every distinct CPU tensor storage reachable from Python right now (views counted once)."""
    gc.collect()
    excluded = {t.untyped_storage().data_ptr() for t in exclude}
    seen, total = set(), 0
    for obj in gc.get_objects():
        if not isinstance(obj, torch.Tensor) or obj.is_meta or obj.device.type != "cpu":
            continue
        storage = obj.untyped_storage()
        key = storage.data_ptr()
        if storage.nbytes() == 0 or key in seen or key in excluded:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


@contextmanager
def counting_collectives() -> Iterator[Counter]:
    """Count calls of torch.distributed's collectives inside the block, by name."""
    counts: Counter = Counter()
    originals = {name: getattr(dist, name) for name in COLLECTIVES}

    def wrap(name: str, fn):  # noqa: ANN001, ANN202
        def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            counts[name] += 1
            return fn(*args, **kwargs)

        return counted

    for name, fn in originals.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
