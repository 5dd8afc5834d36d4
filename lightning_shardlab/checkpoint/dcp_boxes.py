"""A rank's elements of a parameter, ``[a, b)`` in row-major order, as the boxes torch's Distributed Checkpoint
(DCP) addresses. Pure: nothing here reads, writes or communicates.

A flat parameter's shard is a run of elements in flat coordinates, so a rank holds of each parameter a run
``[a, b)`` of its row-major elements: the tail of one row, whole rows, the head of another. DCP stores and reads
*chunks*: boxes given by ``offsets`` and ``sizes`` per dimension (``ChunkStorageMetadata``). Every run is a few
such boxes, each of them contiguous in row-major order (fixed leading indices, a range in one dimension, every
later dimension whole), so a box is a plain view of the rank's 1-D slice. At most ``2 * ndim - 1`` boxes for a
run; one for a run of whole rows. Saving writes each box as a chunk of its own (checkpoint/dcp_save.py); loading
asks DCP's planner for the same boxes, so it reads only the saved chunks that overlap them (dcp_load.py).
"""

from __future__ import annotations

import math
from typing import NamedTuple


class Box(NamedTuple):
    """``offsets`` and ``sizes`` per dimension, and ``start``: the row-major index of its first element."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    start: int

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


def run_boxes(shape: tuple[int, ...], a: int, b: int) -> list[Box]:
    """The boxes covering the row-major elements ``[a, b)`` of a tensor of ``shape``, in order."""
    if not 0 <= a <= b <= math.prod(shape):
        raise ValueError(f"elements [{a}, {b}) are not inside a tensor of shape {tuple(shape)}.")
    if a == b:
        return []
    if not shape:  # a 0-d tensor: its one element
        return [Box((), (), 0)]
    inner = math.prod(shape[1:])
    (r0, c0), (r1, c1) = divmod(a, inner), divmod(b, inner)
    if r0 == r1:  # inside one row
        return _in_row(shape, r0, c0, c1)
    boxes = []
    if c0:  # the tail of the first row
        boxes += _in_row(shape, r0, c0, inner)
        r0 += 1
    if r1 > r0:  # whole rows
        boxes.append(Box((r0,) + (0,) * (len(shape) - 1), (r1 - r0, *shape[1:]), r0 * inner))
    if c1:  # the head of the last row
        boxes += _in_row(shape, r1, 0, c1)
    return boxes


def _in_row(shape: tuple[int, ...], row: int, c0: int, c1: int) -> list[Box]:
    """Elements ``[c0, c1)`` of row ``row``: the boxes of that run in the row's own shape, one row high."""
    inner = math.prod(shape[1:])
    return [Box((row, *b.offsets), (1, *b.sizes), row * inner + b.start) for b in run_boxes(tuple(shape[1:]), c0, c1)]
