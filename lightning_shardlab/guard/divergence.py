"""Silent divergence: what must be identical on every rank, compared by digest every K steps.

Each rank trains the same model on different data; every loss curve can look fine while one rank's copy
of some replicated state has drifted. What must be identical between steps:

- buffers, except the running statistics of normalisation layers (BatchNorm's running mean and variance):
  each rank updates those from its own batch, and ``broadcast_buffers`` overwrites them with rank 0's
  before the next step (DDP's rule);
- the full buffer of every flat parameter a rank holds in full between steps (stages 1-2: ``fp.full``;
  stage 3 holds no parameter in full between steps, only its own shard);
- each optimizer's hyperparameters and step counters, per param group (a learning-rate schedule stepped on
  one rank only, a ``lr`` edited on one rank);
- with hybrid sharding (comm/mesh.py), every master shard among the ranks holding the same shard in each
  shard group (its replica group): the groups are replicas, so a shard that differs across them is a
  divergence, named with the rank, the parameter and the element.

``replicated_digests`` hashes each of these to 16 bytes on the device (``tensor_digest``: bit patterns, so one ulp
counts); the guard all-gathers them with the batch's digest (``batch_digest``) in one collective
(device_check.py) and ``judge_replicated`` compares them and, only when they differ, exchanges the first differing
entry to name the rank, the tensor and the element. The batch's digest is the data check's question; its verdict
is duplicate_data.py's, which reads each rank's sampler (data_source.py).
"""

from __future__ import annotations

import fnmatch
import functools
import hashlib
import json
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils import _pytree as pytree

from lightning_shardlab.comm import collectives
from lightning_shardlab.comm.host_reads import to_device, to_host
from lightning_shardlab.comm.mismatch import SanityError
from lightning_shardlab.sharding.sharded_model import ShardedModel

_COLUMNS = 64  # tensor_digest's row length, in 8-byte words
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class DivergenceError(SanityError):
    """State that must be identical on every rank differs."""


class DuplicateDataError(SanityError):
    """Several ranks received the same batch."""


@dataclass
class Replicated:
    """One thing every rank must hold identically."""

    name: str  # e.g. "buffer blocks.0.mask", "flat parameter blocks.0[float32]", "optimizer 0 group 1"
    value: Tensor | dict
    flat_param: Any = None  # the FlatParam whose full buffer (or master shard) this is, to name an element
    offset: int = 0  # where ``value`` starts in the flat parameter (a shard's start)
    among_replicas: bool = False  # compared only among the ranks of each replica group (a master shard)


def _words(t: Tensor) -> tuple[Tensor, Tensor]:
    """``t``'s bytes as 8-byte integers (1-D int64), and the last bytes that do not fill a word (1-D int64)."""
    raw = t.detach().reshape(-1).contiguous().view(torch.uint8)
    whole = raw.numel() // 8 * 8
    try:
        words = raw[:whole].view(torch.int64)
    except RuntimeError:  # a view that does not start on an 8-byte boundary
        words = raw[:whole].clone().view(torch.int64)
    return words, raw[whole:].to(torch.int64)


def tensor_digest(t: Tensor) -> Tensor:
    """16 bytes (1-D int64, numel 2) of ``t``'s bit patterns, wrapping mod 2^64.

    The bytes are read as 8-byte words laid out in rows of 64: the first number is the sum of all words
    (any single change, down to one ulp, changes it); the second weighs each row's sum and each column's
    sum by distinct odd weights, so moving a value to another row or column changes it. Two passes of
    native int64 sums: a few ms per million fp32 parameters on one CPU thread.
    """
    words, tail = _words(t)
    rows = words.numel() // _COLUMNS
    grid = words[: rows * _COLUMNS].view(rows, _COLUMNS)  # (rows, 64)
    rest = torch.cat([words[rows * _COLUMNS :], tail])  # fewer than 72 values
    arange = functools.partial(torch.arange, dtype=torch.int64, device=t.device)
    row_sums = grid.sum(dim=1)  # (rows,)
    row_weight = 2 * arange(rows) + 1
    column_weight = (2 * arange(_COLUMNS) + 1) * (2 * rows + 1)  # past every row weight: no two cells alike
    rest_weight = (2 * _COLUMNS + 1) * (2 * rows + 1) + 2 * arange(rest.numel()) + 1
    total = row_sums.sum() + rest.sum()
    weighted = (row_sums * row_weight).sum() + (grid.sum(dim=0) * column_weight).sum() + (rest * rest_weight).sum()
    return torch.stack([total, weighted])


