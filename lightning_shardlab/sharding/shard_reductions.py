"""A reduction over every element of a stand-in (sharding/shard_reads.py): ``norm``, ``sum``, ``mean``,
``max``/``min``, ``all``/``any``, ``count_nonzero`` of a whole gradient or weight whose values are spread over the
ranks' shards, computed as DDP's value would be: the local partial of this rank's piece, then one all-reduce of one
number in the shard group (a p-norm's p-th powers summed, an extreme's max or min, a count's sum).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lightning_shardlab.comm import collectives

if TYPE_CHECKING:
    from lightning_shardlab.sharding.shard_reads import Source


def _all_reduce(value: Tensor, source: Source, op: str, what: str) -> Tensor:
    local = value.detach().reshape(()).to(source.comm.device, copy=True)
    return collectives.all_reduce(local, source.comm, op=op, label=source.label(what))


def local_piece(source: Source) -> Tensor:
    with torch._C.DisableTorchFunctionSubclass():
        return source.piece()


def _result(value: Tensor, like: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    return value.to(like.device, dtype or value.dtype)


def _sum(self: Tensor, source: Source, args: tuple, kwargs: dict) -> Tensor:
    piece = local_piece(source)
    dtype = kwargs.get("dtype")
    with torch._C.DisableTorchFunctionSubclass():
        local = piece.sum(dtype=dtype)
    return _result(_all_reduce(local, source, "sum", "sum"), self)


def _mean(self: Tensor, source: Source, args: tuple, kwargs: dict) -> Tensor:
    total = _sum(self, source, args, kwargs)
    return total / self.numel()


def _count_nonzero(self: Tensor, source: Source, args: tuple, kwargs: dict) -> Tensor:
    with torch._C.DisableTorchFunctionSubclass():
        local = torch.count_nonzero(local_piece(source))
    return _result(_all_reduce(local, source, "sum", "count_nonzero"), self)


def _extreme(op: str) -> Callable[[Tensor, Source, tuple, dict], Tensor]:
    def reduce(self: Tensor, source: Source, args: tuple, kwargs: dict) -> Tensor:
        piece = local_piece(source)
        with torch._C.DisableTorchFunctionSubclass():
            if piece.numel():
                local = piece.max() if op == "max" else piece.min()
            elif piece.dtype.is_floating_point:  # this rank holds none of it: the identity of the reduction
                local = torch.tensor(-math.inf if op == "max" else math.inf, dtype=torch.float64)
            else:
                info = torch.iinfo(torch.int64) if piece.dtype != torch.bool else None
                local = torch.tensor((info.min if op == "max" else info.max) if info else int(op == "min"))
            local = local.to(torch.float64 if piece.dtype.is_floating_point else torch.int64)
        return _result(_all_reduce(local, source, op, op), self, piece.dtype)

    return reduce


def _logical(op: str) -> Callable[[Tensor, Source, tuple, dict], Tensor]:
    def reduce(self: Tensor, source: Source, args: tuple, kwargs: dict) -> Tensor:
        with torch._C.DisableTorchFunctionSubclass():
            piece = local_piece(source)
            local = (piece.all() if op == "all" else piece.any()).to(torch.int32)
        flag = _all_reduce(local, source, "min" if op == "all" else "max", op)
        return _result(flag, self, torch.bool)

    return reduce


def _norm_order(func: Any, args: tuple, kwargs: dict) -> float:
    if func is torch.linalg.vector_norm:
        p = args[1] if len(args) > 1 else kwargs.get("ord", 2)
    elif func is torch.linalg.norm:
        p = args[1] if len(args) > 1 else kwargs.get("ord")
        p = 2 if p is None else p
    else:
        p = args[1] if len(args) > 1 else kwargs.get("p", "fro")
    return 2.0 if p in ("fro", None) else float(p)


def _norm(func: Any) -> Callable[[Tensor, Source, tuple, dict], Tensor]:
    """``||x||_p`` = (sum over ranks of ||piece||_p^p)^(1/p); the max (min) of |x| for p = inf (-inf)."""

    def reduce(self: Tensor, source: Source, args: tuple, kwargs: dict) -> Tensor:
        p = _norm_order(func, args, kwargs)
        dtype = kwargs.get("dtype")
        with torch._C.DisableTorchFunctionSubclass():
            piece = local_piece(source)
            piece = piece if dtype is None else piece.to(dtype)
            if math.isinf(p):
                absolute = piece.abs()
                if absolute.numel():
                    local = absolute.max() if p > 0 else absolute.min()
                else:
                    local = torch.tensor(0.0 if p > 0 else math.inf, dtype=piece.dtype)
                op = "max" if p > 0 else "min"
            elif p == 0:
                local, op = torch.count_nonzero(piece).to(piece.dtype), "sum"
            else:
                local, op = torch.linalg.vector_norm(piece, p) ** p, "sum"
        total = _all_reduce(local, source, op, f"norm {p:g}")
        if op == "sum" and p != 0:
            total = total ** (1.0 / p)
        return _result(total, self, piece.dtype)

    return reduce


NORMS = frozenset({Tensor.norm, torch.norm, torch.linalg.vector_norm, torch.linalg.norm})
REDUCTIONS: dict[Any, Callable[[Tensor, Source, tuple, dict], Tensor]] = {
    Tensor.sum: _sum,
    torch.sum: _sum,
    Tensor.mean: _mean,
    torch.mean: _mean,
    Tensor.count_nonzero: _count_nonzero,
    torch.count_nonzero: _count_nonzero,
    Tensor.max: _extreme("max"),
    torch.max: _extreme("max"),
    Tensor.amax: _extreme("max"),
    torch.amax: _extreme("max"),
    Tensor.min: _extreme("min"),
    torch.min: _extreme("min"),
    Tensor.amin: _extreme("min"),
    torch.amin: _extreme("min"),
    Tensor.all: _logical("all"),
    torch.all: _logical("all"),
    Tensor.any: _logical("any"),
    torch.any: _logical("any"),
    Tensor.norm: _norm(Tensor.norm),
    torch.norm: _norm(torch.norm),
    torch.linalg.vector_norm: _norm(torch.linalg.vector_norm),
    torch.linalg.norm: _norm(torch.linalg.norm),
}
