"""One optimizer step, taken one flat parameter at a time.

With the state on disk, a step over every parameter at once would page all of it in together. Instead the
optimizer's own update runs once per flat parameter, its param groups narrowed to that flat parameter's master
views (hyperparameters, LR schedules and group order untouched), with ``around`` called before and after each
(the disk tier reads the next one ahead, settles new state into files, hands the pages back). For the
elementwise optimizers a sharded optimizer allows (sharding/optimizer.py) each element's update depends on
its own value, gradient and state alone, so the narrowed steps compute exactly what one step computes.

The optimizer's class is swapped, as torch's ``fully_shard`` swaps a module's, for a subclass whose ``step``
is torch's hooked step around this loop: the user's and Lightning's step hooks run once per step, as before,
and the closure (forward and backward) runs once, before the first flat parameter. An LR scheduler made in
``configure_optimizers`` has wrapped the old ``step`` on the instance; that wrapper is made again around the
new one (any other instance-level replacement is refused: it would bypass the chunks).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_shardlab.sharding.flat_param import FlatParam

Around = Callable[[Optimizer, int], None]  # (optimizer, chunk index): before or after that chunk's update


class Chunks:
    """The flat parameters of one optimizer, in layout order, with the master views each contributes."""

    def __init__(self, optimizer: Optimizer, flat_params: list[FlatParam]) -> None:
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        self.members: list[tuple[FlatParam, list[nn.Parameter]]] = []
        for fp in flat_params:
            views = [v for v in fp.master_params if id(v) in held]
            if views:
                self.members.append((fp, views))

    def __len__(self) -> int:
        return len(self.members)


def step_by_chunk(
    optimizer: Optimizer, raw_step: Callable[[Optimizer], Any], chunks: Chunks, before: Around, after: Around
) -> None:
    """Run ``raw_step`` (the optimizer class's update, without hooks) once per chunk of ``chunks``."""
    groups = optimizer.param_groups
    saved = [group["params"] for group in groups]
    where = {id(v): i for i, (_, views) in enumerate(chunks.members) for v in views}
    parts: list[list[list[nn.Parameter]]] = [[[] for _ in groups] for _ in chunks.members]
    for g, params in enumerate(saved):
        for p in params:
            if id(p) not in where:  # added after setup (add_param_group): stepping the chunks would skip it
                raise ValueError(
                    f"param group {g} of {type(optimizer).__name__} holds a tensor of shape {tuple(p.shape)} that was"
                    " not there when offload was set up, so it would not be stepped. HINT: create every param"
                    " group in configure_optimizers() (before training), or use offload='none'."
                )
            parts[where[id(p)]][g].append(p)
    try:
        for i in range(len(chunks)):
            before(optimizer, i)
            narrowed = []
            for group, params in zip(groups, parts[i]):
                if params:
                    group["params"] = params
                    narrowed.append(group)
            optimizer.param_groups = narrowed
            raw_step(optimizer)
            after(optimizer, i)
    finally:
        optimizer.param_groups = groups
        for group, params in zip(groups, saved):
            group["params"] = params


def step_in_chunks(optimizer: Optimizer, chunks: Chunks, before: Around, after: Around) -> None:
    """From now on ``optimizer.step`` updates one chunk at a time (its class becomes ``Chunked<Class>``)."""
    cls = type(optimizer)
    if getattr(cls, "_shardlab_chunked", False):
        raise ValueError(f"{cls.__name__} already steps in chunks (offload set up twice).")
    hooked = cls.step
    raw = hooked.__wrapped__ if getattr(hooked, "hooked", False) else hooked  # the update, without the hooks

    def chunked(self: Optimizer, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        step_by_chunk(self, raw, chunks, before, after)
        return loss

    step = Optimizer.profile_hook_step(chunked)
    step.hooked = True  # type: ignore[attr-defined]
    patched = optimizer.__dict__.get("step")  # an LR scheduler made in configure_optimizers wraps the old step
    if patched is not None and not getattr(patched, "_wrapped_by_lr_sched", False):
        raise ValueError(
            f"{cls.__name__}.step was replaced on the optimizer itself ({patched!r}), so offload cannot step it one"
            " flat parameter at a time. HINT: wrap the optimizer's class instead, or use offload='none'."
        )
    optimizer.__class__ = type(f"Chunked{cls.__name__}", (cls,), {"step": step, "_shardlab_chunked": True})
    if patched is not None:
        optimizer.step = _noting_the_call(optimizer)  # type: ignore[method-assign]


def _noting_the_call(optimizer: Optimizer) -> Callable[..., Any]:
    """What torch's LR schedulers put on the instance (they warn if the optimizer was not stepped before them),
    around the chunked step."""
    ref = weakref.ref(optimizer)

    @functools.wraps(type(optimizer).step)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        opt = ref()
        assert opt is not None
        opt._opt_called = True  # type: ignore[attr-defined]
        return type(opt).step(opt, *args, **kwargs)

    wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    return wrapper
