"""The sharded optimizer: the user's optimizer, rewritten to update only this rank's master shard.

``configure_optimizers`` runs unchanged and sees the module's parameters (placeholders at stage 3,
unsharded params at stages 1-2). ``shard_optimizer`` then replaces, in place, every parameter in every
param group by its master view, so hyperparameters per group, LR schedulers and Lightning's optimizer
wrappers keep working. A step on a slice equals the slice of a full step only when the update of each
element depends on that element alone; optimizers that are not elementwise are refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_shardlab.comm import collectives
from lightning_shardlab.comm.collectives import Comm
from lightning_shardlab.config import import_path
from lightning_shardlab.sharding.sharded_model import ShardedModel

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

NOT_ELEMENTWISE: dict[str, str] = {
    "LBFGS": "it keeps a history of whole-model update directions and line-searches along them",
    "Adafactor": "it factors each matrix's second moment into row and column statistics of the whole matrix",
    "Muon": "it orthogonalises each whole weight matrix",
    "SparseAdam": "it needs sparse gradients of whole embedding tables",
}


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
        key = {n.lower(): n for n in STATE_TENSORS}[name.lower()]
        return OptimizerShape(STATE_TENSORS[key] if key != "SGD" else 1, SCALAR_STATE_BYTES.get(key, 0))


def is_per_element(key: str, value: Any, shape: torch.Size) -> bool:
    """Whether optimizer state ``key`` holds one value per element of its parameter (of ``shape``: the full
    parameter's, or its master view's): a tensor of the parameter's shape other than the step counter. Both
    checkpoint formats slice and gather exactly these; everything else is per-parameter and replicated."""
    return isinstance(value, Tensor) and key != "step" and value.shape == shape


def check_elementwise(optimizer: Optimizer, extra: tuple[str, ...] = ()) -> None:
    """Raise ``ValueError`` unless a step on a shard equals the same slice of an unsharded step."""
    cls = type(optimizer)
    allowed = ELEMENTWISE + tuple(import_path(p, "elementwise_optimizers") for p in extra)
    if cls in allowed:
        return
    hint = (
        " HINT: use an elementwise optimizer (SGD, Adam, AdamW, RMSprop, Adagrad, ...) or, if each element's"
        " update depends only on its own value, gradient and state, list the class in"
        f" elementwise_optimizers=['{cls.__module__}.{cls.__qualname__}']."
    )
    if cls.__name__ in NOT_ELEMENTWISE:
        raise ValueError(
            f"{cls.__name__} cannot run on parameter shards: {NOT_ELEMENTWISE[cls.__name__]}, so a step on a"
            f" shard would differ from the unsharded step.{hint}"
        )
    base = next((b for b in ELEMENTWISE if issubclass(cls, b)), None)
    if base is not None and cls.step is base.step:
        return  # a subclass that keeps its base's update (e.g. adds logging)
    raise ValueError(f"{cls.__name__} is not known to update elementwise; sharding it could change results.{hint}")


def shard_optimizer(optimizer: Optimizer, sharded: ShardedModel) -> None:
    """Rewrite ``optimizer``'s param groups in place to hold master views (every rank, same order)."""
    check_elementwise(optimizer, sharded.config.elementwise_optimizers)
    if optimizer.state:
        raise ValueError(
            f"{type(optimizer).__name__} already has state, so it was stepped before sharding."
            " HINT: create optimizers in configure_optimizers()."
        )
    by_id = sharded.master_params_by_id()
    stepped = set()
    for index, group in enumerate(optimizer.param_groups):
        masters = []
        for param in group["params"]:
            if id(param) not in by_id:
                raise ValueError(
                    f"param group {index} of {type(optimizer).__name__} holds a tensor of shape {tuple(param.shape)}"
                    " that is not a parameter of the LightningModule. HINT: build optimizers from self.parameters()"
                    " (or named_parameters()) inside configure_optimizers()."
                )
            _name, master, fp = by_id[id(param)]
            masters.append(master)
            stepped.add(fp)
        group["params"] = masters
    optimizer.register_step_post_hook(lambda opt, args, kwargs: sharded.after_optimizer_step(stepped))


def global_grad_norm(params: list[Tensor], norm_type: float, comm: Comm) -> Tensor:
    """Collective: the norm of the gradients of ``params`` over every rank's shards (one all-reduce).

    The same number torch computes on the unsharded gradients: ||(||g_1||, ..., ||g_k||)||, because
    each parameter's slices partition it (sum of p-th powers for p < inf, max for inf).
    """
    grads = [p.grad for p in params if p.grad is not None]
    device = grads[0].device if grads else comm.device  # the host's with offload='cpu': the sum travels
    if math.isinf(norm_type):
        maxima = [g.abs().max().float() for g in grads if g.numel()]
        local = torch.stack(maxima).max() if maxima else torch.zeros((), device=device)
        return collectives.all_reduce(local.to(comm.device, copy=True), comm, op="max", label="grad norm")
    powers = [torch.linalg.vector_norm(g, norm_type).float() ** norm_type for g in grads]
    local = torch.stack(powers).sum() if powers else torch.zeros((), device=device)
    total = collectives.all_reduce(local.to(comm.device, copy=True), comm, op="sum", label="grad norm")
    return total ** (1.0 / norm_type)


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
