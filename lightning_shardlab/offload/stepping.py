"""One optimizer step, taken one flat parameter at a time.

With the state on disk, a step over every parameter at once would page all of it in together. Instead the
optimizer's own update runs once per flat parameter, its param groups narrowed to that flat parameter's master
views (hyperparameters, LR schedules and group order untouched), with ``around`` called before and after each
(the disk tier reads the next one ahead, settles new state into files, hands the pages back). For the
elementwise optimizers a sharded optimizer allows (sharding/optimizer.py) each element's update depends on
its own value, gradient and state alone, so the narrowed steps compute exactly what one step computes.

The sharded optimizer's step (sharding/optimizer.py) runs the closure, puts the master views in the param
groups, then calls ``_shardlab_update`` if the optimizer has one: here, this loop. The user's and Lightning's
step hooks therefore run once per step, and the closure once, before the first flat parameter. The chunks are
read from the param groups at every step, so a group added mid-run (``add_param_group``) is stepped as well.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.optim import Optimizer

from lightning_shardlab.sharding.flat_param import FlatParam

Around = Callable[[Optimizer, "Chunks", int], None]  # (optimizer, this step's chunks, chunk index)


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


def step_in_chunks(optimizer: Optimizer, flat_params: list[FlatParam], before: Around, after: Around) -> None:
    """From now on the sharded optimizer's update (sharding/optimizer.py: its param groups hold master views
    then) runs one chunk at a time; the chunks are taken from the param groups at each step, so a param group
    added mid-run is stepped too."""
    if getattr(optimizer, "_shardlab_sharded", None) is None:
        raise ValueError(f"{type(optimizer).__name__} is not a sharded optimizer. HINT: call shard_optimizer() first.")
    if "_shardlab_update" in optimizer.__dict__:
        raise ValueError(f"{type(optimizer).__name__} already steps in chunks (offload set up twice).")
    patched = optimizer.__dict__.get("step")  # an LR scheduler's wrapper calls the class's step: fine
    if patched is not None and not getattr(patched, "_wrapped_by_lr_sched", False):
        raise ValueError(
            f"{type(optimizer).__name__}.step was replaced on the optimizer itself ({patched!r}), so offload cannot"
            " step it one flat parameter at a time. HINT: wrap the optimizer's class instead, or use offload='none'."
        )

    def update(raw: Callable[[Optimizer], Any]) -> None:
        chunks = Chunks(optimizer, flat_params)
        step_by_chunk(
            optimizer, raw, chunks, lambda opt, i: before(opt, chunks, i), lambda opt, i: after(opt, chunks, i)
        )

    optimizer._shardlab_update = update  # type: ignore[attr-defined]
