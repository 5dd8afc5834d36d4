"""The flat-parameter layout and the tensors that live on it. Pure: nothing here communicates.

[Note: shardlab tensors]
Every function and test in this package uses exactly these names. S = padded_numel // world_size.

    original param   ``params[i]``: the ``nn.Parameter`` the user created. It is the module's, the optimizer's
                     and every callback's for the whole run (one identity); only its ``.data`` changes. Its
                     ``shape`` is always the real one and its ``requires_grad`` is read, never copied.
    unsharded view   ``views[i]``: ``full[offset:offset+numel]`` with the original shape. While the unit is
                     gathered (stages 1-2: always) the original param's ``.data`` is this view, so the
                     module computes with it and autograd writes the param's ``.grad`` in that shape.
    stub             ``stubs[i]`` (stage 3 only): the original shape, stride 0, over a storage of 0 bytes (no
                     memory). While the unit is SHARDED the param's ``.data`` is its stub and its class is
                     ``ShardedAtRest`` (sharding/placeholders.py): shape and flags answer, and every read of
                     values is refused before a kernel could touch the empty storage.
    group shard      ``group_shard`` (stage 3 with ``reshard_after_forward=k`` only): 1-D, padded_numel / k,
                     compute dtype: ``full[j*P/k:(j+1)*P/k]``, j = this rank's place in its reshard group of
                     k ranks. Kept from a unit's forward to its backward, whose all-gather then runs among
                     those k ranks only (comm/mesh.py); None otherwise.
    master view      ``master_params[i]``: an ``nn.Parameter`` viewing the part of ``master`` that
                     overlaps parameter i (1-D, possibly empty). The optimizer updates these: for the
                     update alone its param groups hold them in place of the original params
                     (sharding/optimizer.py), and its state lives beside the original params otherwise.
    flat grad        ``flat_grad``: 1-D, numel = padded_numel: the original params' grads laid out like
                     ``full`` (zeros for padding and for parameters that got no gradient). Transient:
                     the input of the reduce-scatter.
    grad shard       ``grad_shard``: 1-D, numel = S, ``grad_dtype`` (the compute dtype: bf16 under mixed
                     precision, else the parameters' dtype): this rank's slice of the averaged gradient,
                     kept between backward and the optimizer step.
    master grad      ``master_grad``: the grad shard in the master's dtype, made for the optimizer step only
                     (a view of the grad shard when the dtypes agree). Each master view's ``.grad`` views it.
    residual         ``residual`` (``reduce_dtype='int8'`` only): 1-D, padded_numel, fp32: what this rank's int8
                     packing of its flat grads lost so far, added to the next flat grad before it is packed
                     (error feedback, comm/collectives.py ``reduce_scatter_packed``); kept in checkpoints.

Why freeing storage keeps autograd valid: while gathered, the original params' data are views of ``full``.
Autograd saves them (or views of them) for backward. ``free_storage`` shrinks the *same* storage object to 0 bytes
and ``alloc_storage`` grows it back, so every saved reference points at valid memory again once the
unit is re-gathered before its backward. Replacing ``full`` by a new tensor would silently break them.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor, nn

from lightning_shardlab.comm.packing import Packing
from lightning_shardlab.sharding.placeholders import ShardedAtRest


@dataclass(frozen=True)
class ParamSlot:
    """One original parameter inside a flat parameter."""

    fqns: tuple[str, ...]  # every name it is registered under (tied params have several); [0] is canonical
    shape: torch.Size
    offset: int  # first element in the full buffer

    @cached_property  # layouts never change: hooks ask for these sizes every step
    def numel(self) -> int:
        return self.shape.numel()

    @property
    def name(self) -> str:
        return self.fqns[0]


@dataclass(frozen=True)
class FlatParamLayout:
    """Where each parameter of one (unit, dtype, requires_grad) group sits, and who owns which slice."""

    unit: str
    dtype: torch.dtype
    requires_grad: bool
    slots: tuple[ParamSlot, ...]
    world_size: int

    @staticmethod
    def build(
        unit: str,
        dtype: torch.dtype,
        requires_grad: bool,
        params: list[tuple[tuple[str, ...], torch.Size]],
        world_size: int,
    ) -> FlatParamLayout:
        slots, offset = [], 0
        for fqns, shape in params:
            slots.append(ParamSlot(fqns, torch.Size(shape), offset))
            offset += torch.Size(shape).numel()
        return FlatParamLayout(unit, dtype, requires_grad, tuple(slots), world_size)

    @cached_property
    def numel(self) -> int:
        return sum(slot.numel for slot in self.slots)

    @cached_property
    def padded_numel(self) -> int:
        # Padding to a multiple of the world size makes every shard the same length, which the
        # all-gather and reduce-scatter require. At most world_size - 1 elements are padding.
        n = self.numel
        return n + (-n) % self.world_size

    @cached_property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world_size

    @property
    def padding(self) -> int:
        return self.padded_numel - self.numel

    @property
    def name(self) -> str:
        kind = str(self.dtype).removeprefix("torch.")
        return f"{self.unit}[{kind}{'' if self.requires_grad else ',frozen'}]"

    def shard_range(self, rank: int) -> tuple[int, int]:
        """``[start, end)`` of ``rank``'s shard in full-buffer coordinates."""
        start = rank * self.shard_numel
        return start, start + self.shard_numel

    def slot_in_shard(self, slot: ParamSlot, rank: int) -> tuple[int, int]:
        """``[lo, hi)`` of the part of ``slot`` inside ``rank``'s shard, in shard coordinates."""
        start, end = self.shard_range(rank)
        lo = min(max(slot.offset, start), end)
        hi = max(min(slot.offset + slot.numel, end), lo)
        return lo - start, hi - start

    def padding_in_shard(self, rank: int) -> int:
        """Padding elements inside ``rank``'s shard (the padding sits at the end of the full buffer)."""
        start, end = self.shard_range(rank)
        return max(0, end - max(self.numel, start))