def value_digest(value: Any) -> Tensor:
    """16 bytes of a JSON-able value (optimizer hyperparameters and counters). 1-D int64, numel 2."""
    raw = hashlib.blake2b(json.dumps(value, sort_keys=True, default=repr).encode(), digest_size=16).digest()
    return torch.tensor(
        [int.from_bytes(raw[:8], "little", signed=True), int.from_bytes(raw[8:], "little", signed=True)]
    )


def local_statistics(module: nn.Module) -> set[str]:
    """Buffers each rank updates from its own batch: the running statistics of normalisation layers."""
    names = set()
    for path, m in module.named_modules():
        if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats:
            names.update(f"{path}.{b}" if path else b for b in ("running_mean", "running_var", "num_batches_tracked"))
    return names


def optimizer_group_state(optimizer: Optimizer, group: dict) -> dict:
    """A param group's hyperparameters (lr, betas, weight decay, ...) and its distinct step counters."""
    hyper = {
        k: (to_host(v, "sanity hyperparameters").item() if isinstance(v, Tensor) and v.numel() == 1 else v)
        for k, v in group.items()
        if k != "params"
    }
    steps = {float(optimizer.state[p]["step"]) for p in group["params"] if "step" in optimizer.state.get(p, {})}
    return {"hyperparameters": hyper, "steps": sorted(steps)}


def replicated_state(
    sharded: ShardedModel, optimizers: list[Optimizer] = (), skip: tuple[str, ...] = ()
) -> list[Replicated]:
    """Everything of this rank that must equal every other rank's, in the same order on every rank."""
    ignored = local_statistics(sharded.module)
    out = [
        Replicated(f"buffer {name}", buf)
        for name, buf in sharded.module.named_buffers()
        if name not in ignored and not any(fnmatch.fnmatch(name, pattern) for pattern in skip)
    ]
    for unit in sharded.units:
        unit.wait_gathers()  # the refresh after an optimizer step may still be writing into the full buffers
    for fp in sharded.flat_params:
        if fp.resident_full:
            out.append(Replicated(f"flat parameter {fp.layout.name}", fp.full, fp))
    if sharded.mesh.hybrid:
        for fp in sharded.flat_params:
            out.append(Replicated(f"the master shard of {fp.layout.name}", fp.master, fp, among_replicas=True))
    for i, optimizer in enumerate(optimizers):
        for j, group in enumerate(optimizer.param_groups):
            out.append(
                Replicated(
                    f"optimizer {i} ({type(optimizer).__name__}) param group {j}",
                    optimizer_group_state(optimizer, group),
                )
            )
    return out


def replicated_digests(entries: list[Replicated], device: torch.device) -> Tensor:
    """The entries' digests on ``device``, each made where its value lives (a host value's digest, such as an
    offloaded master's or a hyperparameter's, goes up without a wait): (entries, 2)."""
    return torch.stack(
        [
            to_device(tensor_digest(e.value) if isinstance(e.value, Tensor) else value_digest(e.value), device)
            for e in entries
        ]
    ).to(device)


def judge_replicated(sharded: ShardedModel, entries: list[Replicated], digests: Tensor, when: str = "") -> None:
    """Collective when a digest differs (every rank holds the same ``digests``, (world, entries, 2), on the host):
    raise ``DivergenceError`` on every rank, naming the rank and the tensor; nothing when all agree."""
    peers = sharded.mesh.replica.partition or ((),)  # replica group s holds shard s
    for i, entry in enumerate(entries):
        for s, ranks in enumerate(peers) if entry.among_replicas else [(None, tuple(range(sharded.comm.world_size)))]:
            rows = digests[list(ranks), i]  # (ranks, 2)
            if bool((rows != rows[0]).any()):
                if s is not None:  # named as that shard, wherever this rank's own shard is
                    layout = entry.flat_param.layout
                    entry = replace(entry, name=f"master shard {s} of {layout.name}", offset=layout.shard_range(s)[0])
                _name_divergence(sharded, entry, ranks, rows, when)


def _name_divergence(sharded: ShardedModel, entry: Replicated, ranks: tuple[int, ...], rows: Tensor, when: str) -> None:
    """Collective (every rank reaches it: the digests are the same everywhere): exchange the differing entry
    and raise ``DivergenceError`` naming the odd rank(s) among ``ranks``, the entry and the first element."""
    comm = sharded.comm
    value = to_host(entry.value.detach(), "sanity divergence") if isinstance(entry.value, Tensor) else entry.value
    everyone = collectives.all_gather_object(value, comm, label="sanity replicated state")
    odd, reference = odd_ranks([tuple(d.tolist()) for d in rows])
    among = ranks if entry.among_replicas else None
    message = divergence_message(comm.rank, entry, [everyone[r] for r in ranks], odd, reference, when, among)
    raise DivergenceError(message)


