"""The hooks that drive a unit through a step, installed with torch's public hook APIs.

    forward pre-hook    unshard; wrap the inputs so their backward announces the unit's post-backward
    forward hook        reshard (stage 3; or regroup); hook the outputs so their first gradient announces pre-backward
    pre-backward        (first gradient reaching an output) unshard again, queue the end-of-backward callback
    post-backward       (gradient reaching the inputs) reduce-scatter the unit's gradients, reshard
    end of backward     finish every unit that got no post-backward, wait for reductions, attach grads

The decisions (when to reduce, when to reshard) live in ``ShardedModel``; these functions only route
the events to it. A bucket (a unit of several blocks, sharding/policy.py) is hooked on each block: its
pre-forward is announced by the first block to run, its post-forward by the last, and its post-backward once
the gradients have reached the inputs of every block (counted: ``Unit.forwarded``,
``Unit.awaiting_post_backward``).
"""

from __future__ import annotations

import functools
from typing import Any, Protocol

import torch
from torch import Tensor
from torch.autograd import Variable
from torch.autograd.graph import register_multi_grad_hook
from torch.utils import _pytree as pytree

from lightning_shardlab.comm.labels import phase
from lightning_shardlab.sharding.unit import TrainingState, Unit


class Events(Protocol):
    def pre_forward(self, unit: Unit) -> None: ...
    def pre_backward(self, unit: Unit) -> None: ...
    def post_backward(self, unit: Unit) -> None: ...
    def post_forward(self, unit: Unit) -> None: ...


class PostBackward(torch.autograd.Function):
    """Identity on the unit's inputs; its backward runs once the unit's whole backward has run.

    Autograd runs a node after every node that produces its inputs' gradients, and runs the
    parameters' AccumulateGrad nodes first, so by then every gradient of the unit has landed.
    """

    @staticmethod
    def forward(ctx: Any, callback: Any, *inputs: Tensor) -> tuple[Tensor, ...]:
        ctx.callback = callback
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Any, ...]:
        ctx.callback()
        return (None, *grads)


class EndOfBackward:
    """Queues ``finish`` to run once, when the autograd engine finishes the current backward."""

    def __init__(self, finish: Any) -> None:
        self._finish = finish
        self.queued = False

    def queue(self) -> None:
        if not self.queued:
            self.queued = True
            Variable._execution_engine.queue_callback(self._run)

    def _run(self) -> None:
        self.queued = False
        self._finish()


def install(events: Events, unit: Unit) -> list[Any]:
    """Hook each module of ``unit``; returns the handles (``handle.remove()`` undoes it)."""
    handles = []
    for module in unit.modules:
        handles.append(
            module.register_forward_pre_hook(functools.partial(_pre_forward, events, unit), with_kwargs=True)
        )
        handles.append(module.register_forward_hook(functools.partial(_post_forward, events, unit)))
    return handles


def installed_by_engine(hook: Any) -> bool:
    """Whether ``hook`` (in a module's forward hooks or pre-hooks) is one that ``install`` put there. A copy of a
    sharded module made to be traced (budget/predicted/first_batch.py's ``meta_clone``) leaves them out:
    they drive the live ``ShardedModel``, whose gathers would run on the copy's fake tensors."""
    return isinstance(hook, functools.partial) and hook.func in (_pre_forward, _post_forward)


def hook_pre_backward(events: Events, unit: Unit, tensors: Any) -> None:
    """Announce ``unit``'s pre-backward when the first gradient reaches any tensor in ``tensors``."""
    leaves = [t for t in pytree.tree_leaves(tensors) if isinstance(t, Tensor) and t.requires_grad]
    if leaves:
        register_multi_grad_hook(leaves, lambda _grad: events.pre_backward(unit), mode="any")


@torch._dynamo.disable  # the engine's bookkeeping runs eagerly: a compiled module's graph breaks around it
def _pre_forward(events: Events, unit: Unit, module: Any, args: tuple, kwargs: dict) -> Any:
    if (
        unit.training is TrainingState.BACKWARD
    ):  # forward recomputed inside backward (activation checkpointing): already gathered
        return None
    if unit.forwarded == 0:  # the first block of a bucket to run (a unit of one module: every time)
        with phase("pre_forward", unit.name):
            events.pre_forward(unit)
    if unit.is_root or not (torch.is_grad_enabled() and unit.grad_flat_params):
        return None  # the root's post-backward runs at the end of backward: its params serve the whole step
    flat, spec = pytree.tree_flatten((args, kwargs))
    idx = [i for i, t in enumerate(flat) if isinstance(t, Tensor) and t.requires_grad]
    unit.awaiting_post_backward += 1  # a block with no such input never announces it: the end of backward does
    if not idx:
        return None  # nothing upstream needs gradients: the end-of-backward callback finishes this unit
    outs = PostBackward.apply(lambda: _block_post_backward(events, unit), *(flat[i] for i in idx))
    for i, out in zip(idx, outs):
        flat[i] = out
    return pytree.tree_unflatten(flat, spec)


def _block_post_backward(events: Events, unit: Unit) -> None:
    """The gradient reached one block's inputs: the unit's post-backward once it has reached all of them."""
    unit.awaiting_post_backward -= 1
    if unit.awaiting_post_backward <= 0:
        events.post_backward(unit)


@torch._dynamo.disable
def _post_forward(events: Events, unit: Unit, module: Any, args: tuple, output: Any) -> None:
    if unit.training is TrainingState.BACKWARD:
        return
    unit.forwarded += 1
    if unit.forwarded >= len(unit.modules):  # the bucket's last block (a unit of one module: every time)
        unit.forwarded = 0
        with phase("post_forward", unit.name):
            events.post_forward(unit)
    if torch.is_grad_enabled():
        hook_pre_backward(events, unit, output)
