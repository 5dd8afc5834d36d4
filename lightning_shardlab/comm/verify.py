"""Collectives that verify themselves: each call's fingerprint travels with it and is checked on arrival.

A fingerprint (comm/mismatch.py) is turned into a *header*: ``HEADER`` int64 — sequence number, kind, label,
numel, dtype (strings as 63-bit codes), the payload's byte count (not compared: objects differ in size)
and the label's first ``LABEL_BYTES`` bytes, so that every rank can name a call only another rank made.
Every rank checks every other rank's header against its own; when they differ, every
rank holds the same table and raises the same ``CollectiveMismatch``, naming what each rank issued and,
through ``explain``, which unit ran where and the fix. Two ways to carry the headers:

- on gloo (CPU ranks, ranks sharing a GPU): comm/wire.py sends each call as a pairwise exchange in which a
  header message precedes the payload each way, on one tag. It costs no extra round trip: headers travel
  with the payloads and are checked when they arrive, before the payload is used.
- with ``transport="builtin"`` on gloo: ``HeaderExchange`` all-gathers the header on a gloo group of its own
  before the call is launched (a round trip per call, the host blocked for it: gloo would abort the process on
  a payload of another size, so nothing may be posted before the headers agree).
- on NCCL: the header's all-gather is launched on the group's gloo twin (comm/host_side.py) beside the call,
  without waiting, and checked when the call is waited for, before its data is used (``Launched.first`` and
  ``check``, as on the wire). The hosts are not held in step by a round trip per collective: the headers
  travel while the device works. A mismatch still raises on every rank, naming the first differing call; a
  call of another size that hangs the device meanwhile is the watchdog's to name (guard/watchdog.py).

[Note: why the payload's own buffers are not trusted]
A tag inside the payload (one extra element per shard) cannot do it alone: when two ranks' calls differ
in size, gloo terminates the process the moment a rank receives more bytes than it posted a buffer for
(``op.preamble.length <= op.nbytes``, a C++ abort that names no unit) and, the other way round, fills
part of the larger buffer and reports success. So comm/wire.py posts every receive with room for the
largest payload any call can send (``Wire.limit``: the largest shard of any flat parameter), reads the
header first, and uses the payload only if the headers agree; larger payloads (rare: objects, big
buffers) wait for the headers before their receives are posted. ``verify_collectives=False`` turns all
of this off (the cheap check every K steps and the watchdog remain).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_shardlab.comm.labels import phase
from lightning_shardlab.comm.mismatch import GENERIC_HINT, CollectiveMismatch, Fingerprint, by_call, mismatch_message

if TYPE_CHECKING:
    from lightning_shardlab.comm.call import CollectiveCall
    from lightning_shardlab.comm.ledger import Ledger

LABEL_BYTES = 48
HEADER = 6 + LABEL_BYTES // 8  # int64: seq, kind, label, numel, dtype (compared); payload bytes, label text (not)
COMPARED = 5
PAYLOAD = 5  # the index of the payload byte count
KINDS = (
    "all_gather",
    "reduce_scatter",
    "all_reduce",
    "all_to_all",
    "broadcast",
    "all_gather_object",
    "barrier",
    "broadcast_object",
    "sanity",
    "vitals",
    "budget",
)
DTYPES = (
    "object",
    *(
        str(d).removeprefix("torch.")
        for d in (
            torch.float32,
            torch.float64,
            torch.float16,
            torch.bfloat16,
            torch.int8,
            torch.uint8,
            torch.int16,
            torch.int32,
            torch.int64,
            torch.bool,
            torch.complex64,
            torch.complex128,
        )
    ),
)

Explain = Callable[[dict[int, Fingerprint]], "str | None"]  # every rank's fingerprint -> a hint, or None


def code(text: str) -> int:
    """A string as a non-negative 63-bit integer, the same in every process."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


