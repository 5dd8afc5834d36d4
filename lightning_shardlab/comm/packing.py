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
        """``x`` (1-D, any floating dtype) as ``nbytes(x.numel())`` bytes (1-D uint8)."""
        if not self.blocks_scaled:
            return x.to(getattr(torch, self.name)).view(torch.uint8)
        scales, q = quantize(x.float(), self.block)
        pad = torch.zeros(-x.numel() % 4, dtype=torch.uint8, device=x.device)
        return torch.cat([scales.view(torch.uint8), q.view(torch.uint8), pad])

    def unpack(self, packed: Tensor, out: Tensor) -> Tensor:
        """``out`` (1-D, ``numel``, any floating dtype) takes the values ``packed`` (from ``pack``) carries."""
        if not self.blocks_scaled:
            return out.copy_(packed.view(getattr(torch, self.name)))
        n_scales = self.blocks(out.numel()) * 4
        scales = packed[:n_scales].view(torch.float32)
        q = packed[n_scales : n_scales + out.numel()].view(torch.int8)
        return out.copy_(dequantize(scales, q, self.block))


WIRE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "int8": "int8"}  # an option's dtype -> its wire dtype


def packing_for(option: str | None, block: int = DEFAULT_BLOCK) -> Packing | None:
    """The packing an option names ("bf16", "fp16", "int8"; ``block`` elements per int8 scale), or None: the
    tensor's own bytes ("fp32", None)."""
    name = WIRE_NAMES.get(option or "")
    return None if name is None else Packing(name, block if name == "int8" else 0)


def quantize(x: Tensor, block: int) -> tuple[Tensor, Tensor]:
    """``x`` (1-D fp32) -> (scales: fp32, one per block of ``block`` elements; q: int8, like ``x``)."""
    n = x.numel()
    padded = torch.nn.functional.pad(x, (0, -n % block)).view(-1, block)  # blocks x block
    absmax = padded.abs().amax(dim=1)
    scales = absmax / LEVELS
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))  # a block of zeros divides by 1: zeros
    q = torch.round(padded / safe[:, None]).clamp_(-LEVELS, LEVELS)
    q = torch.where(torch.isfinite(scales)[:, None], q, torch.zeros_like(q))
    return torch.where(torch.isfinite(absmax), scales, torch.full_like(scales, float("nan"))), q.view(-1)[:n].to(
        torch.int8
    )


def dequantize(scales: Tensor, q: Tensor, block: int) -> Tensor:
    """``q * scale`` of its block: 1-D fp32, like ``q``."""
    n = q.numel()
    padded = torch.nn.functional.pad(q.float(), (0, -n % block)).view(-1, block)
    return (padded * scales[:, None]).view(-1)[:n]
