"""The guard's check of device state: one all-gather per check, read without a wait.

At a check step the replicated state's digests and the batch's (divergence.py) are made where the state lives,
stacked with the rows of the batch's source (data_source.py) and all-gathered in one collective; the result comes to
the host through ``host_reads.Later``. On CPU ranks it is there at once and the verdict is given at once. On a GPU
the copy runs behind the step's kernels and the verdict is given at the next step's start, on every rank at the same
point (naming a difference exchanges the entry, a collective), or at the end of fit: the host waits only if the
device has not got there by then, and a fault is named one step after the check that saw it, under that check's name
("before step 10"), with the values the entry holds when it is named. ``DEFER`` makes CPU ranks wait for the next
step as well (the tests run the GPU's order on CPU ranks with it).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim import Optimizer

from lightning_shardlab.comm import collectives
from lightning_shardlab.comm.host_reads import Later, to_device
from lightning_shardlab.guard.data_source import DataSource, Source
from lightning_shardlab.guard.divergence import (
    Replicated,
    batch_digest,
    judge_replicated,
    replicated_digests,
    replicated_state,
)
from lightning_shardlab.guard.duplicate_data import ROWS, DataVerdicts
from lightning_shardlab.sharding.sharded_model import ShardedModel

DEFER = False  # give CPU ranks' verdicts at the next step too, as a GPU's are


class DeviceCheck:
    """One check's digests in flight: ``launch`` it (collective), ``conclude`` it (raises on a fault)."""

    def __init__(
        self,
        sharded: ShardedModel,
        entries: list[Replicated],
        data: tuple[DataSource, DataVerdicts] | None,
        gathered: Later,
        when: str,
    ):
        self.sharded, self.entries, self.data, self.gathered, self.when = sharded, entries, data, gathered, when

    @property
    def deferred(self) -> bool:
        return DEFER or self.sharded.comm.device.type == "cuda"

    @staticmethod
    def launch(
        sharded: ShardedModel,
        optimizers: list[Optimizer],
        skip: tuple[str, ...],
        batch: Any,
        when: str,
        source: tuple[DataSource, DataVerdicts] | None = None,
    ) -> DeviceCheck | None:
        """Collective: the replicated state's digests (unless ``optimizers`` is None: that check is off) and the
        batch's with its source's rows (unless ``batch`` is None; ``source``: where the batch came from and the run's
        data verdicts; None: the batch only), all-gathered in one call; None when there is nothing to compare."""
        comm = sharded.comm
        entries = replicated_state(sharded, optimizers, skip) if comm.world_size > 1 and optimizers is not None else []
        checked = comm.world_size > 1 and batch is not None
        data = (source or (DataSource(Source.BYTES_ONLY), DataVerdicts())) if checked else None
        if not entries and data is None:
            return None
        parts = [replicated_digests(entries, comm.device)] if entries else []
        if data is not None:
            parts += [batch_digest(batch, comm.device).view(1, 2), to_device(data[0].rows(), comm.device)]
        mine = torch.cat(parts).reshape(-1)  # 1-D, (entries + ROWS if data) * 2
        everyone = torch.empty(comm.world_size * mine.numel(), dtype=torch.int64, device=comm.device)
        collectives.all_gather(everyone, mine, comm, label="sanity digests", kind="sanity")
        return DeviceCheck(sharded, entries, data, Later(everyone, "sanity digests"), when)

    def conclude(self) -> None:
        """Collective on a fault: raise ``DivergenceError`` or ``DuplicateDataError`` on every rank (or warn of
        equal batches the guard cannot judge, once per run: duplicate_data.py)."""
        rows = self.gathered.value().view(self.sharded.comm.world_size, -1, 2)  # (world, entries + ROWS if data, 2)
        if self.entries:
            judge_replicated(self.sharded, self.entries, rows[:, : len(self.entries)], self.when)
        if self.data is not None:
            source, verdicts = self.data
            verdicts.judge(self.sharded.comm, rows[:, -ROWS:], source, self.when)
