"""Lightning's weight averaging, and users' subclasses of it, run with the average sharded.

Lightning documents ``WeightAveraging`` for subclassing (override ``should_update``), and users subclass
``EMAWeightAveraging`` and ``StochasticWeightAveraging`` the same way. The strategy turns each such callback, in
place (the user's object, its arguments and attributes kept), into a class whose MRO is

    the user's classes  ->  the sharded machinery  ->  Lightning's base  ->  Callback

(``sharded_subclass``): Lightning's own hooks run unchanged, every method the user overrides wins, and its
``super()`` calls reach the machinery that keeps this rank's share of the average (``ShardLabWeightAveraging``,
trainer/weight_averaging.py, for ``WeightAveraging`` and its subclasses; ``ShardLabSWA``, trainer/swa.py, for
``StochasticWeightAveraging``'s). The class keeps the user's name, qualified name and module, so
``type(callback).__name__`` and the callback's ``state_key`` in checkpoints are DDP's. Lightning's own
``StochasticWeightAveraging`` becomes ``ShardLabSWA`` itself, as before.

A subclass whose own code reads the whole averaged module is refused before fit, naming the method
(trainer/average_readers.py explains how it is found).
"""

from __future__ import annotations

import functools
from typing import Any

from lightning.pytorch.callbacks import StochasticWeightAveraging, WeightAveraging

from lightning_shardlab.trainer import swa, weight_averaging
from lightning_shardlab.trainer.average_readers import whole_average_error, whole_average_reader
from lightning_shardlab.trainer.swa import ShardLabSWA
from lightning_shardlab.trainer.weight_averaging import ShardLabWeightAveraging

SHARDED = (ShardLabSWA, ShardLabWeightAveraging)
# Lightning's base -> (its sharded machinery, the stand-in's API, the methods handed the average)
MACHINERY: dict[type, tuple[type, frozenset[str], dict[str, int]]] = {
    StochasticWeightAveraging: (ShardLabSWA, swa.STAND_IN_API, swa.AVERAGE_ARGUMENTS),
    WeightAveraging: (ShardLabWeightAveraging, weight_averaging.STAND_IN_API, {}),
}
AVERAGED_MODEL_OPTIONS = frozenset({"avg_fn", "multi_avg_fn"})  # what torch's AveragedModel takes besides these


@functools.cache
def sharded_subclass(cls: type, machinery: type) -> type:
    """``cls`` with ``machinery`` between its own classes and Lightning's base (C3 puts a subclass of the base
    before the base), under ``cls``'s names."""
    names = {"__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__}
    return type(cls.__name__, (cls, machinery), names)


def _check_options(callback: WeightAveraging, rank: int | None) -> None:
    """What torch's ``AveragedModel`` would refuse at setup, refused now (before any collective)."""
    options, where = callback._kwargs, "" if rank is None else f"[rank {rank}] "
    unknown = sorted(set(options) - AVERAGED_MODEL_OPTIONS)
    if unknown:
        raise ValueError(
            f"{where}{type(callback).__name__} got {unknown}, which torch's AveragedModel does not take. HINT: pass"
            " only device, use_buffers, avg_fn or multi_avg_fn."
        )
    if options.get("avg_fn") is not None and options.get("multi_avg_fn") is not None:
        raise ValueError(
            f"{where}{type(callback).__name__} got both avg_fn and multi_avg_fn. HINT: pass one of them, as torch's"
            " AveragedModel requires."
        )


def shard_weight_averaging(callbacks: list[Any], rank: int | None = None) -> None:
    """Every weight-averaging callback in ``callbacks`` runs sharded from now on (in place), or a subclass that
    reads the whole averaged module is refused, naming its method (``rank``: for the message)."""
    for callback in callbacks:
        if isinstance(callback, SHARDED):
            continue  # a second fit with the same callbacks
        if type(callback) is StochasticWeightAveraging:
            callback.__class__ = ShardLabSWA
            continue
        for base, (machinery, api, arguments) in MACHINERY.items():
            if isinstance(callback, base):
                reader = whole_average_reader(type(callback), api, arguments)
                if reader is not None:
                    raise whole_average_error(*reader, rank=rank)
                if isinstance(callback, WeightAveraging):
                    _check_options(callback, rank)
                callback.__class__ = sharded_subclass(type(callback), machinery)
                break
