"""Packed payloads: a collective's tensor in fewer bytes on the wire, and back. Pure: nothing here communicates.

The packed collectives (comm/collectives.py ``all_gather_packed``, ``reduce_scatter_packed``) send a ``Packing``'s
bytes instead of the tensor's own, and unpack on arrival into the dtype the caller computes or sums in:

    bfloat16, float16   every element rounded to 16 bits (to nearest, ties to even): 2 bytes each
    int8 blocks         the tensor cut into blocks of ``block`` elements (the last may be shorter), each with one
                        fp32 scale ``max|x| / 127``; an element travels as ``q = round(x / scale)`` in [-127, 127]
                        and comes back as ``q * scale``: at most half a step, ``scale / 2``, from where it was
                        (ZeRO++'s weight quantization: blocks of a few thousand elements, one scale each). A block
                        of zeros has scale 0 and comes back as zeros; a block holding inf or NaN comes back NaN,
                        so a non-finite gradient still reads as one (fp16's overflow check).

One message carries both parts of an int8 block payload: ``[scales, fp32 | values, int8 | 0-3 bytes of padding]`` as
one uint8 tensor, so ``nbytes(numel) = 4 x blocks + numel`` rounded up to a multiple of 4. Packing is deterministic,
so every rank that unpacks the same bytes gets the same values: the gathered weights are the same on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

LEVELS = 127  # int8 steps each side of zero (-128 is not used: the range is symmetric)
DEFAULT_BLOCK = 2048  # elements per scale: 0.2 % of the bytes go to scales


@dataclass(frozen=True)
class Packing:
    """How a payload travels: ``name`` is its wire dtype ("bfloat16", "float16" or "int8"); ``block``, the
    elements per scale of int8 (0 for the 16-bit formats)."""

    name: str
    block: int = 0

    @property
    def blocks_scaled(self) -> bool:
        return self.name == "int8"

    def blocks(self, numel: int) -> int:
        return -(-numel // self.block) if self.blocks_scaled else 0

    def nbytes(self, numel: int) -> int:
        """Bytes of ``numel`` elements on the wire, scales included (int8: rounded up to a multiple of 4, so the
        scales of every rank's payload in a gathered buffer start 4-byte aligned)."""
        return self.blocks(numel) * 4 + numel + (-numel % 4) if self.blocks_scaled else 2 * numel

    def pack(self, x: Tensor) -> Tensor:
        """``x`` (1-D, any floating dtype) as ``nbytes(x.numel())`` bytes (1-D uint8): int8 blocks quantized
        straight into the message's two parts."""
        if not self.blocks_scaled:
            return x.to(getattr(torch, self.name)).view(torch.uint8)
        n, n_scales = x.numel(), 4 * self.blocks(x.numel())
        packed = torch.empty(self.nbytes(n), dtype=torch.uint8, device=x.device)
        packed[n_scales + n :].zero_()  # the padding: the same bytes on every rank
        quantize_into(
            x, self.block, packed[:n_scales].view(torch.float32), packed[n_scales : n_scales + n].view(torch.int8)
        )
        return packed

    def unpack(self, packed: Tensor, out: Tensor) -> Tensor:
        """``out`` (1-D, ``numel``, any floating dtype) takes the values ``packed`` (from ``pack``) carries."""
        if not self.blocks_scaled:
            return out.copy_(packed.view(getattr(torch, self.name)))
        n_scales = self.blocks(out.numel()) * 4
        scales = packed[:n_scales].view(torch.float32)
        q = packed[n_scales : n_scales + out.numel()].view(torch.int8)
        if out.dtype == torch.float32 and out.is_contiguous():
            return dequantize_into(scales, q, self.block, out)
        return out.copy_(dequantize(scales, q, self.block))


WIRE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "int8": "int8"}  # an option's dtype -> its wire dtype


def packing_for(option: str | None, block: int = DEFAULT_BLOCK) -> Packing | None:
    """The packing an option names ("bf16", "fp16", "int8"; ``block`` elements per int8 scale), or None: the
    tensor's own bytes ("fp32", None)."""
    name = WIRE_NAMES.get(option or "")
    return None if name is None else Packing(name, block if name == "int8" else 0)


def _blocks(t: Tensor, block: int) -> list[Tensor]:
    """``t`` (1-D) as its whole blocks (rows of ``block``) and its last, shorter block (one row), views."""
    whole = t.numel() - t.numel() % block
    return [v for v in (t[:whole].view(-1, block), t[whole:].view(1, -1)) if v.numel()]


def quantize_into(x: Tensor, block: int, scales: Tensor, q: Tensor) -> None:
    """``x`` (1-D) quantized by blocks of ``block`` elements into ``scales`` (fp32, one per block) and ``q`` (int8,
    like ``x``). A block holding inf or NaN gets scale NaN (its values then come back NaN)."""
    x, rows = x.float(), 0
    for xs, qs in zip(_blocks(x, block), _blocks(q, block)):
        ss = scales[rows : rows + xs.shape[0]]
        rows += xs.shape[0]
        absmax = xs.abs().amax(dim=1)
        torch.div(absmax, LEVELS, out=ss)
        steps = xs / torch.where(ss > 0, ss, 1.0)[:, None]  # a block of zeros divides by 1: zeros
        qs.copy_(steps.round_().clamp_(-LEVELS, LEVELS).nan_to_num_(0.0))
        ss.masked_fill_(~torch.isfinite(absmax), float("nan"))


def quantize(x: Tensor, block: int) -> tuple[Tensor, Tensor]:
    """``x`` (1-D fp32) -> (scales: fp32, one per block of ``block`` elements; q: int8, like ``x``)."""
    scales = torch.empty(-(-x.numel() // block), device=x.device)
    q = torch.empty(x.numel(), dtype=torch.int8, device=x.device)
    quantize_into(x, block, scales, q)
    return scales, q


def dequantize_into(scales: Tensor, q: Tensor, block: int, out: Tensor) -> Tensor:
    """``out`` (1-D fp32, like ``q``) takes ``q * scale`` of its block."""
    rows = 0
    for qs, outs in zip(_blocks(q, block), _blocks(out, block)):
        outs.copy_(qs).mul_(scales[rows : rows + qs.shape[0], None])
        rows += qs.shape[0]
    return out


def dequantize(scales: Tensor, q: Tensor, block: int) -> Tensor:
    """``q * scale`` of its block: 1-D fp32, like ``q``."""
    return dequantize_into(scales, q, block, torch.empty(q.numel(), device=q.device))
