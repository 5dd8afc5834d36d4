"""The verified pairwise wire (gloo): every collective, between every pair of ranks, is one header message then
one payload message each way, on one tag.

    rank r -> p     header_r (verify.HEADER int64), then r's payload for p
    rank r <- p     header_p into a header buffer, then p's payload into a receive buffer of at least
                    ``limit`` bytes (the largest payload any call may send)

gloo delivers the messages of a pair in the order they were posted, so a header only ever meets a header and a
payload a payload, whatever the two ranks are doing. (Each wire has a tag of its own, so what a failed run
leaves in flight never pairs with the calls of a model sharded after it.) ``Pending.wait`` (collectives.py)
first waits for the headers, checks every rank's against its own (verify.py: a mismatch raises on every rank,
naming the unit), and only then waits for the payloads and uses them. Receive buffers are never smaller than
``limit``, so a payload of another size (from a rank that has parted) cannot make gloo abort the process;
payloads larger than ``limit`` (objects, big buffers) wait for the headers before their receives are posted,
with exact sizes.

Every operation is symmetric (every rank sends one payload to and receives one from every peer), so two ranks
in different operations still exchange the same messages and see each other's headers:

    all_gather       send my shard to each peer; receive theirs straight into the full buffer
    reduce_scatter   send each peer its chunk; receive mine from each; sum in rank order
    all_reduce       send my tensor to each peer; receive theirs; reduce in rank order
    all_to_all       send each peer its part (at least one element); receive mine from each
    broadcast        the source sends its tensor, the others a 1-byte placeholder
    objects, barrier headers first (with the pickled sizes), then exact payloads; a barrier has none

Payloads go straight into their destination where the room after it allows (all-gather), otherwise into a
scratch buffer that is copied from. Reductions are summed in rank order: every rank computes the same bits.
What this costs: two small messages per pair and call, on top of the payloads, and no extra round trip
(benchmarks/SANITY.md).
"""

from __future__ import annotations

import itertools
import pickle
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_shardlab.comm.transport import Launched, global_rank
from lightning_shardlab.comm.verify import HEADER, PAYLOAD, Headers

FIRST_TAG = 100  # each wire's one channel, so messages pair up by order alone; a new wire (a new sharded model on
_tags = itertools.count(
    FIRST_TAG
)  # the same process group) takes the next: what a failed run left in flight never pairs up
MIN_LIMIT = 4 << 10  # bytes: the receive room of small calls (sanity digests, norms, per-rank figures); anything
# larger than the largest shard (objects, big buffers) waits for the headers instead, so the room stays what the
# model needs (the budget counts it in the step's peak, budget/predicted/step_timeline.py)
REDUCE = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum}


# [Note: sends outlive a failed check] A gloo send is carried out once its receiver has posted the matching
# receive; dropping the send's work before then cancels it, and a peer still waiting for that header would
# hang. So whatever a rank had in flight when a check failed is kept here, for the life of the process.
KEPT_AFTER_FAILURE: list[Any] = []


def _bytes(t: Tensor) -> Tensor:
    return t.reshape(-1).view(torch.uint8)


