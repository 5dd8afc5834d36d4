"""Fresh ranks without a fresh interpreter: forked from one process that has already imported torch, Lightning and
this package (multiprocessing's forkserver, preloaded).

A rank started with ``python -m tests.helpers.worker`` spends ~4 s of CPU on its imports before it runs a line of
the test; the runs that must start ranks of their own (a rank is meant to die, hang or raise: the watchdog's tests)
paid that for every rank. Forked from the preloaded server, a rank starts in a fraction of a second with the same
modules, then takes the environment the launcher gives it (``rank_env``: the variables torchrun would set, read by
torch and Lightning when a run starts, not when they are imported), its own session (so its whole group can be
killed) and its log, exactly as a spawned rank would.

Runs that set variables read while the interpreter starts (glibc's ``MALLOC_*``, a memory cap measured from the
process's start) still start an interpreter of their own (tests/helpers/launch.py).
"""

from __future__ import annotations

import multiprocessing
import os
from multiprocessing.context import ForkServerContext
from pathlib import Path

from tests.helpers.launch import ROOT

PRELOAD = ["tests.helpers.worker", "lightning_shardlab", "lightning.pytorch", "tests.models"]
_CONTEXT: ForkServerContext | None = None


def _context() -> ForkServerContext:
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = multiprocessing.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(PRELOAD)
    return _CONTEXT


def _rank(argv: list[str], env: dict[str, str], log: str) -> None:
    """The forked rank: its own session, its output into ``log``, the launcher's environment, then what
    ``python -m tests.helpers.worker ARGV`` would run."""
    os.setsid()
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(ROOT)
    from tests.helpers import worker

    worker.main(argv)


class ForkedRank:
    """A forked rank with the part of ``subprocess.Popen``'s interface the launcher uses."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.process = _context().Process(target=_rank, args=(argv, env, str(log)), daemon=False)
        self.process.start()
        self.pid = self.process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.exitcode  # a signal's death is minus its number, as Popen says it

    def poll(self) -> int | None:
        return self.process.exitcode

    def wait(self) -> int | None:
        self.process.join()
        return self.process.exitcode