class Headers:
    """Fingerprints as headers and back, and the check of every rank's header against this rank's."""

    def __init__(self, rank: int, world_size: int, ranks: tuple[int, ...] | None = None) -> None:
        self.rank, self.world_size = rank, world_size
        self.ranks = ranks  # the world rank of each rank of this group (None: this group is the world)
        self.names: dict[int, str] = {}  # code -> string, for decoding other ranks' headers
        self._codes: dict[str, int] = {}
        self.explain: Explain | None = None  # set by whoever knows what the labels mean (the sharded model)
        self.know(*KINDS, *DTYPES)

    def know(self, *texts: str) -> None:
        """Make these labels decodable in other ranks' headers (the sharded model registers every unit's)."""
        for text in texts:
            self._code(text)

    def _code(self, text: str) -> int:
        value = self._codes.get(text)
        if value is None:
            value = self._codes[text] = code(text)
            self.names[value] = text
        return value

    def encode(self, call: CollectiveCall, payload_bytes: int) -> Tensor:
        """This rank's header for ``call``: 1-D int64, numel HEADER."""
        fields = (
            call.seq,
            self._code(call.kind),
            self._code(call.label),
            call.numel,
            self._code(call.dtype),
            payload_bytes,
        )
        text = call.label.encode()[:LABEL_BYTES].ljust(LABEL_BYTES, b"\0")
        return torch.cat(
            [torch.tensor(fields, dtype=torch.int64), torch.frombuffer(bytearray(text), dtype=torch.int64)]
        )

    def check(self, headers: dict[int, Tensor]) -> None:
        """``headers``: rank -> its header (this rank's included). Raise on every rank unless all agree."""
        mine = headers[self.rank][:COMPARED].tolist()
        if all(h[:COMPARED].tolist() == mine for h in headers.values()):
            return
        world = (lambda r: r) if self.ranks is None else self.ranks.__getitem__  # noqa: E731  (ranks as users know them)
        each = {world(r): self._decode(h) for r, h in sorted(headers.items())}
        seq = by_call(each)[0][0][0]
        hint = (self.explain(each) if self.explain is not None else None) or GENERIC_HINT
        raise CollectiveMismatch(mismatch_message(world(self.rank), seq, each, "verified before it ran", hint))

    def _decode(self, header: Tensor) -> Fingerprint:
        """The fingerprint a header stands for, read the same way on every rank (the label from its text)."""
        seq, kind, _, numel, dtype = header[:COMPARED].tolist()
        text = header[6:].numpy().tobytes()
        label = text.rstrip(b"\0").decode(errors="replace") + ("..." if text[-1:] != b"\0" else "")
        name = self.names.get
        return (seq, name(kind, f"<kind {kind:x}>"), label, numel, name(dtype, "?"))


class HeaderExchange:
    """The header of every call all-gathered on a gloo group beside the call's own: before the call is launched
    (``transport="builtin"`` on gloo: ``check``), or launched beside it and checked when it is waited for
    (``deferred``, NCCL: ``launch``). One small message each way per call."""

    def __init__(self, group: Any, headers: Headers, deferred: bool = False) -> None:
        self.group, self.headers, self.deferred = group, headers, deferred

    @staticmethod
    def open(
        headers: Headers,
        partition: tuple[tuple[int, ...], ...] | None = None,
        twin: Any = None,
        deferred: bool = False,
    ) -> HeaderExchange:
        """On ``twin``, an NCCL group's gloo twin (comm/host_side.py); else collective (every rank, same point): a
        gloo group for the world, or for each group of ``partition`` (the groups of one kind of a mesh,
        comm/mesh.py), this rank's. ``deferred``: headers checked when the call is waited for (NCCL)."""
        if twin is None and partition is None:
            twin = dist.new_group(backend="gloo")
        elif twin is None:
            twin, _ = dist.new_subgroups_by_enumeration([list(p) for p in partition], backend="gloo")
        return HeaderExchange(twin, headers, deferred)

    def _rows(self, everyone: Tensor) -> dict[int, Tensor]:
        rows = everyone.view(self.headers.world_size, HEADER)
        return {r: rows[r] for r in range(self.headers.world_size)}

    def check(self, call: CollectiveCall, ledger: Ledger, scope: str = "world") -> None:
        """Exchange ``call``'s header and check every rank's, the host blocked meanwhile (raises on a mismatch)."""
        started = time.perf_counter()
        everyone = self._record(ledger, scope)
        with phase("verify", call.label):
            dist.all_gather_into_tensor(everyone, self.headers.encode(call, 0), group=self.group)
        ledger.record_seconds("verify", "", time.perf_counter() - started, scope)
        self.headers.check(self._rows(everyone))

    def launch(self, call: CollectiveCall, ledger: Ledger, scope: str = "world") -> tuple[Any, Callable[[], None]]:
        """Launch the exchange of ``call``'s header without waiting: (its work, the check to run once it is done)."""
        everyone = self._record(ledger, scope)
        work = dist.all_gather_into_tensor(everyone, self.headers.encode(call, 0), group=self.group, async_op=True)
        return work, lambda: self.headers.check(self._rows(everyone))

    def _record(self, ledger: Ledger, scope: str) -> Tensor:
        everyone = torch.empty(self.headers.world_size * HEADER, dtype=torch.int64)  # 1-D, world * HEADER
        ledger.record_launch("verify", "", everyone.numel() * everyone.element_size(), scope)
        return everyone
