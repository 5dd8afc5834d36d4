"""The grad shard's life cycle: accumulate reductions, show them to the optimizer, notice zero_grad.

A flat parameter's grad shard (1-D, S, grad dtype) accumulates every reduce-scatter result since the
user last cleared the gradients. The optimizer sees it through the master views' ``.grad``:

- fp32 training: views of the grad shard itself (no copy);
- mixed precision (or a master in host memory, offload='cpu'): views of ``master_grad``, an fp32 copy
  beside the master, made when the gradients are shown and dropped after the optimizer's step, so between
  steps only the 2-byte grad shard stays (DeepSpeed's ledger: 2 B compute copy + 2 B gradient + 4 B
  master + 8 B moments).

The user sees it through each parameter's ``.grad``: a stand-in for the whole gradient that reads and writes these
slices (sharding/shard_reads.py, set by the sharded model right after ``show``, taken off before the next backward).
The user clears gradients with the optimizer's (or the module's) ``zero_grad``, which the sharded optimizer
passes on to the master views (sharding/optimizer.py): they are set to None, or zeroed; a ``.grad`` set to None or
replaced reaches them before the next backward or step (``ShardReads.settle``).
Nothing here communicates.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_shardlab.sharding.flat_param import FlatParam


def _slices(fp: FlatParam):  # noqa: ANN202
    for slot, master in zip(fp.layout.slots, fp.master_params):
        lo, hi = fp.layout.slot_in_shard(slot, fp.rank)
        yield master, lo, hi


def accumulate(fp: FlatParam, new: Tensor) -> None:
    """grad shard += ``new`` (1-D, S, a reduce-scatter result), honouring what the user did since the last
    ``show``: 1. drop parameters frozen now (their gradient is not wanted)  2. start afresh if every gradient
    was cleared  3. otherwise take the shown values back (the user may have zeroed or clipped them), zeroing
    cleared slices."""
    for param, (_, lo, hi) in zip(fp.params, _slices(fp)):
        if not param.requires_grad:
            new[lo:hi].zero_()
    if fp.grad_shard is None:
        fp.grad_shard = new.to(fp.grad_dtype)
        return
    if fp.grads_shown:
        fp.grads_shown = False
        visible = [m for m, lo, hi in _slices(fp) if hi > lo]
        if all(m.grad is None for m in visible):
            fp.grad_shard = new.to(fp.grad_dtype)
            fp.master_grad = None
            return
        if fp.master_grad is not None:  # mixed precision: what the optimizer saw is the truth now
            fp.grad_shard.copy_(fp.master_grad)
        for master, lo, hi in _slices(fp):
            if hi > lo and master.grad is None:
                fp.grad_shard[lo:hi].zero_()
    fp.grad_shard.add_(new)


def show(fp: FlatParam, used: Tensor) -> None:
    """Point each used, trainable parameter's master view ``.grad`` at its slice of the gradient."""
    assert fp.grad_shard is not None, f"{fp.layout.name} has no grad shard"
    source = fp.grad_shard
    if fp.grad_dtype != fp.master.dtype or fp.grad_shard.device != fp.master.device:
        # 1-D, S: the optimizer's fp32 view (in host memory when the master is offloaded there), until its step
        fp.master_grad = torch.empty_like(fp.master, pin_memory=fp.master.is_pinned()).copy_(fp.grad_shard)
        source = fp.master_grad
    for i, (param, (master, lo, hi)) in enumerate(zip(fp.params, _slices(fp))):
        if used[i] and param.requires_grad:  # not frozen by the user, e.g. toggle_optimizer()
            if master.grad is None or master.grad.data_ptr() != source[lo:hi].data_ptr():
                master.grad = source[lo:hi]
    fp.grads_shown = True


def release(fp: FlatParam, stepped: set[int] | None = None) -> None:
    """After an optimizer step in mixed precision: the master views of the parameters it stepped (ids of the
    original params; None: all) let go of their fp32 gradient, and the fp32 copy is dropped once no view shows
    it. Another optimizer over other parameters of the same flat parameter (Muon beside AdamW, after one
    backward) may step next: its views keep theirs."""
    if fp.master_grad is None:
        return
    shown = False
    for param, (master, lo, hi) in zip(fp.params, _slices(fp)):
        if master.grad is None or master.grad.data_ptr() != fp.master_grad[lo:hi].data_ptr():
            continue
        if stepped is None or id(param) in stepped:
            master.grad = None
        elif hi > lo:
            shown = True
    if not shown:
        fp.master_grad = None


def flat_grad(fp: FlatParam) -> Tensor:
    """The original params' grads laid out like ``full`` in the reduce dtype; zeros where a parameter got
    none, and for padding. 1-D, padded_numel. The input of the reduce-scatter."""
    parts = []
    for slot, param in zip(fp.layout.slots, fp.params):
        grad = param.grad
        parts.append(grad.reshape(-1) if grad is not None else fp.full.new_zeros(slot.numel))
    if fp.layout.padding:
        parts.append(fp.full.new_zeros(fp.layout.padding))
    flat = torch.cat(parts) if len(parts) > 1 else parts[0]
    return flat.to(fp.reduce_dtype)