class Wire:
    """Verified collectives for one process group (see the module docstring)."""

    def __init__(self, group: Any, rank: int, world_size: int, headers: Headers, limit: int = MIN_LIMIT) -> None:
        self.group, self.rank, self.world_size, self.headers = group, rank, world_size, headers
        self.limit = limit  # bytes of receive room; every rank must use the same value
        self.peers = [p for p in range(world_size) if p != rank]
        self.tag = next(_tags)  # every rank makes its wires in the same order, so the tags agree

    # ---- the protocol ----

    def _exchange(self, call: Any, sends: dict[int, Tensor], recvs: dict[int, Tensor], finish: Any = None) -> Launched:
        """Post the headers, then the payloads (``recvs``: at least ``limit`` bytes each); checked on arrival."""
        nbytes = max((t.numel() * t.element_size() for t in sends.values()), default=0)
        heads, works = self._post_headers(call, nbytes)
        first = works[1::2]  # the header receives
        rest = works[0::2]
        if nbytes > self.limit:  # a receive might be smaller than what a parted rank sends: headers first
            self._wait_headers(first, heads, rest)
            return Launched(rest + self._post_payloads(sends, recvs), finish)
        return Launched(rest + self._post_payloads(sends, recvs), finish, first, lambda: self._check(heads))

    def _post_headers(self, call: Any, payload_bytes: int) -> tuple[dict[int, Tensor], list[Any]]:
        mine = self.headers.encode(call, payload_bytes)
        heads = {self.rank: mine, **{p: torch.empty(HEADER, dtype=torch.int64) for p in self.peers}}
        works = []
        for p in self.peers:
            works.append(dist.isend(mine, global_rank(self.group, p), self.group, self.tag))
            works.append(dist.irecv(heads[p], global_rank(self.group, p), self.group, self.tag))
        return heads, works

    def _post_payloads(self, sends: dict[int, Tensor], recvs: dict[int, Tensor]) -> list[Any]:
        works = []
        for p in self.peers:
            works.append(dist.isend(sends[p], global_rank(self.group, p), self.group, self.tag))
            works.append(dist.irecv(recvs[p], global_rank(self.group, p), self.group, self.tag))
        return works

    def _check(self, heads: dict[int, Tensor]) -> None:
        self.headers.check(heads)

    def _wait_headers(self, first: list[Any], heads: dict[int, Tensor], rest: list[Any]) -> None:
        for work in first:
            work.wait()
        try:
            self._check(heads)
        except Exception:
            KEPT_AFTER_FAILURE.append((rest, heads))  # see the note above
            raise

    def receive_room(self, kind: str, payload: int) -> int:
        """Bytes of receive room this rank allocates for one call of ``kind`` ("all_gather" or "reduce_scatter")
        sending ``payload`` bytes to each peer, live from its launch until it is waited: a reduce-scatter's room
        for each peer; an all-gather's scratch room for each peer whose chunk lies too close to the end of the full
        buffer for a room of ``limit`` bytes (the others land in place). The budget's step timeline counts them
        (budget/predicted/step_timeline.py)."""
        room = max(payload, self.limit)
        if kind == "reduce_scatter":
            return len(self.peers) * room
        whole = payload * self.world_size
        return sum(room for p in self.peers if p * payload + room > whole)

    def _room(self, nbytes: int) -> Tensor:
        """A receive buffer with room for any payload of at most ``limit`` bytes."""
        return torch.empty(max(nbytes, self.limit), dtype=torch.uint8)

    # ---- the operations ----

    def all_gather(self, call: Any, out: Tensor, inp: Tensor) -> Launched:
        """``out`` (1-D, world * S) gets every rank's ``inp`` (1-D, S) in rank order."""
        s = inp.numel() * inp.element_size()
        whole = _bytes(out)
        whole[self.rank * s : (self.rank + 1) * s].copy_(_bytes(inp))
        recvs, copies = {}, []
        room = s if s > self.limit else self.limit  # exact when the headers are checked first
        for p in self.peers:
            start = p * s
            if start + room <= whole.numel():  # straight into place, the room running over the next chunks
                recvs[p] = whole[start : start + room]
            else:  # too close to the end for the room: a scratch buffer, copied after the check
                recvs[p] = self._room(s)
                copies.append((whole[start : start + s], recvs[p][:s]))

        def finish() -> None:
            for dst, src in copies:
                dst.copy_(src)

        return self._exchange(call, dict.fromkeys(self.peers, inp), recvs, finish if copies else None)

    def reduce_scatter_sum(self, call: Any, out: Tensor, inp: Tensor) -> Launched:
        """``out`` (1-D, S) = the sum over ranks of their ``inp[rank*S:(rank+1)*S]``, added in rank order."""
        n = out.numel()
        sends = {p: inp[p * n : (p + 1) * n] for p in self.peers}
        recvs = {p: self._room(n * out.element_size()) for p in self.peers}

        def finish() -> None:
            parts = [
                inp[self.rank * n : (self.rank + 1) * n]
                if p == self.rank
                else recvs[p][: n * out.element_size()].view(out.dtype)
                for p in range(self.world_size)
            ]
            torch.add(parts[0], parts[1], out=out)
            for part in parts[2:]:
                out.add_(part)

        return self._exchange(call, sends, recvs, finish)

    def all_reduce(self, call: Any, tensor: Tensor, op: str) -> Launched:
        """In place: ``tensor`` becomes the reduction over ranks, in rank order."""
        flat = tensor.reshape(-1)  # sent as it is: it changes only in finish, after every send is done
        nbytes = flat.numel() * flat.element_size()
        recvs = {p: self._room(nbytes) for p in self.peers}

        def finish() -> None:
            parts = [flat if p == self.rank else recvs[p][:nbytes].view(flat.dtype) for p in range(self.world_size)]
            result = parts[0].clone()
            for part in parts[1:]:
                REDUCE[op](result, part, out=result)
            flat.copy_(result)

        return self._exchange(call, dict.fromkeys(self.peers, flat), recvs, finish)

    def all_to_all(self, call: Any, outs: list[Tensor], ins: list[Tensor]) -> Launched:
        """``outs[p]`` gets peer p's part for this rank, ``ins[p]`` goes to peer p (parts of any size)."""
        sends = {p: ins[p] if ins[p].numel() else torch.zeros(1, dtype=ins[p].dtype) for p in self.peers}
        recvs = {p: self._room(outs[p].numel() * outs[p].element_size()) for p in self.peers}

        def finish() -> None:
            for p in self.peers:
                _bytes(outs[p]).copy_(recvs[p][: outs[p].numel() * outs[p].element_size()])

        return self._exchange(call, sends, recvs, finish)

    def broadcast(self, call: Any, tensor: Tensor, src: int) -> Launched:
        """In place: every rank's ``tensor`` becomes rank ``src``'s."""
        flat = tensor.reshape(-1)
        nbytes = flat.numel() * flat.element_size()
        placeholder = torch.zeros(1, dtype=torch.uint8)
        sends = dict.fromkeys(self.peers, flat if self.rank == src else placeholder)
        recvs = {p: self._room(nbytes) for p in self.peers}

        def finish() -> None:
            if self.rank != src:
                _bytes(flat).copy_(recvs[src][:nbytes])

        if self.rank == src and nbytes > self.limit:  # the others post exact rooms once the headers agree
            return self._exchange(call, sends, {p: self._room(1) for p in self.peers})
        return self._exchange(call, sends, recvs, finish)

    # ---- objects and barriers: headers first, then exact payloads ----

    def all_gather_object(self, call: Any, obj: Any) -> list[Any]:
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        heads, works = self._post_headers(call, payload.numel())
        self._wait_headers(works[1::2], heads, works[0::2])
        recvs = {p: torch.empty(int(heads[p][PAYLOAD]), dtype=torch.uint8) for p in self.peers}
        for work in works[0::2] + self._post_payloads(dict.fromkeys(self.peers, payload), recvs):
            work.wait()
        return [obj if r == self.rank else pickle.loads(recvs[r].numpy().tobytes()) for r in range(self.world_size)]

    def broadcast_object(self, call: Any, obj: Any, src: int) -> Any:
        payload = torch.frombuffer(bytearray(pickle.dumps(obj) if self.rank == src else b"\0"), dtype=torch.uint8)
        heads, works = self._post_headers(call, payload.numel())
        self._wait_headers(works[1::2], heads, works[0::2])
        recvs = {p: torch.empty(int(heads[p][PAYLOAD]), dtype=torch.uint8) for p in self.peers}
        for work in works[0::2] + self._post_payloads(dict.fromkeys(self.peers, payload), recvs):
            work.wait()
        return obj if self.rank == src else pickle.loads(recvs[src].numpy().tobytes())

    def barrier(self, call: Any) -> None:
        heads, works = self._post_headers(call, 0)
        self._wait_headers(works[1::2], heads, works[0::2])
        for work in works[0::2]:
            work.wait()
