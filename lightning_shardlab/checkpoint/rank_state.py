"""Per-rank side state: checkpoint entries that differ between ranks. Kept for every rank, never dropped.

Lightning dumps a checkpoint dict on every rank but writes rank 0's. Most of it is the same everywhere
(loop progress, LR schedulers, hyperparameters), but not all: a stateful sampler or dataloader remembers
this rank's position, a callback may count this rank's samples, BatchNorm statistics drift apart
between the buffer broadcasts of training steps. At save, every rank hashes each entry of its dict
(nested dicts entry by entry; one small all-gather of the hashes), and the entries whose hashes differ
are saved for every rank. At load:

- same world size: every rank gets back its own values, so resuming is exact;
- another world size: the object that owns an entry may map the N saved values to this rank's value,
  explicitly, by defining ``reshard_rank_state(self, path, states, world_size, rank)`` (``path``: the
  keys below its own entry; ``states``: the saved ranks' values in rank order; returns this rank's
  value). The owner is the callback for ``checkpoint["callbacks"][state_key]``, the datamodule for its
  own key and for the loops (a stateful training dataloader's state sits under
  ``checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"]``), else the LightningModule.
  Buffers (``checkpoint["state_dict"]``) take rank 0's values when the saving run broadcast buffers
  (``broadcast_buffers=True``, the default: its next training step would have done the same).
  Anything else raises ``ValueError`` on every rank, naming each entry. Loops that the current
  ``trainer.fn`` does not restore (e.g. the fit loop while validating) take rank 0's values.
"""

from __future__ import annotations

import hashlib
import io
import pickle
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

KeyPath = tuple[Hashable, ...]
ABSENT = {"shardlab_absent": True}  # the value of a per-rank top-level entry that a rank's dict does not have
EXCLUDED = ("optimizer_states",)  # sharded exactly by the checkpoint code; never compared here
ERROR_FEEDBACK = "shardlab_error_feedback"  # int8 reductions' residuals (checkpoint/residuals.py): reset, not resharded


def digest(value: Any) -> str:
    """A hash of ``value``'s content that is the same in every process for equal values."""
    h = hashlib.sha256()
    _feed(h, value)
    return h.hexdigest()[:32]


