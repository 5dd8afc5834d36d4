"""``offload='disk'``: master shards and optimizer state in memory-mapped files, stepped one flat parameter at
a time.

What moves to disk: every master shard that is a tensor of its own (mixed precision: the fp32 master beside
the bf16 compute shard) and every per-element optimizer state tensor (Adam's two moments, SGD's momentum).
In fp32 training the master *is* the compute shard, needed by every forward, so it stays; only the state
moves (8 of AdamW's 12 bytes per element; 12 of 16 in mixed precision, the ZeRO table's 4 + 8).

One step, for flat parameter i: the kernel reads i + 1's files ahead (``MADV_WILLNEED``); the optimizer's
update runs on i (offload/stepping.py) on the mapped pages; state it created (its first step, or after a
load) is copied into i's files and the optimizer holds views of them; i's pages are written back and dropped.
Between steps this rank's memory holds none of it. The arithmetic is the optimizer's own, on the same
values in the same order: an offloaded run equals one without offload bit for bit.
"""

from __future__ import annotations

import time
import weakref
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_shardlab.offload.mapped_files import FileTier
from lightning_shardlab.offload.stepping import Chunks, step_in_chunks
from lightning_shardlab.sharding.flat_param import FlatParam
from lightning_shardlab.sharding.optimizer import is_per_element, masters_in_place
from lightning_shardlab.sharding.sharded_model import ShardedModel


class DiskOffload:
    """The disk tier of one sharded model: its masters and each optimizer's state, in files."""

    tier = "disk"

    def __init__(self, sharded: ShardedModel, directory: str | Path) -> None:
        self.sharded = sharded
        self.files = FileTier(directory)
        self._state: dict[tuple[int, int], dict[str, Tensor]] = {}  # (id(optimizer), id(flat param)) -> key -> 1-D, S
        self.step_seconds = 0.0  # measured: wall time inside offloaded optimizer steps (update and disk I/O)
        self._started = 0.0

    # ---- what lives here ----

    @staticmethod
    def moves_master(fp: FlatParam) -> bool:
        """A master of its own (not the compute shard itself, which every forward reads) goes to disk, if this
        rank's shard of it holds real elements (not only padding)."""
        real = fp.layout.shard_numel > fp.layout.padding_in_shard(fp.rank)
        return fp.master is not fp.shard and fp.layout.requires_grad and real

    def move_masters(self) -> None:
        for fp in self.sharded.flat_params:
            if self.moves_master(fp) and not self.files.owns(fp.master):
                fp.move_master(self.files.tensor(f"{fp.layout.name}.master", fp.layout.shard_numel, fp.master.dtype))
                self.files.release([fp.master])

    def holds(self, tensor: Tensor) -> bool:
        return self.files.owns(tensor)

    def state_file(self, optimizer: Optimizer, fp: FlatParam, key: str) -> Tensor | None:
        """The file holding ``optimizer``'s state ``key`` for ``fp`` (1-D, S), if it made one."""
        return self._state.get((id(optimizer), id(fp)), {}).get(key)

    def tensors_of(self, optimizer: Optimizer, fp: FlatParam) -> list[Tensor]:
        own = list(self._state.get((id(optimizer), id(fp)), {}).values())
        return [fp.master, *own] if self.files.owns(fp.master) else own

    # ---- stepping ----

    def attach(self, optimizer: Optimizer) -> None:
        """After ``shard_optimizer``: ``optimizer`` steps one flat parameter at a time, its state settled in files."""
        weakref.finalize(optimizer, self._forget, id(optimizer))  # a later fit's optimizer gets new files

        def before(opt: Optimizer, chunks: Chunks, i: int) -> None:
            if i == 0:
                self._started = time.perf_counter()
            if i + 1 < len(chunks):
                self.files.read_ahead(self.tensors_of(opt, chunks.members[i + 1][0]))

        def after(opt: Optimizer, chunks: Chunks, i: int) -> None:
            fp, views = chunks.members[i]
            self._settle(opt, fp, views)
            self.files.release(self.tensors_of(opt, fp))
            if i == len(chunks) - 1:
                self.step_seconds += time.perf_counter() - self._started

        step_in_chunks(optimizer, self.sharded.flat_params, before, after)

    def settle_all(self, optimizer: Optimizer) -> None:
        """After ``load_state_dict``: move the loaded state into files, one flat parameter at a time."""
        with masters_in_place(optimizer, self.sharded):
            for fp, views in Chunks(optimizer, self.sharded.flat_params).members:
                self._settle(optimizer, fp, views)
                self.files.release(self.tensors_of(optimizer, fp))

    def _settle(self, optimizer: Optimizer, fp: FlatParam, views: list[nn.Parameter]) -> None:
        """Every per-element state tensor of ``views`` that is not in its file yet is copied there and replaced
        by a view of the file (the optimizer then updates the file's pages in place)."""
        for view in views:
            state = optimizer.state.get(view)
            if not state or view.numel() == 0:
                continue
            lo = (view.data_ptr() - fp.master.data_ptr()) // view.element_size()  # its place in the master shard
            for key, value in state.items():
                if not is_per_element(key, value, view.shape):
                    continue
                file = self._file(optimizer, fp, key, value.dtype)
                target = file[lo : lo + view.numel()]
                if value.data_ptr() != target.data_ptr():
                    with torch.no_grad():
                        target.copy_(value)
                    state[key] = target

    def _forget(self, key: int) -> None:
        for name in [n for n in self._state if n[0] == key]:
            for tensor in self._state.pop(name).values():
                self.files.forget(tensor)

    def _file(self, optimizer: Optimizer, fp: FlatParam, key: str, dtype: torch.dtype) -> Tensor:
        files = self._state.setdefault((id(optimizer), id(fp)), {})
        if key not in files:
            files[key] = self.files.tensor(f"{fp.layout.name}.{key}", fp.layout.shard_numel, dtype)
        return files[key]
