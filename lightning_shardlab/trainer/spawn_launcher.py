"""``start_method`` 'spawn', 'fork' or 'forkserver': the Trainer's ranks started from this process, as Lightning's
``ddp_spawn`` and ``ddp_notebook`` start them, and what comes back to it (trainer/spawn_results.py).

Lightning's multiprocessing launcher does the starting and joining (a rank that fails ends the others and its
error is raised here); this subclass adds what the sharded module and a notebook need:

- before any rank starts, what would fail in the ranks is refused here (common/process_start.py: fork after CUDA,
  an object that does not pickle under spawn);
- after a fit, every rank joins the gather of the whole weights (rank 0's ``state_dict()`` would be its shards),
  and the checkpoint and early-stopping callbacks' state, the budget's reports and the dashboard's paths travel
  with Lightning's metrics;
- a failed rank is named in the error raised here, and an interrupt here kills the ranks (``ranks_joined``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher, _WorkerOutput
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_shardlab.common.process_start import ranks_joined, refuse_bad_fork, refuse_unpicklable
from lightning_shardlab.trainer import spawn_results

EXTRA_KEY = "shardlab_callbacks"


class ShardLabSpawnLauncher(_MultiProcessingLauncher):
    @override
    def launch(self, function: Callable, *args: Any, trainer: Trainer | None = None, **kwargs: Any) -> Any:
        assert self._strategy.root_device is not None
        refuse_bad_fork(self._start_method, self._strategy.root_device.type)
        if trainer is not None:
            refuse_unpicklable(self._start_method, _what_travels(trainer, args))
        with ranks_joined(self._strategy.node_rank * self._strategy.num_processes):
            return super().launch(function, *args, trainer=trainer, **kwargs)

    @override
    def _collect_rank_zero_results(self, trainer: Trainer, results: Any) -> _WorkerOutput | None:
        strategy: Any = trainer.strategy
        fitted = trainer.state.fn == TrainerFn.FITTING and strategy.sharded is not None
        whole = strategy.full_state_dict() if fitted else {}  # collective: every rank joins, rank 0 gets the state
        if strategy.global_rank != 0:
            return None
        checkpoint = trainer.checkpoint_callback
        best = getattr(checkpoint, "best_model_path", None)
        weights = spawn_results.save_whole_weights(whole) if fitted else None
        return _WorkerOutput(best, weights, trainer.state, results, self.get_extra_results(trainer))

    @override
    def _recover_results_in_main_process(self, worker_output: _WorkerOutput, trainer: Trainer) -> None:
        weights = worker_output.weights_path
        super()._recover_results_in_main_process(worker_output._replace(weights_path=None), trainer)
        if weights is not None:
            spawn_results.load_whole_weights(trainer.lightning_module, os.fspath(weights))

    @override
    def get_extra_results(self, trainer: Trainer) -> dict[str, Any]:
        return {**super().get_extra_results(trainer), EXTRA_KEY: spawn_results.callback_states(trainer)}

    @override
    def update_main_process_results(self, trainer: Trainer, extra: dict[str, Any]) -> None:
        super().update_main_process_results(trainer, extra)
        spawn_results.restore_callback_states(trainer, extra[EXTRA_KEY])


def _what_travels(trainer: Trainer, args: tuple) -> list[tuple[str, Any]]:
    """What spawn pickles, the likeliest culprits first: the module, the data and the callbacks and loggers, each
    named; then the trainer that holds them all."""
    module = trainer.strategy._lightning_module
    named = [] if module is None else [(f"the LightningModule `{type(module).__name__}`", module)]
    call = f"trainer.{getattr(trainer.state.fn, 'value', 'fit')}()"
    named += [(f"the `{type(a).__name__}` passed to {call}", a) for a in args if a is not None and a is not module]
    named += [(f"the callback `{type(c).__name__}`", c) for c in trainer.callbacks]
    named += [(f"the logger `{type(lg).__name__}`", lg) for lg in trainer.loggers]
    return [*named, ("the Trainer", trainer)]
