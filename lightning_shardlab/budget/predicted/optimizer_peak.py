"""The optimizer step's peak predicted: what the run's own optimizers allocate while they step this rank's masters.

An instance of each optimizer's own class, with its groups' options, steps fakes of its master views (1-D views of
the master shards, sharding/optimizer.py) under ``FakeTensorMode``: once to make the state, as the run's first step
did, then again with every storage watched (step_timeline.py's ``LiveStorages``): the largest total is the step's
temporaries. Where a group leaves ``foreach`` to torch, the real masters decide it. Beside the update: mixed
precision's fp32 grad copies; after it, at stages 1-2, the refresh's receive rooms (gloo). Offloaded on a GPU, the
masters step in host memory: none of it on the device. A plan steps torch's class its ``--optimizer`` names on the
multi-tensor path. A whole-tensor optimizer (Muon, Adafactor) is not predicted here, and says so.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.optim import Optimizer
from torch.optim.optimizer import _default_to_fused_or_foreach

from lightning_shardlab.budget.predicted.engine_schedule import Rooms, no_rooms
from lightning_shardlab.budget.predicted.step_timeline import LiveStorages
from lightning_shardlab.core.config import Stage
from lightning_shardlab.sharding.flat_param import FlatParamLayout
from lightning_shardlab.sharding.optimizer import STATE_TENSORS
from lightning_shardlab.sharding.sharded_model import ShardedModel


def optimizer_step_bytes(optimizers: list[Optimizer], sharded: ShardedModel) -> int | dict[str, str]:
    """Bytes beyond the model state at the busiest moment of an optimizer step: the largest of ``optimizers``'
    updates, or the refresh's receive rooms after them (the update's temporaries are gone by then); ``{"error":
    why}`` when it cannot be predicted."""
    if any(getattr(opt, "_shardlab_whole", False) for opt in optimizers):
        return {"error": "a whole-tensor optimizer's step (exchanges around the update) is not predicted"}
    masters = sharded.masters_by_id()
    on_host = sharded.config.offload != "none" and sharded.comm.device.type != "cpu"
    try:  # offloaded masters step in host memory: none of it on the device
        made = 0 if on_host else max((_stepped(opt, masters) for opt in optimizers), default=0)
    except Exception as err:  # noqa: BLE001 - a prediction says why it is missing; it never stops the run
        return {"error": f"{type(err).__name__}: {err}"}
    wire = sharded.mesh.shard.wire
    return max(
        made + master_grads(sharded), refresh_rooms(sharded, wire.receive_room if wire is not None else no_rooms)
    )


def master_grads(sharded: ShardedModel) -> int:
    """Mixed precision: the fp32 copies of the grad shards the optimizer reads (sharding/gradients.py ``show``),
    made at the end of backward and dropped after the step; none in fp32, where it reads the grad shard itself."""
    return sum(
        fp.master.numel() * fp.master.element_size()
        for fp in sharded.flat_params
        if fp.grad_dtype != fp.master.dtype or fp.master.device != sharded.comm.device
    )


def refresh_rooms(sharded: ShardedModel, rooms: Rooms) -> int:
    """Stages 1-2: the receive rooms of every resident full buffer's all-gather after a step, in flight at once."""
    if sharded.config.stage is Stage.PARAMETERS:
        return 0
    return sum(
        rooms("all_gather", fp.layout.shard_numel * fp.full.element_size())
        for fp in sharded.flat_params
        if fp.layout.world_size > 1
    )


def planned_optimizer(name: str, foreach: bool) -> tuple[type[Optimizer] | None, dict[str, Any]]:
    """(torch's elementwise class ``name`` names in any case, 'adamw', 'sgd', else None; the options a plan steps it
    with: SGD with momentum, as the plan's state counts it)."""
    key = {n.lower(): n for n in STATE_TENSORS}.get(name.lower())
    cls = getattr(torch.optim, key) if key is not None else None
    return cls, {"foreach": foreach, **({"momentum": 0.9} if cls is torch.optim.SGD else {})}


def planned_step_temporaries(name: str, layouts: list[FlatParamLayout], mixed: bool) -> int:
    """A plan's optimizer step (``--optimizer NAME``) over the trained flat parameters' shards, one 1-D master each,
    on the multi-tensor path, with ``mixed`` precision's fp32 gradient copies; 0 for a whole-tensor optimizer."""
    cls, options = planned_optimizer(name, foreach=True)
    if cls is None:
        return 0
    shapes = [(torch.Size([lay.shard_numel]), lay.dtype) for lay in layouts if lay.requires_grad]
    copies = sum(lay.shard_numel * lay.dtype.itemsize for lay in layouts if lay.requires_grad) if mixed else 0
    return step_temporaries(cls, [(options, shapes)]) + copies if shapes else 0


Group = tuple[dict[str, Any], list[tuple[torch.Size, torch.dtype]]]  # (a param group's options, its params' shapes)


def _stepped(optimizer: Optimizer, masters: dict[int, nn.Parameter]) -> int:
    """The most bytes ``optimizer``'s class makes at once in its second step over fakes of ``masters``."""
    cls = next(c for c in type(optimizer).__mro__ if "_shardlab_sharded" not in c.__dict__)
    groups = []
    for group in optimizer.param_groups:
        real = [masters.get(id(p), p) for p in group["params"]]
        options = {k: v for k, v in group.items() if k != "params"}
        if options.get("foreach") is None and "foreach" in options:
            options["foreach"] = _default_to_fused_or_foreach(real, differentiable=False, use_fused=False)[1]
        groups.append((options, [(m.shape, m.dtype) for m in real]))
    return step_temporaries(cls, groups)


@contextmanager
def second_step(cls: type[Optimizer], groups: list[Group]) -> Iterator[tuple[Optimizer, list[Tensor]]]:
    """An optimizer of class ``cls`` over fake parameters of ``groups``' shapes and dtypes (and fake gradients),
    stepped once to make its state, as a run's first step did. Inside the fake mode: it, and every tensor it holds
    (parameters, gradients, state), for the body to step it again."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake_groups, state = [], []
    with mode:
        for options, shapes in groups:
            fakes = [nn.Parameter(torch.empty(shape, dtype=dtype, device="cpu")) for shape, dtype in shapes]
            for fake in fakes:
                fake.grad = torch.zeros_like(fake)
            fake_groups.append({**options, "params": fakes})
            state += [t for fake in fakes for t in (fake, fake.grad)]
    stand_in = cls(fake_groups)
    with mode:
        stand_in.step()
        state += [v for s in stand_in.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        yield stand_in, state


def step_temporaries(cls: type[Optimizer], groups: list[Group]) -> int:
    """The most bytes an optimizer of class ``cls`` makes at once in its second step over fake parameters of
    ``groups``' shapes and dtypes."""
    peak = 0

    def sample(*_: Any, **__: Any) -> None:
        nonlocal peak
        peak = max(peak, live.total)

    with second_step(cls, groups) as (stand_in, state), LiveStorages(sample, state) as live:
        stand_in.step()
    return peak
