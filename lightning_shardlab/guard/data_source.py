"""Where a rank's training batches come from, as far as its DataLoader tells: the data check's judge.

Equal bytes on two ranks raise the question whether they read the same samples; they do not answer it. A dataset
whose samples are equal (a constant input, toy data, a repeated sample) gives every rank the same bytes while
Lightning's ``DistributedSampler`` hands each rank its own indices, and DDP trains it. What answers the question is
the sampler, read from the loader before each check:

    SPLIT       a ``DistributedSampler`` (Lightning's, its ``DistributedSamplerWrapper``, or one in a batch sampler).
                Its draws are a function of (dataset length, seed, shuffle, drop_last, epoch, batch size) and of
                (num_replicas, rank): rank r takes positions r, r + num_replicas, ... of one order. Two ranks with
                the same order and num_replicas draw the same indices when their ``rank`` is the same, disjoint
                ones when it differs.
    WHOLE       a map-style dataset read by torch's own samplers that do not split it (sequential, random,
                weighted): every rank draws from all of the data, the classic missing-sampler bug.
    OPAQUE      an ``IterableDataset``, or a batch sampler whose sampler cannot be seen: what each rank reads
                cannot be known from outside.
    BYTES_ONLY  no loader was given (a plain loop that passes batches only): the bytes are all there is.

Two ranks with equal batches and ``comparable`` sources drew the same samples when their ``draws`` agree, other
samples when they do not (the data merely repeats); otherwise the guard cannot tell, warns once, and training goes
on, as under DDP (guard/duplicate_data.py). A source travels as four int64 in the
check's one all-gather (``rows``); the words that name it (``text``) are exchanged only when a verdict names them.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as pytree
from torch.utils.data import (
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    WeightedRandomSampler,
)

WHOLE_SAMPLERS = (SequentialSampler, RandomSampler, WeightedRandomSampler)  # torch's own: none splits the data


class Source(IntEnum):
    BYTES_ONLY = 0
    SPLIT = 1
    WHOLE = 2
    OPAQUE = 3


@dataclass(frozen=True)
class DataSource:
    """One rank's source of training batches. ``order`` digests what fixes the order of its draws; ``split`` and
    ``rank`` digest its samplers' ``num_replicas`` and ``rank`` (SPLIT only); ``text`` names it in messages."""

    kind: Source
    order: int = 0
    split: int = 0
    rank: int = 0
    text: str = "no DataLoader given to the guard (its batches only)"

    @property
    def comparable(self) -> tuple | None:
        """Ranks whose sources share this key can be judged against each other by ``draws``; None: this one cannot
        be judged (OPAQUE)."""
        return None if self.kind == Source.OPAQUE else (int(self.kind), self.order, self.split)

    @property
    def draws(self) -> tuple | None:
        """Among comparable sources, equal keys draw the same samples. SPLIT: the same positions of one order
        exactly when the sampler's rank is the same; WHOLE: neither splits the data (the missing-sampler bug itself,
        whatever the order); BYTES_ONLY: nothing else to go by, equal bytes are taken for the same samples."""
        comparable = self.comparable
        return None if comparable is None else (*comparable, self.rank if self.kind == Source.SPLIT else 0)

    def rows(self) -> Tensor:
        """(2, 2) int64 on the host: [kind, order], [split, rank]."""
        return torch.tensor([[int(self.kind), self.order], [self.split, self.rank]], dtype=torch.int64)

    @staticmethod
    def from_rows(rows: Tensor) -> DataSource:
        """A rank's source from its gathered (2, 2) rows (its ``text`` stays on its own rank)."""
        (kind, order), (split, rank) = rows.tolist()
        return DataSource(Source(kind), order, split, rank, text="")


def _digest(value: Any) -> int:
    """A 63-bit digest of a plain value's repr: the same on every rank for the same value."""
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(), "little") >> 1


def _length(dataset: Any) -> int | None:
    try:
        return len(dataset)
    except TypeError:  # a map-style dataset without __len__
        return None


@dataclass(frozen=True)
class _Loader:
    """What one DataLoader says: its kind, the order of its draws, its split (num_replicas, rank), its words."""

    kind: Source
    order: tuple
    split: tuple = ()
    text: str = ""


def _read_loader(loader: Any) -> _Loader:
    """Read a DataLoader (or Fabric's wrapper of one, which copies its attributes) without drawing from it:
    iterating a sampler may consume a random generator, so only attributes are read."""
    dataset = getattr(loader, "dataset", None)
    if dataset is None:
        return _Loader(Source.OPAQUE, (), text=f"a {type(loader).__name__} with no dataset to read")
    if isinstance(dataset, IterableDataset):
        return _Loader(Source.OPAQUE, (), text=f"an IterableDataset ({type(dataset).__name__})")
    batch_sampler = getattr(loader, "batch_sampler", None)
    batch_size = getattr(batch_sampler, "batch_size", getattr(loader, "batch_size", None))
    sampler = getattr(batch_sampler, "sampler", None) if batch_sampler is not None else getattr(loader, "sampler", None)
    if isinstance(sampler, DistributedSampler):
        inner = getattr(sampler.dataset, "_sampler", None)  # Lightning's DistributedSamplerWrapper: the user's sampler
        order = (
            type(sampler).__name__,
            type(inner).__name__,
            _length(sampler.dataset),
            sampler.shuffle,
            sampler.seed,
            sampler.drop_last,
            sampler.epoch,
            batch_size,
        )
        text = (
            f"{type(sampler).__name__}(num_replicas={sampler.num_replicas}, rank={sampler.rank},"
            f" shuffle={sampler.shuffle}, seed={sampler.seed})"
        )
        return _Loader(Source.SPLIT, order, (sampler.num_replicas, sampler.rank), text)
    if type(sampler) in WHOLE_SAMPLERS:
        order = (type(sampler).__name__, _length(dataset), batch_size, getattr(sampler, "num_samples", None))
        text = f"a {type(sampler).__name__} over all {_length(dataset)} samples (no DistributedSampler)"
        return _Loader(Source.WHOLE, order, text=text)
    what = type(batch_sampler if sampler is None else sampler).__name__
    return _Loader(Source.OPAQUE, (), text=f"a {what}, whose indices the guard cannot read")


def describe(loaders: Any) -> DataSource:
    """This rank's source from the loader(s) its batches come from (a DataLoader, or any nesting of them, as
    ``trainer.train_dataloader`` returns); None: BYTES_ONLY. Several loaders: the least certain kind decides,
    and their orders and splits are digested together."""
    if loaders is None:
        return DataSource(Source.BYTES_ONLY)
    read = [_read_loader(loader) for loader in pytree.tree_leaves(loaders)]
    if not read:
        return DataSource(Source.BYTES_ONLY)
    kind = max(r.kind for r in read)
    text = "; ".join(r.text for r in read)
    if kind == Source.OPAQUE:
        return DataSource(kind, text=text)
    if kind == Source.WHOLE:
        return DataSource(kind, _digest([r.order for r in read]), text=text)
    splits = [r.split for r in read]
    order = _digest([r.order for r in read])
    return DataSource(kind, order, _digest([n for n, _ in splits]), _digest([rank for _, rank in splits]), text)
