"""The sharded optimizer: the user's optimizer, made to update only this rank's master shard.

``configure_optimizers`` runs unchanged and sees the module's parameters; its param groups keep holding them
(one identity: Lightning's finetuning callbacks, ``toggle_optimizer`` and users map them to names and back).
``shard_optimizer`` swaps the optimizer's class, as torch's ``fully_shard`` swaps a module's, for a subclass
of the user's class under the user's own name (``sharded_class``: ``LearningRateMonitor`` still logs
``lr-AdamW``), whose methods map each original param to its master view (sharding/flat_param.py):

    step               runs the closure (forward and backward), then, for the update alone, puts the master
                       views in the param groups and the optimizer's state beside them (``masters_in_place``),
                       and runs the class's own update; the state goes back beside the original params
    zero_grad          clears the original params' gradients (kept unreduced inside ``no_sync``, or the stand-ins
                       of the reduced gradients: sharding/shard_reads.py) and the master views' (the gradient shards)
    add_param_group    takes any parameter of the sharded module (``BaseFinetuning`` unfreezes and adds them
                       mid-run), and refuses anything else at once
    load_state_dict    loads beside the master views, so state keeps their dtype and device

A step on a slice equals the slice of a full step only when the update of each element depends on that
element alone. Optimizers whose update reads the whole parameter (Muon, Adafactor, and the classes of the
``whole_tensor_optimizers`` option) step whole parameters instead, each on its owner rank
(sharding/whole_step.py): the same methods, with ``whole_tensors_in_place`` in place of ``masters_in_place``.
So does a class shardlab does not know (a subclass of SGD whose ``step`` checks something and calls
``super().step()``, a class of the user's own): stepped whole, its update is exact whatever it reads of a
parameter, at the cost of two all-to-alls per step; rank 0 says once how to declare it elementwise, for speed.
What no owner rank can make exact (LBFGS, SparseAdam, ZeroRedundancyOptimizer) is refused, naming why
(sharding/refused_optimizers.py).
"""

from __future__ import annotations

import functools
import math
import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_shardlab.comm import collectives
from lightning_shardlab.comm.collectives import Comm
from lightning_shardlab.core.config import class_path
from lightning_shardlab.sharding.refused_optimizers import refusal, wrapped_by
from lightning_shardlab.sharding.sharded_model import ShardedModel
from lightning_shardlab.sharding.stand_ins import standing_in
from lightning_shardlab.sharding.whole_step import plan_of, state_placeholder, whole_tensors_in_place

