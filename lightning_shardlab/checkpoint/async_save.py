"""``async_save=True``: a sharded checkpoint is written while training goes on.

``save_sharded`` agrees on the plan (a collective), copies this rank's shards to host memory and hands the writing
of its files to a background thread; ``save_checkpoint`` returns. The rest, which is collective (every rank's files
are written; rank 0 writes trainer_state.pt, metadata.json and, last, COMPLETE, and moves the directory into place;
every rank learns the outcome), runs on the main thread when the saver next *waits*: at the start of the first
training batch by which every rank's files are written (one small all-reduce per batch while a save is in flight:
``conclude_if_written``), else at the next save, a load, the end of fit or teardown. So a checkpoint is complete,
and ``ckpt_path="last"`` finds it, about one step after its files are written, and a rank that dies later does not
cost the run that checkpoint. Every rank waits at the same point, so those collectives stay in step, and a failure
in any rank's background write is raised there on every rank. Until then the checkpoint has no COMPLETE marker and
is not in place: a rank killed while writing leaves the previous checkpoint of that name as it was. A removal asked
for meanwhile (``ModelCheckpoint`` rotating its top-k) waits for the save before it: the old checkpoint goes only
once the new one is complete.

Lightning's ``AsyncCheckpointIO`` plugin does the same for files a ``CheckpointIO`` writes (a thread, errors
at the next save, a wait in teardown); the strategies take that plugin as ``async_save=True``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from lightning_shardlab.comm import collectives
from lightning_shardlab.comm.collectives import Comm


class AsyncSaver:
    """At most one checkpoint in flight: its background write, and what concludes it on the main thread."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._written: dict[str, Any] = {}
        self._conclude: Callable[[dict[str, Any]], None] | None = None
        self._after: list[Callable[[], None]] = []

    @property
    def pending(self) -> bool:
        return self._thread is not None

    def submit(self, write: Callable[[], dict[str, Any]], conclude: Callable[[dict[str, Any]], None]) -> None:
        """Collective (the previous save's conclusion): run ``write`` in the background, ``conclude(its result)`` at
        the next ``wait``."""
        self.wait()
        self._written, self._conclude = {}, conclude
        self._thread = threading.Thread(target=self._run, args=(write,), name="shardlab-async-save", daemon=True)
        self._thread.start()

    def _run(self, write: Callable[[], dict[str, Any]]) -> None:
        try:
            self._written = write()
        except BaseException as err:  # noqa: BLE001  (raised on every rank when the save concludes)
            self._written = {"error": f"the background write failed: {type(err).__name__}: {err}"}

    def wait(self) -> None:
        """Collective when a save is in flight: finish it (or raise its failure, on every rank)."""
        if self._thread is None:
            return
        self._thread.join()
        conclude, written = self._conclude, self._written
        self._thread, self._conclude = None, None
        after, self._after = self._after, []
        assert conclude is not None
        conclude(written)  # raises, on every rank, if any rank's part failed: then nothing is removed
        for fn in after:
            fn()

    def conclude_if_written(self, comm: Comm) -> None:
        """Collective while a save is in flight (every rank calls it at the same point): finish the save if every
        rank's background write has ended (one all-reduce, min, of a one-element flag over ``comm``)."""
        if self._thread is None:
            return
        flag = torch.tensor([int(not self._thread.is_alive())], dtype=torch.int32)  # a host fact, on the host side
        if collectives.all_reduce(flag, comm.host_side, op="min", label="async save written").item():
            self.wait()

    def after(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` once the save in flight is complete (now, if none is)."""
        if self._thread is None:
            fn()
        else:
            self._after.append(fn)

    def abandon(self) -> None:
        """After an exception: let the write end, conclude nothing (no collective): the previous checkpoint stays."""
        if self._thread is not None:
            self._thread.join()
        self._thread, self._conclude, self._after = None, None, []
