"""``start_method`` 'spawn', 'fork' or 'forkserver' for Fabric: ``fabric.launch(train)`` starts the ranks from this
process and returns rank 0's return value, as Fabric's own multiprocessing launcher does; what would fail in the
ranks (fork after CUDA, a function or argument that does not pickle under spawn) is refused before any rank starts
(common/process_start.py)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from lightning.fabric.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from typing_extensions import override

from lightning_shardlab.common.process_start import ranks_joined, refuse_bad_fork, refuse_unpicklable


class ShardLabFabricSpawnLauncher(_MultiProcessingLauncher):
    @override
    def launch(self, function: Callable, *args: Any, **kwargs: Any) -> Any:
        assert self._strategy.root_device is not None
        refuse_bad_fork(self._start_method, self._strategy.root_device.type)
        refuse_unpicklable(self._start_method, _what_travels(function, args, kwargs))
        with ranks_joined(self._strategy.node_rank * self._strategy.num_processes):
            return super().launch(function, *args, **kwargs)


def _what_travels(function: Callable, args: tuple, kwargs: dict[str, Any]) -> list[tuple[str, Any]]:
    """The user's function (Fabric wraps it in a ``partial`` of its own setup), each argument, then Fabric."""
    user = function.args[0] if isinstance(function, partial) and function.args else function
    named: list[tuple[str, Any]] = [(f"the function `{getattr(user, '__qualname__', user)}`", user)]
    named += [(f"the `{type(a).__name__}` argument", a) for a in [*args, *kwargs.values()]]
    return [*named, ("fabric.launch's function with its Fabric", function)]
