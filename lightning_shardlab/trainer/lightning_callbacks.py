"""Lightning's callbacks that touch parameters, on sharded ones: what they read at stage 3, and their resume.

Reading. At stages 1-2 every rank holds the whole parameters, so these callbacks run as under DDP. At stage 3 each rank
holds a slice between steps: a read during fit is served from the shards, one collective per tensor operation
(sharding/shard_reads.py), too many for callbacks that read and rewrite every weight; so the methods below run inside
``gathered_params`` instead, one gather for the call (every rank calls them in the same order: a callback's hooks run
on every rank):

    ModelPruning       computes each mask from whole weights (``l1_unstructured`` ranks every element; the global
                       variant every element of every pruned weight) and, made permanent, writes
                       ``weight_orig * mask`` into the parameter: gathered with ``writeback=True``, so the masks
                       and the permanent weights are DDP's and the new values land in every rank's shards
    BaseFinetuning     (``BackboneFinetuning`` and users' subclasses) ``finetune_function`` finds the parameters not
                       in the optimizer yet by comparing values (``torch.equal``): gathered to read, for the call

Gathering holds the whole model's full values for the call (as ``gathered_params()`` does): once per pruning,
and once per epoch start of a finetuning callback.

Resuming. ``BaseFinetuning`` rebuilds the param groups it added (by parameter name) in ``on_fit_start`` when it
restarts; Lightning restores a strategy's callbacks after ``on_fit_start`` when the strategy restores after setup
(as this one must: loading slices the checkpoint into the shards), so that moment has passed. ``restore_param_groups``
does it just before the optimizer state is loaded, so the groups match the saved ones.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from lightning.pytorch.callbacks import BaseFinetuning, ModelPruning

Gathered = Callable[[bool], AbstractContextManager[None]]  # writeback -> the gathered_params context

# callback class -> (its methods that read weights, whether they also write them)
READERS: dict[type, tuple[tuple[str, ...], bool]] = {
    ModelPruning: (
        (
            "apply_pruning",
            "make_pruning_permanent",
            "apply_lottery_ticket_hypothesis",
            "_make_pruning_permanent_on_state_dict",  # on_save_checkpoint: the pruned weights, as DDP saves them
        ),
        True,
    ),
    BaseFinetuning: (("finetune_function",), False),
}


def gather_for_weight_readers(callbacks: list[Any], gathered: Gathered) -> None:
    """Wrap, on each instance in ``callbacks`` of a class in ``READERS``, the methods that read weights."""
    for callback in callbacks:
        for cls, (methods, writeback) in READERS.items():
            if isinstance(callback, cls) and not getattr(callback, "_shardlab_gathers", False):
                for name in methods:
                    setattr(callback, name, _inside(getattr(callback, name), gathered, writeback))
                callback._shardlab_gathers = True


def _inside(method: Callable[..., Any], gathered: Gathered, writeback: bool) -> Callable[..., Any]:
    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with gathered(writeback):
            return method(*args, **kwargs)

    return wrapper


def restore_param_groups(trainer: Any) -> None:
    """Before the optimizer state is loaded: a restarting ``BaseFinetuning`` rebuilds its param groups now."""
    for callback in trainer.callbacks:
        if isinstance(callback, BaseFinetuning) and callback._restarting:
            callback.on_fit_start(trainer, trainer.lightning_module)