def odd_ranks(keys: list[Any]) -> tuple[list[int], int]:
    """Ranks whose key differs from the majority's (ties: rank 0's group), and a rank of the majority."""
    groups: dict[Any, list[int]] = {}
    for rank, key in enumerate(keys):
        groups.setdefault(key, []).append(rank)
    majority = max(groups, key=lambda k: (len(groups[k]), -min(groups[k])))
    return [r for r, k in enumerate(keys) if k != majority], groups[majority][0]


def divergence_message(
    rank: int,
    entry: Replicated,
    values: list[Any],
    odd: list[int],
    reference: int,
    when: str,
    ranks: tuple[int, ...] | None = None,
) -> str:
    """``values``, ``odd`` and ``reference`` index ``ranks`` (the world ranks compared; None: every rank)."""
    world = (lambda i: i) if ranks is None else ranks.__getitem__  # noqa: E731
    where = f" ({when})" if when else ""
    among = "" if ranks is None else f" (among ranks {', '.join(map(str, ranks))}, which hold the same shard)"
    odd_ranks = ", ".join(str(world(i)) for i in odd)
    head = (
        f"[rank {rank}] silent divergence{where}: {entry.name} on rank {odd_ranks} differs from rank"
        f" {world(reference)}{among}"
    )
    if isinstance(entry.value, Tensor):
        detail, hint = (
            _tensor_difference(values[reference], values[odd[0]], world(odd[0]), world(reference), entry),
            (
                "code that changes parameters or buffers on some ranks only (e.g. under `if trainer.is_global_zero`),"
                " a rank-dependent initialisation after sharding, or a nondeterministic in-place update"
            ),
        )
    else:
        detail, hint = (
            _dict_difference(values[reference], values[odd[0]], world(odd[0]), world(reference)),
            (
                "a learning-rate scheduler or callback that runs on some ranks only, or an optimizer stepped on some"
                " ranks only"
            ),
        )
    return f"{head}: {detail}. HINT: every rank must make the same change; look for {hint}."


def _tensor_difference(ref: Tensor, other: Tensor, rank: int, reference: int, entry: Replicated) -> str:
    a, b = ref.reshape(-1), other.reshape(-1)
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"shape/dtype {tuple(ref.shape)} {ref.dtype} on rank {reference} but {tuple(other.shape)} {other.dtype}"
    diff = (a.view(_BITS[a.element_size()]) != b.view(_BITS[b.element_size()])) if a.element_size() in _BITS else a != b
    idx = diff.nonzero()
    if not idx.numel():  # a GPU's verdict is read a step after its digests (device_check.py)
        return "its digests differed at the check; its values agree again now (overwritten since, by every rank)"
    first = int(idx[0])
    where = _element_name(entry, first + entry.offset, ref.shape)
    return (
        f"{idx.numel()} element(s) differ; first {where}: {a[first].item()!r} on rank {reference},"
        f" {b[first].item()!r} on rank {rank}"
    )


def _element_name(entry: Replicated, index: int, shape: torch.Size) -> str:
    fp = entry.flat_param
    if fp is None:
        return f"at index {tuple(int(i) for i in torch.unravel_index(torch.tensor(index), shape))}"
    for slot in fp.layout.slots:
        if slot.offset <= index < slot.offset + slot.numel:
            at = tuple(int(i) for i in torch.unravel_index(torch.tensor(index - slot.offset), slot.shape))
            return f"in parameter {slot.name!r} at index {at}"
    return f"in the padding at offset {index}"


def _dict_difference(ref: dict, other: dict, rank: int, reference: int) -> str:
    diffs = []
    for part in ("hyperparameters", "steps"):
        a, b = ref[part], other[part]
        if part == "steps":
            if a != b:
                diffs.append(f"step counters {a} on rank {reference}, {b} on rank {rank}")
            continue
        diffs += [
            f"{k}={a.get(k)!r} on rank {reference}, {b.get(k)!r} on rank {rank}"
            for k in sorted(set(a) | set(b), key=str)
            if a.get(k) != b.get(k)
        ]
    return "; ".join(diffs)


def batch_digest(batch: Any, device: torch.device) -> Tensor:
    """16 bytes of a batch (any nesting of tensors and plain values), made on ``device``: the digest of its
    leaves' digests (a plain value's goes up without a wait). 1-D int64, numel 2."""
    leaves = pytree.tree_leaves(batch)
    parts = [to_device(tensor_digest(x), device) for x in leaves if isinstance(x, Tensor)]
    values = [repr(x) for x in leaves if not isinstance(x, Tensor)]
    parts.append(to_device(value_digest(values), device))
    return tensor_digest(torch.stack(parts))