def _feed(h: Any, value: Any) -> None:
    if isinstance(value, Tensor):
        h.update(f"T{value.dtype}{tuple(value.shape)}".encode())
        try:
            h.update(value.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        except (RuntimeError, TypeError):  # sparse, quantized, ...: their serialized form
            buffer = io.BytesIO()
            torch.save(value.detach().to("cpu"), buffer)
            h.update(buffer.getvalue())
    elif isinstance(value, dict):
        h.update(b"{")
        for key in sorted(value, key=repr):
            _feed(h, key)
            _feed(h, value[key])
        h.update(b"}")
    elif isinstance(value, (list, tuple)):
        h.update(b"(" if isinstance(value, tuple) else b"[")
        for item in value:
            _feed(h, item)
        h.update(b")")
    elif isinstance(value, (set, frozenset)):  # iteration order of str sets differs between processes
        h.update(b"<")
        for item in sorted(value, key=repr):
            _feed(h, item)
        h.update(b">")
    else:
        try:
            h.update(pickle.dumps(value, protocol=4))
        except Exception:  # noqa: BLE001  (unpicklable: fall back to its text)
            h.update(repr(value).encode())


def tree_digests(tree: dict, prefix: KeyPath = ()) -> dict[KeyPath, str]:
    """Digest of every entry of a nested dict: a dict's own digest covers only its keys."""
    out: dict[KeyPath, str] = {prefix: "dict:" + digest(sorted(map(repr, tree)))} if prefix else {}
    for key, value in tree.items():
        path = (*prefix, key)
        if not prefix and key in EXCLUDED:
            continue
        if isinstance(value, dict) and value:
            out.update(tree_digests(value, path))
        else:
            out[path] = digest(value)
    return out


def differing_paths(everyone: list[dict[KeyPath, str]]) -> list[KeyPath]:
    """The outermost entries whose digests are not the same on every rank (missing counts as different)."""
    order: dict[KeyPath, None] = {}
    for digests in everyone:
        order.update(dict.fromkeys(digests))
    differ = {p for p in order if len({d.get(p) for d in everyone}) > 1}
    return [p for p in order if p in differ and not any(p[:i] in differ for i in range(1, len(p)))]


def get(tree: dict, path: KeyPath) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def get_or_absent(tree: dict, path: KeyPath) -> Any:
    try:
        return get(tree, path)
    except (KeyError, TypeError):
        return ABSENT


def put(tree: dict, path: KeyPath, value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    if isinstance(value, dict) and value == ABSENT:
        tree.pop(path[-1], None)
    else:
        tree[path[-1]] = value


def show(path: KeyPath) -> str:
    return "checkpoint" + "".join(f"[{key!r}]" for key in path)


@dataclass
class SavedRankStates:
    """What a checkpoint holds for the entries that differed: ``values[rank][i]`` is rank's value of ``paths[i]``."""

    world_size: int
    paths: list[KeyPath]
    values: list[list[Any]]
    broadcast_buffers: bool

    def to_dict(self) -> dict[str, Any]:
        # plain types only: a consolidated checkpoint must load without this package
        return {
            "world_size": self.world_size,
            "paths": [list(p) for p in self.paths],
            "values": self.values,
            "broadcast_buffers": self.broadcast_buffers,
        }

    @staticmethod
    def from_dict(d: dict[str, Any]) -> SavedRankStates:
        return SavedRankStates(d["world_size"], [tuple(p) for p in d["paths"]], d["values"], d["broadcast_buffers"])


@dataclass
class Owners:
    """Who may reshard which entry (see the module docstring), and which loop is being restored."""

    module: Any
    datamodule: Any = None
    callbacks: dict[str, Any] = field(default_factory=dict)
    fn: str = "fit"

    @staticmethod
    def of(trainer: Any) -> Owners:
        return Owners(
            trainer.lightning_module,
            trainer.datamodule,
            {cb.state_key: cb for cb in trainer.callbacks},
            str(trainer.state.fn.value),
        )

    def owner(self, path: KeyPath) -> tuple[Any, KeyPath]:
        if path[0] == "callbacks" and len(path) > 1 and path[1] in self.callbacks:
            return self.callbacks[path[1]], path[2:]
        if self.datamodule is not None and path[0] == type(self.datamodule).__qualname__:
            return self.datamodule, path[1:]
        if self.datamodule is not None and path[0] == "loops":
            return self.datamodule, path
        return self.module, path

    def restores(self, path: KeyPath) -> bool:
        return not (path[0] == "loops" and len(path) > 1 and path[1] != f"{self.fn}_loop")


def restore(checkpoint: dict, saved: SavedRankStates, world_size: int, rank: int, owners: Owners, source: str) -> None:
    """Put this rank's values of the per-rank entries into ``checkpoint`` (rank 0's dict), or raise."""
    if saved.world_size == world_size:
        for path, value in zip(saved.paths, saved.values[rank]):
            put(checkpoint, path, value)
        return
    refused = []
    for i, path in enumerate(saved.paths):
        states = [saved.values[r][i] for r in range(saved.world_size)]
        owner, below = owners.owner(path)
        hook = getattr(owner, "reshard_rank_state", None)
        if path[0] == ERROR_FEEDBACK:  # laid out like the shards of the saving world: restarts at zero
            put(checkpoint, path, None)
        elif not owners.restores(path):
            put(checkpoint, path, states[0])
        elif callable(hook):
            put(checkpoint, path, hook(below, states, world_size, rank))
        elif path[0] == "state_dict" and saved.broadcast_buffers:
            put(checkpoint, path, states[0])
        else:
            refused.append(f"{show(path)} (owner: {type(owner).__name__})")
    if refused:
        raise ValueError(
            f"{source} was saved on {saved.world_size} ranks with state that differs between ranks and cannot be"
            f" resharded to {world_size} ranks: {'; '.join(refused)}. HINT: resume on {saved.world_size} ranks; or make"
            " that state the same on every rank (e.g. log a monitored metric with sync_dist=True); or define"
            " reshard_rank_state(self, path, states, world_size, rank) on its owner to map the saved ranks' values"
            " to this rank's."
        )
