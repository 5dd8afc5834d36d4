"""The all-gather and the reduce-scatter in fewer bytes (the options ``gather_dtype`` and ``reduce_dtype``): each
rank's values travel packed (comm/packing.py: bf16/fp16, or int8 blocks with one scale each) and are unpacked, and
summed at full precision, on arrival. They run through comm/collectives.py's ``_run`` like every collective, so they
are counted in the ledger (under the packed dtype, with the packed bytes), verified and seen by the watchdog.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_shardlab.comm.collectives import Comm, Pending, _run, _staged, all_gather, reduce_scatter
from lightning_shardlab.comm.packing import Packing
from lightning_shardlab.comm.transport import pairwise_all_to_all


def all_gather_packed(
    full: Tensor, shard: Tensor, comm: Comm, packing: Packing, label: str = "", async_op: bool = False
) -> Pending:
    """``all_gather`` in fewer bytes (comm/packing.py): every rank's ``shard`` travels packed, and ``full`` takes
    every rank's unpacked values, this rank's own included, so every rank holds the same values (not its own
    exact shard beside the others' rounded ones). Filed as an all-gather of the packed bytes, under the packed
    dtype. World size 1: nothing travels, ``full`` takes ``shard`` exactly."""
    if comm.world_size == 1:
        return all_gather(full, shard, comm, label)
    s, world = shard.numel(), comm.world_size
    b = packing.nbytes(s)
    packed = packing.pack(shard)  # 1-D uint8, b
    gathered = torch.empty(world * b, dtype=torch.uint8, device=shard.device)  # 1-D uint8, world * b
    out, inp = _staged(gathered, comm), _staged(packed, comm)

    def finish() -> None:
        for p in range(world):
            packing.unpack(out[p * b : (p + 1) * b].to(full.device), full[p * s : (p + 1) * s])

    if comm.wire is not None:
        launch = lambda call: comm.wire.all_gather(call, out, inp)  # noqa: E731
    else:
        transport = comm.transports["all_gather"]
        launch = lambda call: transport.all_gather(out, inp, comm.group, comm.rank, world)  # noqa: E731
    sizes = (full.numel(), world * b)
    return _run(comm, "all_gather", label, full, launch, finish, async_op, sizes, packing.name)


def reduce_scatter_packed(
    shard: Tensor,
    full: Tensor,
    comm: Comm,
    packing: Packing,
    label: str = "",
    async_op: bool = False,
    residual: Tensor | None = None,
) -> Pending:
    """``reduce_scatter`` in fewer bytes, summed at full precision: rank p's chunk of ``full`` travels to rank p
    packed (comm/packing.py); every rank unpacks the W chunks it holds (its own too, so every contribution is
    rounded once, alike) into ``shard``'s dtype (fp32) and sums them there, in rank order, then divides by W. The
    sum never rounds to the wire's dtype between ranks. ``residual`` (error feedback, 1-D like ``full``, fp32): added
    to ``full`` before packing, and left holding what packing lost (``full + residual - unpacked``) for the next
    call. Filed as a reduce-scatter of the packed bytes (W chunks), under the packed dtype. World size 1: exact."""
    if comm.world_size == 1:
        return reduce_scatter(shard, full, comm, label)
    s, world, me = shard.numel(), comm.world_size, comm.rank
    b = packing.nbytes(s)
    sending = full.to(shard.dtype) if residual is None else residual.add_(full)
    sends = [packing.pack(sending[p * s : (p + 1) * s]) for p in range(world)]  # 1-D uint8, b each
    if residual is not None:  # what this rank's packing lost stays with it
        for p, packed in enumerate(sends):
            chunk = residual[p * s : (p + 1) * s]
            chunk.sub_(packing.unpack(packed, torch.empty_like(chunk)))
    recvs = [torch.empty(b, dtype=torch.uint8, device=full.device) if p != me else sends[me] for p in range(world)]
    outs, ins = [_staged(t, comm) for t in recvs], [_staged(t, comm) for t in sends]

    def finish() -> None:  # sum in rank order on every rank, at the shard's precision
        shard.zero_()
        part = torch.empty_like(shard)
        for out in outs:
            shard.add_(packing.unpack(out.to(shard.device), part))
        shard.div_(world)

    if comm.wire is not None:
        launch = lambda call: comm.wire.all_to_all(call, outs, ins)  # noqa: E731
    else:
        launch = lambda call: pairwise_all_to_all(outs, ins, comm.group, me, world)  # noqa: E731
    sizes = (full.numel(), world * b)
    return _run(comm, "reduce_scatter", label, full, launch, finish, async_op, sizes, packing.name)
