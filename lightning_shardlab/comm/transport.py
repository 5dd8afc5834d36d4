"""How an all-gather or a reduce-scatter is carried out: torch's built-in collective, or a pairwise exchange.

gloo's built-in all-gather and reduce-scatter move data through general algorithms that, for the
message sizes of a unit (1-30 MB) on a few ranks, measured 2-3x slower here than simply exchanging
the chunks directly: every rank sends each peer the chunk that peer needs and receives its own from
each peer (``batch_isend_irecv``; one round; N-1 sends and N-1 receives). comm/transport_probe.py times
both on the sizes the model will move and keeps the faster for each operation; NCCL keeps its own.

Both return a ``Launched``: the works in flight and a step to run once they are done. (With verified
collectives on gloo, comm/wire.py carries every call instead: the pairwise exchange plus a header each way.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass
class Launched:
    """A collective in flight: wait for ``first``, run ``check``, wait for ``works``, then run ``finish``.
    (``first`` and ``check``: the header of a verified call, checked before its payload is used.)"""

    works: list[Any]
    finish: Callable[[], None] | None = None
    first: list[Any] = field(default_factory=list)
    check: Callable[[], None] | None = None


AG_TAG, RS_TAG, A2A_TAG = 11, 12, 13  # separate channels: calls of different kinds in flight never pair up


class Builtin:
    name = "builtin"

    @staticmethod
    def all_gather(out: Tensor, inp: Tensor, group: Any, rank: int, world: int) -> Launched:
        return Launched([dist.all_gather_single(out, inp, group=group, async_op=True)])

    @staticmethod
    def reduce_scatter_sum(out: Tensor, inp: Tensor, group: Any, rank: int, world: int) -> Launched:
        return Launched([dist.reduce_scatter_single(out, inp, op=dist.ReduceOp.SUM, group=group, async_op=True)])


class Pairwise:
    name = "pairwise"

    @staticmethod
    def all_gather(out: Tensor, inp: Tensor, group: Any, rank: int, world: int) -> Launched:
        s = inp.numel()
        out[rank * s : (rank + 1) * s].copy_(inp)
        ops = []
        for peer in range(world):
            if peer != rank:
                ops.append(dist.P2POp(dist.isend, inp, global_rank(group, peer), group, AG_TAG))
                ops.append(
                    dist.P2POp(dist.irecv, out[peer * s : (peer + 1) * s], global_rank(group, peer), group, AG_TAG)
                )
        return Launched(dist.batch_isend_irecv(ops))

    @staticmethod
    def reduce_scatter_sum(out: Tensor, inp: Tensor, group: Any, rank: int, world: int) -> Launched:
        s = out.numel()
        received = {peer: torch.empty_like(out) for peer in range(world) if peer != rank}
        ops = []
        for peer, buf in received.items():
            ops.append(dist.P2POp(dist.isend, inp[peer * s : (peer + 1) * s], global_rank(group, peer), group, RS_TAG))
            ops.append(dist.P2POp(dist.irecv, buf, global_rank(group, peer), group, RS_TAG))

        def finish() -> None:  # sum in rank order on every rank: deterministic, whatever arrives first
            chunks = [received[p] if p != rank else inp[rank * s : (rank + 1) * s] for p in range(world)]
            torch.add(chunks[0], chunks[1], out=out)
            for chunk in chunks[2:]:
                out.add_(chunk)

        return Launched(dist.batch_isend_irecv(ops), finish)


TRANSPORTS = {t.name: t for t in (Builtin, Pairwise)}


def pairwise_all_to_all(outs: list[Tensor], ins: list[Tensor], group: Any, rank: int, world: int) -> Launched:
    """``outs[p]`` receives peer p's part for this rank, ``ins[p]`` goes to peer p; one round of point-to-point
    messages (both sides know every size, so empty parts are not sent at all)."""
    ops = []
    for peer in range(world):
        if peer == rank:
            continue
        if ins[peer].numel():
            ops.append(dist.P2POp(dist.isend, ins[peer], global_rank(group, peer), group, A2A_TAG))
        if outs[peer].numel():
            ops.append(dist.P2POp(dist.irecv, outs[peer], global_rank(group, peer), group, A2A_TAG))
    return Launched(dist.batch_isend_irecv(ops) if ops else [])


def global_rank(group: Any, peer: int) -> int:
    """``peer``'s rank in the default group (what point-to-point calls take) from its rank in ``group``."""
    return peer if group is None else dist.get_global_rank(group, peer)
