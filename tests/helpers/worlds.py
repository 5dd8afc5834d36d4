"""Kept worlds: N ranks started once and reused by many ``run_ranks`` jobs, one job at a time.

A rank's start (forked from the preloaded server of tests/helpers/zygote.py, then its process group) costs more
than a short multi-rank test; a kept world pays it once per world size per session. Each job gets a fresh port
(so a job that opens and destroys its process group, and a Lightning fit that keeps one, both work after any
other job), runs on every rank, and returns what each rank's function returned. A job that fails on any rank, or
passes its timeout, kills its world and raises ``RankFailed`` with the rank's log; the next job starts a new world.
"""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from tests.helpers.launch import RankFailed, _kill, _tail, free_port, rank_env, start_rank

_WORLDS: dict[int, KeptWorld] = {}


class KeptWorld:
    def __init__(self, world_size: int) -> None:
        self.world_size, self.jobs = world_size, 0
        self.dir = Path(tempfile.mkdtemp(prefix=f"shardlab-world{world_size}-"))
        serve = ["--serve", str(self.dir)]
        self.procs = [
            start_rank(serve, rank_env(rank, world_size, free_port()), self.dir / f"rank{rank}.log")
            for rank in range(world_size)
        ]

    def log(self, rank: int) -> str:
        return _tail(self.dir / f"rank{rank}.log")

    def run(self, target: str, kwargs: dict[str, Any], timeout: float) -> list[Any]:
        n = self.jobs
        self.jobs += 1
        spec = {"target": target, "kwargs": kwargs, "port": free_port()}
        (self.dir / f"job{n}.tmp").write_text(json.dumps(spec))
        (self.dir / f"job{n}.tmp").rename(self.dir / f"job{n}.json")
        results = [self.dir / f"{n}.rank{rank}.pt" for rank in range(self.world_size)]
        deadline = time.monotonic() + timeout
        while not all(path.exists() for path in results):
            dead = [r for r, p in enumerate(self.procs) if p.poll() is not None]
            if dead:
                self.end()
                rank = dead[0]
                message = f"rank {rank} exited with {self.procs[rank].returncode}:\n{self.log(rank)}"
                raise RankFailed(message, rank, {r: self.log(r) for r in range(self.world_size)})
            if time.monotonic() > deadline:
                self.end()
                logs = {r: self.log(r) for r in range(self.world_size)}
                raise RankFailed(f"timed out after {timeout:.0f}s; rank 0 log:\n{logs[0]}", None, logs)
            time.sleep(0.02)
        out = [torch.load(path, weights_only=False) for path in results]
        for path in results:
            path.unlink()
        return out

    def end(self) -> None:
        _kill(self.procs)
        _WORLDS.pop(self.world_size, None)


def kept_world(world_size: int) -> KeptWorld:
    """The kept world of ``world_size`` ranks, started if there is none (or the last one ended)."""
    if world_size not in _WORLDS:
        _WORLDS[world_size] = KeptWorld(world_size)
    return _WORLDS[world_size]


@atexit.register
def _end_all() -> None:
    """At the session's end: the worlds still running are ended and their folders removed (a world that a
    failing job ended keeps its folder: its logs are the failure's)."""
    for world in list(_WORLDS.values()):
        world.end()
        shutil.rmtree(world.dir, ignore_errors=True)
