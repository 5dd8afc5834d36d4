"""The budget: what each rank holds and what moves between ranks.

Communication is recorded by the collectives as it happens (the call's own tensor sizes, and a wall
clock from launch to ``wait()`` returning). Memory is read from the real tensors this rank holds,
by category, each storage counted once. Nothing here is estimated; ``predict`` in budget.py says what
the ZeRO table expects, and the two are shown side by side.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torch import Tensor
from torch.optim import Optimizer

if TYPE_CHECKING:
    from lightning_shardlab.flat_param import FlatParam


@dataclass
class CollectiveTotals:
    count: int = 0
    bytes: int = 0  # the size of the full (gathered / reduced) tensor of each call
    seconds: float = 0.0  # this rank blocked on it: launching, and waiting (what compute did not hide)

    def add(self, nbytes: int) -> None:
        self.count += 1
        self.bytes += nbytes


@dataclass
class Ledger:
    """Collective traffic by kind and by (kind, label), since the last ``reset()``. A call counts (and its
    bytes) when it is launched; its seconds when it is waited for, which may be later (async)."""

    by_kind: dict[str, CollectiveTotals] = field(default_factory=lambda: defaultdict(CollectiveTotals))
    by_label: dict[tuple[str, str], CollectiveTotals] = field(default_factory=lambda: defaultdict(CollectiveTotals))

    gathered_bytes: int = 0  # full buffers allocated right now by stage-3 unsharding
    gathered_peak: int = 0  # the most at once since the last reset_peak()

    def track_gathered(self, delta: int) -> None:
        self.gathered_bytes += delta
        self.gathered_peak = max(self.gathered_peak, self.gathered_bytes)

    def reset_peak(self) -> None:
        self.gathered_peak = self.gathered_bytes

    def record_launch(self, kind: str, label: str, nbytes: int) -> None:
        self.by_kind[kind].add(nbytes)
        self.by_label[(kind, label)].add(nbytes)

    def record_seconds(self, kind: str, label: str, seconds: float) -> None:
        self.by_kind[kind].seconds += seconds
        self.by_label[(kind, label)].seconds += seconds

    def snapshot(self) -> dict[tuple[str, str], tuple[int, int, float]]:
        """(count, bytes, seconds) by (kind, label), to subtract a stretch (e.g. validation) later."""
        return {key: (t.count, t.bytes, t.seconds) for key, t in self.by_label.items()}

    def counts(self) -> dict[str, int]:
        return {kind: totals.count for kind, totals in self.by_kind.items()}

    def reset(self) -> None:
        self.by_kind.clear()
        self.by_label.clear()


MEMORY_CATEGORIES = ("params", "grads", "master", "optimizer_state", "padding")


def _storage_bytes(tensors: Iterable[Tensor], seen: set[int]) -> int:
    total = 0
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() == 0 or t.is_meta:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def measure_memory(flat_params: list[FlatParam], optimizers: Iterable[Optimizer] = ()) -> dict[str, int]:
    """Bytes this rank holds right now, by category, read from the storages of the real tensors.

    ``params`` counts the compute copies (shards, and full buffers while they are allocated);
    ``padding`` is the part of ``params`` and ``grads`` that pads flat parameters to the world size.
    """
    seen: set[int] = set()
    out = dict.fromkeys(MEMORY_CATEGORIES, 0)
    out["params"] = _storage_bytes([t for fp in flat_params for t in (fp.full, fp.shard)], seen)
    out["master"] = _storage_bytes([fp.master for fp in flat_params], seen)
    out["grads"] = _storage_bytes([fp.grad_shard for fp in flat_params if fp.grad_shard is not None], seen)
    out["grads"] += _storage_bytes([p.grad for fp in flat_params for p in fp.unsharded_params if p.grad is not None], seen)
    state = [v for opt in optimizers for s in opt.state.values() for v in s.values() if isinstance(v, Tensor)]
    out["optimizer_state"] = _storage_bytes(state, seen)
    out["padding"] = sum(_padding_bytes(fp) for fp in flat_params)
    return out


def _padding_bytes(fp: FlatParam) -> int:
    start, end = fp.layout.shard_range(fp.rank)
    in_shard = max(0, end - max(fp.layout.numel, start))  # padding elements inside this rank's shard
    held = fp.layout.padding if fp.full.untyped_storage().nbytes() > 0 else 0
    if fp.shard.untyped_storage().data_ptr() != fp.full.untyped_storage().data_ptr():
        held += in_shard  # a shard of its own (stage 3)
    grads = in_shard * fp.grad_shard.element_size() if fp.grad_shard is not None else 0
    return held * fp.layout.dtype.itemsize + grads