ELEMENTWISE: tuple[type[Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Rprop,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.ASGD,
)

WHOLE_TENSOR: tuple[type[Optimizer], ...] = (torch.optim.Muon, torch.optim.Adafactor)


# per-element optimizer state tensors of torch's elementwise optimizers (before hyperparameter extras)
STATE_TENSORS = {
    "SGD": 0,
    "Adam": 2,
    "AdamW": 2,
    "Adamax": 2,
    "NAdam": 2,
    "RAdam": 2,
    "Adadelta": 2,
    "Adagrad": 1,
    "RMSprop": 1,
    "Rprop": 2,
    "ASGD": 1,
}
SCALAR_STATE_BYTES = {
    "Adam": 4,
    "AdamW": 4,
    "Adamax": 4,
    "NAdam": 8,
    "RAdam": 4,
    "Adadelta": 4,
    "Adagrad": 4,
    "RMSprop": 4,
    "Rprop": 4,
    "ASGD": 12,
}  # 'step' (and NAdam's mu_product, ASGD's eta, mu)


@dataclass(frozen=True)
class OptimizerShape:
    """How much state an optimizer keeps: tensors per element, and scalar bytes per parameter tensor."""

    per_element: int = 2
    scalar_bytes: int = 4

    @staticmethod
    def of(optimizer: torch.optim.Optimizer) -> OptimizerShape:
        # the first known class up the hierarchy (offload steps a ``Chunked<Class>`` subclass, offload/stepping.py)
        name = next(
            (c.__name__ for c in type(optimizer).__mro__ if c.__name__ in STATE_TENSORS), type(optimizer).__name__
        )
        group = optimizer.param_groups[0] if optimizer.param_groups else {}
        extra = int(bool(group.get("amsgrad"))) + int(group.get("momentum", 0) != 0 and name == "RMSprop")
        extra += int(bool(group.get("centered")))
        per = STATE_TENSORS.get(name, 2) + extra
        if name == "SGD":
            per = int(group.get("momentum", 0) != 0)
        return OptimizerShape(per, SCALAR_STATE_BYTES.get(name, 0))

    @staticmethod
    def named(name: str) -> OptimizerShape:
        """An elementwise optimizer's shape by its name ('adamw', 'sgd', ...); ``ValueError`` for any other (a
        whole-tensor optimizer's state is per parameter: budget/predicted/whole_tensor.py)."""
        key = {n.lower(): n for n in STATE_TENSORS}.get(name.lower())
        if key is None:
            known = ", ".join(sorted([*map(str.lower, STATE_TENSORS), *WHOLE_TENSOR_NAMES]))
            raise ValueError(f"--optimizer {name!r} is not known. HINT: one of {known}.")
        return OptimizerShape(STATE_TENSORS[key] if key != "SGD" else 1, SCALAR_STATE_BYTES.get(key, 0))


WHOLE_TENSOR_NAMES = {cls.__name__.lower(): cls for cls in WHOLE_TENSOR}  # 'muon', 'adafactor'


def whole_tensor_class(name: str) -> type[Optimizer] | None:
    """The whole-tensor optimizer class named ``name`` (any case: 'muon', 'adafactor'), else None."""
    return WHOLE_TENSOR_NAMES.get(name.lower())


def is_per_element(key: str, value: Any, shape: torch.Size | None) -> bool:
    """Whether optimizer state ``key`` holds one value per element of its parameter (of ``shape``: the full
    parameter's, or its master view's): a tensor of the parameter's shape other than the step counter. Both
    checkpoint formats slice and gather exactly these; everything else is per-parameter and replicated."""
    return isinstance(value, Tensor) and key != "step" and value.shape == shape


def check_optimizer(
    optimizer: Optimizer,
    elementwise: tuple[type[Optimizer], ...] = (),
    whole: tuple[type[Optimizer], ...] = (),
    rank: int = 0,
) -> str:
    """How ``optimizer`` steps: 'elementwise' (this rank's shard), 'whole' (known to read whole parameters: on
    their owners) or 'unknown' (on the owners too, exact for any update; ``announce_unknown`` says so).
    ``ValueError`` naming why for what cannot be made exact (``elementwise``, ``whole``: the classes of the options
    of those names, which take precedence over what is known of their bases)."""
    cls = type(optimizer)
    error = refusal(cls, rank, wrapped_by(optimizer))
    if error is not None:
        raise error
    if cls in ELEMENTWISE + tuple(elementwise):
        return "elementwise"
    if cls in WHOLE_TENSOR + tuple(whole):
        return "whole"
    for known, kind in ((ELEMENTWISE, "elementwise"), (WHOLE_TENSOR, "whole")):
        base = next((b for b in known if issubclass(cls, b)), None)
        if base is not None and _update_of(cls) is _update_of(base):
            return kind  # a subclass that keeps its base's update (e.g. adds logging)
    return "unknown"


def _update_of(cls: type[Optimizer]) -> Callable[..., Any]:
    """The class's own update: its ``step`` without the profiling hooks torch wraps it in when the first instance
    of a class that does not define ``step`` itself is made (then the subclass's ``step`` is a new wrapper)."""
    step = cls.step
    while getattr(step, "hooked", False):
        step = step.__wrapped__
    return step


_ANNOUNCED: weakref.WeakKeyDictionary[ShardedModel, set[type]] = weakref.WeakKeyDictionary()


def announce_unknown(cls: type[Optimizer], sharded: ShardedModel) -> None:
    """Rank 0, once per class and sharded model: an unknown optimizer steps whole parameters, exact, and the
    option that steps shards instead (no exchanges) if its update is elementwise."""
    announced = _ANNOUNCED.setdefault(sharded, set())
    if cls in announced or sharded.mesh.world.rank != 0:
        return
    announced.add(cls)
    warnings.warn(
        f"[rank 0] {cls.__name__} is not known to update elementwise, so each parameter it steps is stepped whole on"
        " one owner rank (exact for any update; each step exchanges gradients and values). HINT: if each element's"
        " update depends only on its own value, gradient and state, pass"
        f" elementwise_optimizers=['{class_path(cls)}'] to step shards with no exchange.",
        stacklevel=3,
    )


def is_whole_tensor(optimizer: Optimizer) -> bool:
    """Whether a sharded optimizer steps whole parameters on their owners (its state is kept whole there)."""
    return bool(getattr(optimizer, "_shardlab_whole", False))


def state_shape(optimizer: Optimizer, shape: torch.Size) -> torch.Size | None:
    """The shape per-element state has, for ``is_per_element``: None for a whole-tensor optimizer, whose state
    is held whole by each parameter's owner (checkpoints keep it as per-parameter state)."""
    return None if is_whole_tensor(optimizer) else shape


def shard_optimizer(optimizer: Optimizer, sharded: ShardedModel) -> None:
    """Make ``optimizer`` step this rank's master shards (every rank, same param groups), in place."""
    if getattr(optimizer, "_shardlab_sharded", None) is sharded:
        return  # set up already (Fabric's setup_optimizers after setup)
    config, rank = sharded.config, sharded.mesh.world.rank
    if getattr(optimizer, "_shardlab_sharded", None) is not None:  # its step is the engine's: none of the user's
        raise ValueError(
            f"[rank {rank}] {type(optimizer).__name__} steps the shards of another sharded model already."
            " HINT: create a new optimizer over this model's parameters (in configure_optimizers())."
        )
    kind = check_optimizer(optimizer, config.elementwise_optimizers, config.whole_tensor_optimizers, rank)
    whole = kind != "elementwise"
    if whole and config.offload != "none":
        raise ValueError(_whole_offload_message(type(optimizer), kind, config.offload, rank))
    if optimizer.state:
        raise ValueError(
            f"{type(optimizer).__name__} already has state, so it was stepped before sharding."
            " HINT: create optimizers in configure_optimizers()."
        )
    for index, group in enumerate(optimizer.param_groups):
        _check_params(optimizer, sharded, group["params"], f"param group {index}")
    if kind == "unknown":
        announce_unknown(type(optimizer), sharded)
    optimizer.__class__ = sharded_class(type(optimizer), _sharded_methods(type(optimizer), sharded, whole))
    _rewrap_lr_scheduler(optimizer)
    optimizer.register_step_post_hook(_after_step(sharded))


def _whole_offload_message(cls: type[Optimizer], kind: str, offload: str, rank: int) -> str:
    if kind == "unknown":
        return (
            f"[rank {rank}] {cls.__name__} is not known to update elementwise, so it steps whole parameters on their"
            f" owner ranks, which is not built for offload={offload!r}. HINT: if its update is elementwise, pass"
            f" elementwise_optimizers=['{class_path(cls)}'] (offload then steps its shards); otherwise use"
            " offload='none'."
        )
    return (
        f"[rank {rank}] {cls.__name__} steps whole parameters on their owner ranks, which is not built for"
        f" offload={offload!r}. HINT: use offload='none' with whole-tensor optimizers."
    )


def _after_step(sharded: ShardedModel) -> Callable[[Optimizer, Any, Any], None]:
    """The post-step hook: the compute copies follow the stepped masters. Not while the class's own update runs: a
    subclass's ``step`` that calls ``super().step()`` runs the base's hooked step, and so this hook, inside it."""

    def hook(optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        if not getattr(optimizer, "_shardlab_updating", False):
            originals = _originals(optimizer)
            sharded.after_optimizer_step(sharded.flat_params_of(originals), {id(p) for p in originals})

    return hook


def sharded_class(cls: type[Optimizer], methods: dict[str, Any]) -> type[Optimizer]:
    """A subclass of ``cls`` with the sharded methods that keeps the user's name, qualname and module: what
    ``LearningRateMonitor`` (``lr-AdamW``), dashboards, ``repr`` and ``type(optimizer).__name__`` read stays the
    user's class, and ``isinstance(optimizer, cls)`` holds. ``is_sharded_optimizer`` tells them apart."""
    names = {"__name__": cls.__name__, "__qualname__": cls.__qualname__, "__module__": cls.__module__}
    return type(cls.__name__, (cls,), {**methods, **names, "__doc__": cls.__doc__})


def is_sharded_optimizer(optimizer: Optimizer) -> bool:
    return "_shardlab_sharded" in type(optimizer).__dict__


def _check_params(optimizer: Optimizer, sharded: ShardedModel, params: list[Tensor], where: str) -> None:
    known = sharded.master_params_by_id()
    for param in params:
        if id(param) not in known:
            raise ValueError(
                f"{where} of {type(optimizer).__name__} holds a tensor of shape {tuple(param.shape)} that is not a"
                f" parameter of the sharded {type(sharded.module).__name__}. HINT: build optimizers from"
                " self.parameters() (or named_parameters()) of the LightningModule, and add param groups of its"
                " parameters only."
            )


def _originals(optimizer: Optimizer) -> list[Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _sharded_methods(cls: type[Optimizer], sharded: ShardedModel, whole: bool) -> dict[str, Any]:
    raw = _update_of(cls)  # the update, without the hooks
    in_place = whole_tensors_in_place if whole else masters_in_place

    def step(self: Optimizer, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if sharded.comm.clock is not None:
            sharded.comm.clock.phase("optimizer")
        sharded.reads.settle()  # a .grad the user set to None (module.zero_grad()) or replaced since backward
        with in_place(self, sharded), _updating(self):
            update = getattr(self, "_shardlab_update", None)  # offload='disk' steps one flat parameter at a time
            update(raw) if update is not None else raw(self)
        return loss

    def zero_grad(self: Optimizer, set_to_none: bool = True) -> None:
        cls.zero_grad(self, set_to_none)
        for master in sharded.masters(_originals(self)):
            if master.grad is not None:
                if set_to_none:
                    master.grad = None
                else:
                    master.grad.zero_()

    def add_param_group(self: Optimizer, param_group: dict[str, Any]) -> None:
        params = param_group["params"]
        params = [params] if isinstance(params, Tensor) else list(params)
        _check_params(self, sharded, params, "the added param group")
        cls.add_param_group(self, param_group)

    def load_state_dict(self: Optimizer, state_dict: dict[str, Any]) -> None:
        with (placeholders_in_place if whole else masters_in_place)(self, sharded):
            cls.load_state_dict(self, state_dict)

    hooked_step = Optimizer.profile_hook_step(step)
    hooked_step.hooked = True  # type: ignore[attr-defined]
    return {
        "step": hooked_step,
        "zero_grad": zero_grad,
        "add_param_group": add_param_group,
        "load_state_dict": load_state_dict,
        "_shardlab_sharded": sharded,
        "_shardlab_whole": whole,
    }


@contextmanager
def _updating(optimizer: Optimizer) -> Iterator[None]:
    """For the block the class's own update runs: the post-step hook waits for the sharded step's end."""
    optimizer._shardlab_updating = True  # type: ignore[attr-defined]
    try:
        yield
    finally:
        optimizer._shardlab_updating = False  # type: ignore[attr-defined]


@contextmanager
def masters_in_place(optimizer: Optimizer, sharded: ShardedModel) -> Iterator[None]:
    """For the block: ``optimizer``'s param groups hold the master views of their original params, and its
    state is keyed by them (what the class's own update reads and writes); then both go back."""
    with standing_in(optimizer, sharded.masters_by_id()):
        yield


@contextmanager
def placeholders_in_place(optimizer: Optimizer, sharded: ShardedModel) -> Iterator[None]:
    """For a whole-tensor optimizer's load: its param groups hold memoryless tensors of each parameter's whole
    shape in the master's dtype and device (what loaded state is cast to); afterwards this rank keeps the state
    of the parameters it owns only."""
    plan = plan_of(optimizer, sharded)
    stand_ins = {id(p): state_placeholder(p, plan) for p in plan.params}
    back = {id(stand_ins[id(p)]): p for p in plan.params}
    for group in optimizer.param_groups:
        group["params"] = [stand_ins.get(id(p), p) for p in group["params"]]
    try:
        yield
    finally:
        for group in optimizer.param_groups:
            group["params"] = [back.get(id(t), t) for t in group["params"]]
        for p in plan.params:
            t = stand_ins[id(p)]
            if t in optimizer.state:
                state = optimizer.state.pop(t)
                if plan.owns(p):
                    optimizer.state[p] = state


def _rewrap_lr_scheduler(optimizer: Optimizer) -> None:
    """An LR scheduler made in ``configure_optimizers`` wrapped the old class's ``step`` on the instance (torch
    notes that the optimizer stepped before it): made again around the new class's step."""
    patched = optimizer.__dict__.get("step")
    if patched is None:
        return
    if not getattr(patched, "_wrapped_by_lr_sched", False):
        raise ValueError(
            f"{type(optimizer).__name__}.step was replaced on the optimizer itself ({patched!r}), so the sharded"
            " step would be bypassed. HINT: wrap the optimizer's class instead."
        )
    optimizer.step = noting_the_call(optimizer)  # type: ignore[method-assign]


def noting_the_call(optimizer: Optimizer) -> Callable[..., Any]:
    """What torch's LR schedulers put on the instance (they warn if the optimizer was not stepped before them),
    around the class's current step."""
    ref = weakref.ref(optimizer)

    @functools.wraps(type(optimizer).step)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        opt = ref()
        assert opt is not None
        opt._opt_called = True  # type: ignore[attr-defined]
        return type(opt).step(opt, *args, **kwargs)

    wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    return wrapper


def global_grad_norm(params: list[Tensor], norm_type: float, comm: Comm) -> Tensor:
    """Collective: the norm of the gradients of ``params`` over every rank's shards (one all-reduce).

    The same number torch computes on the unsharded gradients: ||(||g_1||, ..., ||g_k||)||, because
    each parameter's slices partition it (sum of p-th powers for p < inf, max for inf).
    """
    grads = [p.grad for p in params if p.grad is not None]  # master views (ShardedModel.masters)
    device = grads[0].device if grads else comm.device  # the host's with offload='cpu': the sum travels
    dtype = norm_dtype(params)
    if math.isinf(norm_type):
        maxima = [g.abs().max().to(dtype) for g in grads if g.numel()]
        local = torch.stack(maxima).max() if maxima else torch.zeros((), device=device, dtype=dtype)
        return collectives.all_reduce(local.to(comm.device, copy=True), comm, op="max", label="grad norm")
    powers = [torch.linalg.vector_norm(g, norm_type).to(dtype) ** norm_type for g in grads]
    local = torch.stack(powers).sum() if powers else torch.zeros((), device=device, dtype=dtype)
    total = collectives.all_reduce(local.to(comm.device, copy=True), comm, op="sum", label="grad norm")
    return total ** (1.0 / norm_type)


def norm_dtype(params: list[Tensor]) -> torch.dtype:
    """The dtype the global norm is summed and all-reduced in: fp32, or fp64 when a master is fp64 ("64-true",
    where torch's clipping on fp64 gradients computes in fp64). Read from the master views, not their gradients,
    so a rank holding no gradient sends the dtype every other rank sends."""
    return torch.float64 if any(p.dtype == torch.float64 for p in params) else torch.float32


def clip_grad_norm_(params: list[Tensor], max_norm: float, norm_type: float, comm: Comm) -> Tensor:
    """Clip by the global norm, as ``torch.nn.utils.clip_grad_norm_`` does on unsharded gradients:
    coefficient max_norm / (total + 1e-6), clamped to 1, multiplied into every gradient. Returns the
    total norm before clipping."""
    total = global_grad_norm(params, norm_type, comm)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:
        if p.grad is not None:
            p.grad.mul_(coef.to(p.grad.device, p.grad.dtype))
    return total