def alias(base: Tensor, offset: int, shape: torch.Size) -> Tensor:
    """A contiguous view of ``base``'s storage at ``offset`` with its own autograd version counter.

    The all-gather writes into ``full`` in place, which bumps ``full``'s version counter. A plain view
    shares that counter, so autograd would see every tensor it saved from an unsharded param as
    modified and refuse the backward. These writes only ever restore the values autograd saw.
    """
    out = torch.empty(0, dtype=base.dtype, device=base.device)
    out.set_(base.untyped_storage(), base.storage_offset() + offset, shape, torch.empty(shape, device="meta").stride())
    return out


def free_storage(tensor: Tensor) -> None:
    """Shrink ``tensor``'s storage to 0 bytes, keeping the storage object (see the note above)."""
    storage = tensor.untyped_storage()
    if storage.size() != 0:
        storage.resize_(0)


def alloc_storage(tensor: Tensor) -> None:
    """Grow ``tensor``'s storage back to its full size; the values are undefined until written."""
    storage = tensor.untyped_storage()
    nbytes = tensor.numel() * tensor.element_size()
    if storage.size() != nbytes:
        storage.resize_(nbytes)


def stub(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A tensor of ``shape`` that holds no memory: stride 0 over a storage shrunk to 0 bytes. Only ever the data of
    a ``ShardedAtRest`` parameter, whose every read raises before a kernel runs (sharding/placeholders.py)."""
    one = torch.zeros((), dtype=dtype, device=device)
    out = one.expand(shape)
    free_storage(one)
    return out


def storage_is_allocated(tensor: Tensor) -> bool:
    return tensor.untyped_storage().size() > 0


class FlatParam:
    """The tensors of one flat parameter on this rank (names as in [Note: shardlab tensors]).

    dtypes: ``layout.dtype`` is the parameters' own dtype, which the master shard keeps; ``compute_dtype`` is
    what is gathered and computed with (bf16 under mixed precision, else the same); ``reduce_dtype`` is what
    the reduce-scatter sums in; ``grad_dtype`` is what the grad shard holds between steps (the compute dtype:
    2 bytes per element under mixed precision, as the ZeRO table counts; the optimizer reads an fp32 copy,
    ``master_grad``, that lives only until its step). ``resident_full`` is True at stages 1-2 (``full`` always
    allocated, ``shard`` a view of it) and False at stage 3 (``full`` exists only while gathered).
    """

    def __init__(
        self,
        layout: FlatParamLayout,
        rank: int,
        device: torch.device,
        resident_full: bool,
        compute_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None,
        params: list[nn.Parameter] | None = None,
        gather_packing: Packing | None = None,
        reduce_packing: Packing | None = None,
    ) -> None:
        self.layout = layout
        self.rank = rank
        self.resident_full = resident_full
        self.compute_dtype = compute_dtype or layout.dtype
        self.grad_dtype = self.compute_dtype
        # gradients are reduced in fp32 under mixed precision unless asked otherwise (the sum of N
        # low-precision gradients would round N times)
        self.reduce_dtype = reduce_dtype or layout.dtype
        # opt-in packed traffic (comm/packing.py, docs/slow_links.md): stage-3 gathers of the compute shard, and
        # reductions that travel packed and are summed in fp32 (the flat grad is laid out in fp32 for them)
        self.gather_packing = gather_packing if self.compute_dtype.is_floating_point else None
        self.reduce_packing = reduce_packing if layout.dtype.is_floating_point else None
        if self.reduce_packing is not None:
            self.reduce_dtype = torch.float32
        # int8 reductions: what this rank's packing lost, added to its next flat grad (1-D, padded_numel, fp32;
        # allocated by the first reduction, kept in checkpoints)
        self.residual: Tensor | None = None
        n, s = layout.padded_numel, layout.shard_numel
        start, end = layout.shard_range(rank)
        self.full: Tensor = torch.zeros(n, dtype=self.compute_dtype, device=device)  # 1-D, padded_numel
        if resident_full or layout.world_size == 1:
            # World size 1: the shard is the whole buffer, so gathering needs no copy at all.
            self.shard: Tensor = self.full[start:end]  # 1-D, S
        else:
            self.shard = torch.zeros(s, dtype=self.compute_dtype, device=device)  # 1-D, S
        mixed = self.compute_dtype != layout.dtype
        self.master: Tensor = torch.zeros(s, dtype=layout.dtype, device=device) if mixed else self.shard  # 1-D, S
        self.group_shard: Tensor | None = None  # 1-D, P / k; reshard_after_forward=k, forward to backward
        self.grad_shard: Tensor | None = None  # 1-D, S, grad dtype; allocated by the first reduction
        self.master_grad: Tensor | None = None  # 1-D, S, master dtype; mixed precision, only for a step
        self.grads_shown = False  # the master views' .grad point at this gradient (see sharding/gradients.py)
        self.views: list[Tensor] = [alias(self.full, slot.offset, slot.shape) for slot in layout.slots]
        self.stubs: list[Tensor] = [stub(slot.shape, self.compute_dtype, device) for slot in layout.slots]
        # the original params (a plain module, e.g. in the tests, may hand none: then fresh ones)
        self.params: list[nn.Parameter] = params or [
            nn.Parameter(torch.empty(slot.shape, dtype=layout.dtype, device=device), layout.requires_grad)
            for slot in layout.slots
        ]
        with torch._C.DisableTorchFunctionSubclass():
            self._shown: list[Tensor] = [p.data for p in self.params]  # what each param's .data was last set to
        self._copies_shown = False  # the user's full copies are shown (gathered_params), not views or stubs
        self.world_rank = rank  # for messages: the rank as the user knows it (its unit sets it under hybrid sharding)
        self.aliases: dict[int, Tensor] = {}  # slot -> a tensor user code gave its param as .data (mirror_aliases)
        self.master_params: list[nn.Parameter] = []
        for slot in layout.slots:
            lo, hi = layout.slot_in_shard(slot, rank)
            self.master_params.append(nn.Parameter(self.master[lo:hi]))
        if self.gathers:  # stage 3: allocated only while gathered; freed after the aliases (set_ would regrow it)
            free_storage(self.full)

    @property
    def gathers(self) -> bool:
        """Whether this flat parameter ever needs an all-gather to compute (stage 3 with world > 1)."""
        return not self.resident_full and self.layout.world_size > 1

    def flatten(self, values: list[Tensor]) -> Tensor:
        """The parameters' values laid out like ``full``, in their own dtype (padding zero). 1-D, padded_numel."""
        parts = [v.detach().reshape(-1).to(self.master.device, self.layout.dtype) for v in values]
        if self.layout.padding:
            parts.append(torch.zeros(self.layout.padding, dtype=self.layout.dtype, device=self.master.device))
        return torch.cat(parts)

    def load(self, flat: Tensor) -> None:
        """Take this rank's slice of ``flat`` (from ``flatten``) as the master and compute shards."""
        start, end = self.layout.shard_range(self.rank)
        with torch.no_grad():
            self.master.copy_(flat[start:end])
            self.shard_from_master()
            if self.resident_full:
                self.full.copy_(flat)  # stages 1-2: the resident compute copy, whole

    def shard_from_master(self) -> None:
        """After an optimizer step in mixed precision (or with the master offloaded): refresh the compute shard.
        A master in pinned host memory (offload='cpu') is copied to the device without waiting."""
        if self.master is not self.shard:
            with torch.no_grad():
                self.shard.copy_(self.master, non_blocking=self.master.is_pinned())

    def move_master(self, new: Tensor) -> None:
        """Keep the master shard in ``new`` from now on (1-D, S, e.g. in a file or in host memory): its values are
        copied, and the master views keep their identity (the optimizer holds them) but view ``new``."""
        with torch.no_grad():
            new.copy_(self.master)
        self.master = new
        for slot, view in zip(self.layout.slots, self.master_params):
            lo, hi = self.layout.slot_in_shard(slot, self.rank)
            view.data = new[lo:hi]

    def keep_group_shard(self, place: int, size: int) -> None:
        """Before the full buffer is freed after forward: keep slice ``place`` of ``size`` (a copy)."""
        n = self.layout.padded_numel // size
        self.group_shard = self.full[place * n : (place + 1) * n].clone()

    @property
    def error_feedback(self) -> bool:
        """Whether this flat parameter's reductions keep what packing lost (int8 blocks) for the next one."""
        return self.reduce_packing is not None and self.reduce_packing.blocks_scaled

    def residual_buffer(self) -> Tensor:
        """The error-feedback residual, made (zeros) on first use. 1-D, padded_numel, fp32."""
        if self.residual is None:
            self.residual = torch.zeros(self.layout.padded_numel, dtype=torch.float32, device=self.master.device)
        return self.residual

    def alloc_full(self) -> None:
        alloc_storage(self.full)

    def free_full(self) -> None:
        if self.gathers:
            free_storage(self.full)

    # ---- what the original params' .data is (see the note above) ----

    def show_views(self) -> None:
        """The original params compute with the full buffer (their unit is gathered)."""
        self._show(self.views, at_rest=False)
        if self.aliases:
            self.mirror_aliases()

    def show_stubs(self) -> None:
        """Stage 3, the unit sharded: the original params keep their shape, and refuse their values."""
        self._show(self.stubs, at_rest=True)

    def show_copies(self, copies: list[Tensor]) -> None:
        """The original params hold ``copies`` (full values for the user: sharding/gathered.py)."""
        self.mirror_aliases(copies)
        self._show(copies, at_rest=False, copies=True)

    def _show(self, datas: list[Tensor], at_rest: bool, copies: bool = False) -> None:
        self.adopt_replaced()
        self._copies_shown = copies
        for i, (param, data) in enumerate(zip(self.params, datas)):
            param.__class__ = nn.Parameter
            param.data = data
            self._shown[i] = data
            if at_rest:
                param._shardlab_name, param._shardlab_rank = self.layout.slots[i].name, self.world_rank
                param.__class__ = ShardedAtRest

    def replaced(self) -> list[int]:
        """The slots whose param's ``.data`` someone else replaced since it was last shown (e.g.
        ``torch.nn.utils.prune.remove``: ``orig.data = weight.data``)."""
        with torch._C.DisableTorchFunctionSubclass():
            return [i for i, (p, shown) in enumerate(zip(self.params, self._shown)) if not _same_tensor(p.data, shown)]

    def adopt_replaced(self) -> list[int]:
        """Take the values of every replaced ``.data`` (see ``replaced``), then show the param what it held
        before. Into the user's full copies while they are shown (gathered_params decides what to keep), else
        into the shards, as a step would: the master slice, the compute shard, and the full buffer while it holds
        values. Every rank runs the same code, so every rank adopts the same values (as under DDP)."""
        slots = self.replaced()
        start = self.layout.shard_range(self.rank)[0]
        with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
            for i in slots:
                slot, value, shown = self.layout.slots[i], self.params[i].data, self._shown[i]
                if value.shape != slot.shape:
                    raise RuntimeError(
                        f"[rank {self.rank}] parameter {slot.name!r} was given data of shape {tuple(value.shape)},"
                        f" but it was sharded with shape {tuple(slot.shape)}. HINT: keep a parameter's shape; for a"
                        " new shape, register a new parameter before training starts."
                    )
                self.aliases[i] = value  # torch's p.data = t shares t's storage with p: keep t equal to p
                if self._copies_shown:
                    shown.copy_(value)
                else:
                    flat = value.detach().reshape(-1)
                    lo, hi = self.layout.slot_in_shard(slot, self.rank)
                    a = start + lo - slot.offset
                    self.master[lo:hi].copy_(flat[a : a + hi - lo])
                    if self.shard is not self.master:
                        self.shard[lo:hi].copy_(flat[a : a + hi - lo])
                    if storage_is_allocated(self.full):
                        self.full[slot.offset : slot.offset + slot.numel].copy_(flat)
                self.params[i].data = shown
        return slots

    def mirror_aliases(self, values: list[Tensor] | None = None) -> None:
        """After ``p.data = t`` torch's ``p`` and ``t`` share one storage, so ``t`` follows every later update of
        ``p`` (``ModelPruning``'s lottery-ticket reset relies on it: its saved initial weights then move with
        training). Here ``p`` computes with its view of the full buffer again, so ``t`` is kept equal to it instead:
        from ``values`` (the user's full copies) or the full buffer while it holds values. A ``t`` that nobody
        else holds any more is forgotten (its memory freed)."""
        for i, alias in list(self.aliases.items()):
            if torch._C._storage_Use_Count(alias.untyped_storage()._cdata) <= 2:  # this dict's, and the call's
                del self.aliases[i]
            elif values is not None or storage_is_allocated(self.full):
                with torch.no_grad():
                    alias.copy_((values or self.views)[i])


def _same_tensor(a: Tensor, b: Tensor) -> bool:
    return (
        a.untyped_storage()._cdata == b.untyped_storage()._cdata
        and a.storage_offset() == b.storage_offset()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
    )
