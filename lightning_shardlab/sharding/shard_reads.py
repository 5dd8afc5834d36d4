"""The tensor that stands for a whole gradient or weight whose values live in shards (``ShardRead``).

A DDP user's hooks read ``p.grad`` and the weights between steps: ``grad_norm`` logs ``p.grad.data.norm(2)``,
``clip_grad_norm_`` multiplies every gradient in place, a callback clones a weight to compare it after the step.
Here the averaged gradient is only a shard on every rank at every stage (sharding/gradients.py), and at stage 3 so
is a weight between steps (sharding/placeholders.py). So the parameter's ``.grad`` (and, at stage 3, the parameter
itself) is a tensor of the real shape, dtype and device over a storage of 0 bytes that knows where its values are:
this rank's *piece* (a 1-D slice of the master view's ``.grad``, or of the master shard) and which elements of the
whole every rank of the shard group holds. Every torch operation on it is routed (``serve``):

    metadata           shape, dtype, strides, ``requires_grad``: the stub's, no values read
    .data, .detach()   the same stand-in (Lightning's ``grad_norm`` reads ``p.grad.data``)
    reductions         ``norm``/``linalg.vector_norm``, ``sum``, ``mean``, ``max``/``min``/``amax``/``amin``,
                       ``all``/``any``, ``count_nonzero`` over the whole tensor: the local partial of the piece, then
                       one all-reduce of one number (4-8 bytes) in the shard group
    elementwise        ``abs()``, ``isfinite()``, ``g * 0.5``, ``g > 0``, ...: a stand-in of the same layout whose
                       piece is the op applied to this rank's piece (no communication)
    in place           ``mul_``, ``clamp_``, ``masked_fill_``, ``zero_``, ``copy_``, ``lerp_``, ...: applied to the
                       piece itself, so the optimizer (and the next forward) sees the change; a full-shape tensor
                       argument is sliced to this rank's range
    anything else      one all-gather of the parameter's pieces (just its slot, padded to the longest piece) into a
                       whole plain tensor, the op re-run on it; an in-place op writes this rank's slice back

Every read is a collective: it is served while the strategy opens reads (``ShardReads.open``: during fit, and for
Fabric after setup), on every rank, in the same order, as any code a hook runs on every rank does. A read on some
ranks only (``if self.global_rank == 0: print(w.norm())``) issues a collective the others never issue: the verified
collectives (comm/verify.py) meet it at the others' next collective and raise on every rank, naming the read
(``explain``); the strategy ends fit with one such collective, so a read late in fit cannot wait for peers that have
left. Outside the window a stand-in refuses to be read with a clear error, never a hang.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from lightning_shardlab.comm import collectives
from lightning_shardlab.sharding.flat_param import stub
from lightning_shardlab.sharding.placeholders import METADATA, ShardedAtRest, at_rest_error
from lightning_shardlab.sharding.shard_reductions import NORMS, REDUCTIONS, local_piece

if TYPE_CHECKING:
    from lightning_shardlab.comm.collectives import Comm
    from lightning_shardlab.sharding.flat_param import FlatParam
    from lightning_shardlab.sharding.read_window import ShardReads

LABEL = "read"  # every read's collective is labelled "read <what> <name>": what the mismatch message shows


@dataclass
class Source:
    """Where the values of one whole tensor are: this rank's piece and the layout of every rank's.

    ``parts[r]`` = (first element, count) of rank r's piece in the flattened whole; ``piece()`` returns this rank's
    (1-D, ``parts[rank][1]`` elements; live, so a later in-place change lands in the shard); ``wrote`` runs after an
    in-place change (a weight's compute shard follows its master)."""

    name: str
    what: str  # "gradient" or "weight"
    piece: Callable[[], Tensor]
    parts: tuple[tuple[int, int], ...]
    rank: int
    world_rank: int
    comm: Comm
    reads: ShardReads
    wrote: Callable[[], None] | None = None
    note: str | None = None  # said once per run when it is read: how its values differ from what DDP shows

    def derived(self, piece: Tensor) -> Source:
        """The same layout over a computed piece (an elementwise result): reads of it cost what reads of this do."""
        return Source(
            self.name,
            self.what,
            lambda: piece,
            self.parts,
            self.rank,
            self.world_rank,
            self.comm,
            self.reads,
            note=self.note,
        )

    @property
    def span(self) -> tuple[int, int]:
        return self.parts[self.rank]

    def label(self, op: str) -> str:
        return f"{LABEL} {self.what} {self.name} ({op})"


class ShardRead(Tensor):
    """A whole tensor whose values are spread over the ranks' shards (see the module docstring)."""

    _source: Source

    @staticmethod
    def make(source: Source, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> ShardRead:
        out = Tensor._make_subclass(ShardRead, stub(shape, dtype, device), False)
        out._source = source
        return out

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        return serve(func, args, kwargs or {})

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return f"ShardRead({self._source.what} {self._source.name!r}, shape={tuple(self.shape)})"


# ---- routing ----


def source_of(t: Any) -> Source | None:
    """The source of a stand-in (a ``ShardRead``, or a stage-3 parameter at rest while reads are served)."""
    if isinstance(t, ShardRead):
        return t._source
    if isinstance(t, ShardedAtRest):
        return _weight_source(t)
    return None


def serve(func: Any, args: tuple, kwargs: dict) -> Any:
    """Route one torch operation whose arguments include a stand-in (the table in the module docstring)."""
    if func in METADATA:
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    found = [(t, s) for t in _tensors(args, kwargs) if (s := source_of(t)) is not None]
    for t, s in found:
        s.reads.check_open(t, s, getattr(func, "__name__", str(func)))
        if s.note is not None:
            s.reads.say_once(s.note)
    self, source = (args[0], source_of(args[0])) if args else (None, None)
    if source is not None and func in SAME:
        if isinstance(self, ShardRead):
            return self
        if _making_a_parameter():  # nn.Parameter(w): a parametrization registered at rest would copy a stand-in
            raise at_rest_error(self, "nn.Parameter")
        return _stand_in(self, source)
    reshaped = func in FLAT_VIEWS and not any(isinstance(a, torch.dtype) for a in args[1:])  # not view(dtype)
    if source is not None and reshaped:  # the whole is contiguous: a reshape keeps every piece
        with torch._C.DisableTorchFunctionSubclass():
            shape = func(torch.empty(self.shape, device="meta"), *args[1:], **kwargs).shape
        return ShardRead.make(source, shape, self.dtype, self.device)
    if source is not None and func in REDUCTIONS and _over_every_element(func, args, kwargs):
        return REDUCTIONS[func](self, source, args, kwargs)
    name = getattr(func, "__name__", "")
    if name.startswith("_foreach_") and args and isinstance(args[0], (list, tuple)):
        return _foreach(name, args, kwargs)
    if source is not None and (func in ELEMENTWISE or func in IN_PLACE):
        served = _elementwise(func, self, source, args, kwargs)
        if served is not NotImplemented:
            return served
    return _on_whole(func, args, kwargs, name)


def serve_at_rest(func: Any, args: tuple, kwargs: dict, param: ShardedAtRest) -> Any:
    """An operation on a stage-3 parameter at rest (sharding/placeholders.py): served while its model serves reads,
    else refused with the error that names the parameter and the fix."""
    for t in _tensors(args, kwargs):
        if isinstance(t, ShardedAtRest):
            source = _weight_source(t)
            if source is None or not source.reads.serving:
                raise at_rest_error(t, getattr(func, "__name__", str(func)))
    return serve(func, args, kwargs)


def _tensors(args: tuple, kwargs: dict) -> Iterator[Any]:
    for a in (*args, *kwargs.values()):
        if isinstance(a, (list, tuple)):
            yield from a
        else:
            yield a


def _making_a_parameter() -> bool:
    """Whether ``nn.Parameter(...)`` called this ``detach()`` (a few frames up: torch's dispatch, then ``serve``)."""
    frame = sys._getframe(1)
    for _ in range(8):
        if frame is None:
            return False
        if frame.f_code is nn.Parameter.__new__.__code__:
            return True
        frame = frame.f_back
    return False


def _stand_in(param: Tensor, source: Source) -> ShardRead:
    """A parameter at rest read through ``.data``/``.detach()``: a stand-in for its whole value."""
    with torch._C.DisableTorchFunctionSubclass():
        shape, dtype, device = param.shape, param.dtype, param.device
    return ShardRead.make(source, shape, dtype, device)


def _over_every_element(func: Any, args: tuple, kwargs: dict) -> bool:
    """The reduction runs over the whole tensor: no ``dim`` (a norm's order is its one positional option), no
    ``out``, and no second tensor (``torch.max(a, b)`` is elementwise)."""
    positional = 2 if func in NORMS else 1
    if len(args) > positional or kwargs.get("dim", kwargs.get("axis")) is not None or "out" in kwargs:
        return False
    return not any(isinstance(a, Tensor) for a in args[1:])


# what returns the stand-in itself: its values are the same
SAME = frozenset({Tensor.data.__get__, Tensor.detach, Tensor.detach_, Tensor.contiguous})
# reshapes of a contiguous whole: the flat order of the elements, and so every piece, is unchanged
FLAT_VIEWS = frozenset({Tensor.view, Tensor.reshape, Tensor.flatten, torch.flatten, torch.reshape, Tensor.view_as})


# ---- elementwise: the op applied to this rank's piece ----

_ELEMENTWISE_NAMES = (
    "abs neg sign sgn sqrt rsqrt square exp log log1p reciprocal isfinite isnan isinf isneginf isposinf logical_not"
    " signbit pow mul multiply div divide true_divide add sub subtract eq ne gt ge lt le clamp clip clamp_min"
    " clamp_max nan_to_num maximum minimum fmax fmin lerp where masked_fill float double half bfloat16 to type_as"
    " __abs__ __neg__ __mul__ __rmul__ __truediv__ __rtruediv__ __add__ __radd__ __sub__ __rsub__ __pow__ __rpow__"
    " __eq__ __ne__ __gt__ __ge__ __lt__ __le__ __and__ __or__ __invert__"
).split()
_IN_PLACE_NAMES = (
    "abs_ neg_ sqrt_ square_ mul_ div_ add_ sub_ pow_ clamp_ clip_ clamp_min_ clamp_max_ nan_to_num_ zero_ fill_"
    " copy_ masked_fill_ lerp_ addcmul_ addcdiv_ sign_ __imul__ __iadd__ __isub__ __itruediv__ __ipow__"
).split()
ELEMENTWISE = frozenset(
    f for n in _ELEMENTWISE_NAMES for f in (getattr(Tensor, n, None), getattr(torch, n, None)) if f is not None
)
IN_PLACE = frozenset(getattr(Tensor, n) for n in _IN_PLACE_NAMES if hasattr(Tensor, n))


def _elementwise(func: Any, self: Tensor, source: Source, args: tuple, kwargs: dict) -> Any:
    """Apply ``func`` to this rank's piece: every other tensor argument must be a stand-in of the same layout, a
    number, a 0-d tensor or a tensor of the whole's shape (sliced to this rank's range). NotImplemented otherwise."""
    if func in (Tensor.to, torch.Tensor.type_as) and not _only_dtype(args, kwargs):
        return NotImplemented
    start, n = source.span
    piece = local_piece(source)

    def local(a: Any) -> Any:
        if a is self:
            return piece
        s = source_of(a)
        if s is not None:
            return local_piece(s) if s.parts == source.parts and tuple(a.shape) == tuple(self.shape) else NotImplemented
        if isinstance(a, Tensor):
            if a.dim() == 0:
                return a
            if tuple(a.shape) == tuple(self.shape):
                return a.reshape(-1)[start : start + n].to(piece.device)
            return NotImplemented
        if isinstance(a, (list, tuple)) and any(isinstance(x, Tensor) for x in a):
            return NotImplemented
        return a

    local_args = [local(a) for a in args]
    local_kwargs = {k: local(v) for k, v in kwargs.items()}
    if any(a is NotImplemented for a in (*local_args, *local_kwargs.values())):
        return NotImplemented
    with torch._C.DisableTorchFunctionSubclass():
        out = func(*local_args, **local_kwargs)
    if func in IN_PLACE:
        _wrote(source)
        return self
    if isinstance(out, Tensor) and out.shape == piece.shape:
        return ShardRead.make(source.derived(out), self.shape, out.dtype, self.device)
    return NotImplemented


def _only_dtype(args: tuple, kwargs: dict) -> bool:
    """``x.to(torch.float64)``, ``x.float()``: a cast, not a move to another device."""
    rest = [*args[1:], *kwargs.values()]
    return all(isinstance(a, (torch.dtype, bool)) for a in rest)


def _wrote(source: Source) -> None:
    if source.wrote is not None:
        source.wrote()


# ---- torch._foreach_*: one element at a time ----


def _foreach(name: str, args: tuple, kwargs: dict) -> Any:
    """``torch._foreach_mul_(grads, c)``, ``torch._foreach_norm(grads, p)``: each element through ``serve``."""
    base = name.removeprefix("_foreach_")
    in_place = base.endswith("_")
    single = getattr(Tensor, base) if in_place else {"norm": torch.linalg.vector_norm}.get(base, getattr(torch, base))
    tensors = list(args[0])
    out = []
    for i, t in enumerate(tensors):
        rest = [a[i] if isinstance(a, (list, tuple)) else a for a in args[1:]]
        out.append(single(t, *rest, **kwargs))
    return None if in_place else out


# ---- everything else: the whole value, gathered ----


def _on_whole(func: Any, args: tuple, kwargs: dict, name: str) -> Any:
    """Gather each stand-in's whole value, run ``func`` on plain tensors; an in-place op on a stand-in writes this
    rank's slice of the result back into its piece."""
    wholes: dict[int, tuple[Tensor, Tensor, Source]] = {}

    def whole(a: Any) -> Any:
        s = source_of(a)
        if s is None:
            return [whole(x) for x in a] if isinstance(a, list) else a
        if id(a) not in wholes:
            wholes[id(a)] = (a, gather_whole(s, tuple(a.shape), name), s)
        return wholes[id(a)][1]

    plain_args = [whole(a) for a in args]
    plain_kwargs = {k: whole(v) for k, v in kwargs.items()}
    with torch._C.DisableTorchFunctionSubclass():
        out = func(*plain_args, **plain_kwargs)
    written = _written(func, name, args, kwargs)
    for original, value, source in wholes.values():
        if id(original) in written:
            start, n = source.span
            with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
                source.piece().copy_(value.reshape(-1)[start : start + n])
            _wrote(source)
    for original, value, _ in wholes.values():
        if out is value:
            return original
    return out


def _written(func: Any, name: str, args: tuple, kwargs: dict) -> set[int]:
    """The ids of the stand-ins an in-place op writes: its first argument (or each in a list), or ``out=``."""
    targets: list[Any] = []
    if args and (func is Tensor.__setitem__ or (name.endswith("_") and not name.endswith("__")) or name[:3] == "__i"):
        targets = list(args[0]) if isinstance(args[0], (list, tuple)) else [args[0]]
    if "out" in kwargs:
        targets.append(kwargs["out"])
    return {id(t) for t in targets if source_of(t) is not None}


def gather_whole(source: Source, shape: tuple[int, ...], op: str) -> Tensor:
    """Collective: the whole value (``shape``, the piece's dtype) from every rank's piece: one all-gather of the
    pieces, each padded to the longest (its bytes are in the ledger under the read's label)."""
    longest = max(n for _, n in source.parts)
    with torch._C.DisableTorchFunctionSubclass():
        piece = source.piece().detach()
        send = torch.zeros(longest, dtype=piece.dtype, device=source.comm.device)
        send[: piece.numel()].copy_(piece)
        received = torch.empty(longest * len(source.parts), dtype=piece.dtype, device=source.comm.device)
        collectives.all_gather(received, send, source.comm, label=source.label(op))
        flat = torch.cat([received[r * longest : r * longest + n] for r, (_, n) in enumerate(source.parts)])
        return flat.reshape(shape).to(piece.device)


def parts_of(fp: FlatParam, i: int) -> tuple[tuple[int, int], ...]:
    """Rank r's piece of slot ``i`` as (first element in the flattened parameter, count), for every rank."""
    slot, layout = fp.layout.slots[i], fp.layout
    parts = []
    for r in range(layout.world_size):
        lo, hi = layout.slot_in_shard(slot, r)
        parts.append((layout.shard_range(r)[0] + lo - slot.offset if hi > lo else 0, hi - lo))
    return tuple(parts)


# id(param) -> (param, its ShardReads, its flat parameter, slot): weak, so a model that is gone leaves nothing
WEIGHTS: dict[int, tuple[weakref.ref, weakref.ref, weakref.ref, int]] = {}


def _weight_source(param: ShardedAtRest) -> Source | None:
    entry = WEIGHTS.get(id(param))
    if entry is None or entry[0]() is not param:
        return None
    reads, fp, i = entry[1](), entry[2](), entry[3]
    if reads is None or fp is None:
        return None
    slot = fp.layout.slots[i]
    lo, hi = fp.layout.slot_in_shard(slot, fp.rank)

    def wrote() -> None:  # the master changed: the compute shard follows (mixed precision, or a master on the host)
        if fp.shard is not fp.master:
            with torch.no_grad():
                fp.shard[lo:hi].copy_(fp.master[lo:hi])

    return Source(
        slot.name, "weight", lambda: fp.master[lo:hi], parts_of(fp, i), fp.rank, fp.world_rank, reads.comm, reads, wrote
    )
