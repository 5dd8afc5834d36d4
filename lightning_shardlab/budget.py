"""The budget callback: both sides of the ledger, per rank, printed at the end of ``fit``.

Memory is measured from the real tensors between steps (ledger.measure_memory) and set against the
ZeRO table of DESIGN.md section 3; communication comes from what the collectives recorded.
"""

from __future__ import annotations

from typing import Any

import lightning as L
from rich.console import Console
from rich.table import Table

from lightning_shardlab import collectives
from lightning_shardlab.config import Stage
from lightning_shardlab.ledger import MEMORY_CATEGORIES, measure_memory


def zero_table_bytes(params: int, world_size: int, stage: Stage, state_bytes_per_param: int = 8) -> int:
    """Model-state bytes per rank in fp32 training (DESIGN.md section 3: the compute copy is the master).

    stage 1: 4P + 4P + kP/N   stage 2: 4P + 4P/N + kP/N   stage 3: (4 + 4 + k)P/N, k = optimizer state bytes
    per parameter (8 for Adam's two moments). Our stage 1 frees full gradients after reducing them, so
    between steps it holds 4P/N of gradients like stage 2.
    """
    p, n, k = params, world_size, state_bytes_per_param
    if stage is Stage.PARAMETERS:
        return (4 + 4 + k) * p // n
    return 4 * p + 4 * p // n + k * p // n


def _mib(n: float) -> str:
    return f"{n / 2**20:,.2f}"


class ShardLabBudget(L.Callback):
    """Measures each rank's model-state memory between steps and prints the budget when fit ends."""

    def __init__(self, console: Console | None = None) -> None:
        self.console = console or Console()
        self.last: dict[str, int] = {}
        self.peak_total = 0
        self.steps = 0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if getattr(trainer.strategy, "sharded", None) is not None:
            trainer.strategy.sharded.comm.ledger.reset()  # count training traffic only, not setup
        self.steps = 0

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        strategy = trainer.strategy
        if getattr(strategy, "sharded", None) is None:
            return
        self.last = measure_memory(strategy.sharded.flat_params, trainer.optimizers)
        self.peak_total = max(self.peak_total, sum(v for k, v in self.last.items() if k != "padding"))
        self.steps += 1

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy = trainer.strategy
        if getattr(strategy, "sharded", None) is None or not self.last:
            return
        sharded = strategy.sharded
        mine = {"memory": self.last, "comm": {k: vars(v) for k, v in sharded.comm.ledger.by_kind.items()}}
        everyone = collectives.all_gather_object(mine, sharded.comm, label="budget")
        if trainer.global_rank == 0:
            params = sum(fp.layout.numel for fp in sharded.flat_params if fp.layout.requires_grad)
            self._print(everyone, params, sharded.comm.world_size, sharded.config.stage)

    def _print(self, everyone: list[dict], params: int, world: int, stage: Stage) -> None:
        memory = Table(title=f"shardlab budget: memory per rank between steps (MiB), stage {int(stage)}, {world} ranks")
        for col in ("rank", *MEMORY_CATEGORIES, "total", "ZeRO table"):
            memory.add_column(col, justify="right")
        expected = zero_table_bytes(params, world, stage)
        for rank, report in enumerate(everyone):
            m = report["memory"]
            total = sum(v for k, v in m.items() if k != "padding")
            memory.add_row(str(rank), *(_mib(m[c]) for c in MEMORY_CATEGORIES), _mib(total), _mib(expected))
        self.console.print(memory)
        comm = Table(title=f"shardlab budget: communication per optimizer step, rank 0 ({self.steps} steps)")
        for col in ("collective", "calls", "MiB (full tensor)", "seconds waiting"):
            comm.add_column(col, justify="right")
        steps = max(self.steps, 1)
        for kind, totals in sorted(everyone[0]["comm"].items()):
            comm.add_row(kind, f"{totals['count'] / steps:.1f}", _mib(totals["bytes"] / steps),
                         f"{totals['seconds'] / steps:.4f}")
        self.console.print(comm)
