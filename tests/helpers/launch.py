"""Run a function on N real processes (one per rank) and collect what each returns.

Every run has a hard wall clock, uses a free port, kills every other rank as soon as one fails,
and leaves no process behind: each rank runs in its own session and the whole group is killed.
Ranks find each other the way torchrun / Lightning's launcher would tell them (MASTER_ADDR,
MASTER_PORT, WORLD_SIZE, NODE_RANK, LOCAL_RANK, RANK), so ``Trainer(devices=N)`` joins as is.

Starting a rank costs seconds (torch and Lightning imports), most of what a short test takes, so a run that
expects to succeed goes to a *kept world* (tests/helpers/worlds.py): N ranks started once per world size and
reused by the tests after it, one job at a time, each job with a fresh port and the environment as it was. A
job that fails or passes its timeout ends its world (the next job starts a new one). Runs that expect a rank
to fail start ranks of their own, forked from a process that has done the imports (tests/helpers/zygote.py); runs
that set their own environment (a process's allocator, its memory cap) start interpreters of their own;
``SHARDLAB_TEST_FRESH_WORLDS=1`` makes every run start fresh ranks. A test that counts a process's live tensors
counts those its own run made (a kept process holds what earlier jobs left).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]


class RankFailed(AssertionError):
    def __init__(self, message: str, rank: int | None, logs: dict[int, str]) -> None:
        super().__init__(message)
        self.rank, self.logs = rank, logs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, lines: int = 40) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return "\n".join(text.splitlines()[-lines:])


def _kill(procs: list[Any]) -> None:
    """Kill each process's whole session (a forked rank may not have made its own yet: then the process)."""
    for p in procs:
        if p.poll() is None:
            for kill in (os.killpg, os.kill):
                try:
                    kill(p.pid, signal.SIGKILL)
                    break
                except ProcessLookupError:
                    pass
    for p in procs:
        p.wait()


def rank_env(rank: int, world_size: int, port: int, env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment torchrun would give ``rank`` of a one-node world on localhost."""
    return {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(world_size),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "NODE_RANK": "0",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "PYTHONWARNINGS": "ignore",
        **(env or {}),
    }


def spawn(command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """``command`` in a session of its own (so its whole group can be killed), its output into ``log``."""
    with open(log, "w") as out:
        return subprocess.Popen(
            command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT
        )


def start_rank(argv: list[str], env: dict[str, str], log: Path, forked: bool = True) -> Any:
    """One rank running ``python -m tests.helpers.worker ARGV``: forked from the preloaded server
    (tests/helpers/zygote.py), or, for a run that sets variables read as the interpreter starts
    (``forked=False``), an interpreter of its own."""
    if forked:
        from tests.helpers.zygote import ForkedRank

        return ForkedRank(argv, env, log)
    return spawn([sys.executable, "-m", "tests.helpers.worker", *argv], env, log)


def run_ranks(
    target: str,
    world_size: int,
    kwargs: dict[str, Any] | None = None,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
    expect_failure: bool = False,
    rank_envs: list[dict[str, str]] | None = None,
) -> list[Any]:
    """Run ``target`` ("module:function") as ``function(**kwargs)`` on ``world_size`` ranks.

    Returns each rank's return value (rank order). If a rank fails or the run passes ``timeout``
    seconds, every rank is killed and ``RankFailed`` names the rank with its log. With
    ``expect_failure=True`` all ranks run to their end and the logs come back as ``{rank: text}``.
    Unless ``env``, ``rank_envs`` or ``expect_failure`` is given, the run goes to the kept world of its size.
    ``rank_envs``: variables of each rank's own, on top of ``env`` (e.g. the network namespace of its emulated
    node, benchmarks/slow_link.py); those ranks are forked, as they are read when a run starts.
    """
    if not (env or expect_failure or rank_envs) and os.environ.get("SHARDLAB_TEST_FRESH_WORLDS") != "1":
        from tests.helpers.worlds import kept_world

        return kept_world(world_size).run(target, kwargs or {}, timeout)
    out = Path(tempfile.mkdtemp(prefix="shardlab-test-"))
    (out / "kwargs.json").write_text(json.dumps(kwargs or {}))
    port = free_port()
    procs = [
        start_rank(
            [target, str(out)],
            rank_env(rank, world_size, port, {**(env or {}), **(rank_envs[rank] if rank_envs else {})}),
            out / f"rank{rank}.log",
            forked=not env,
        )
        for rank in range(world_size)
    ]
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs):
            failed = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
            if failed and not expect_failure:
                raise RankFailed(
                    f"rank {failed[0]} exited with {procs[failed[0]].returncode}:\n"
                    f"{_tail(out / f'rank{failed[0]}.log')}",
                    failed[0],
                    {r: _tail(out / f"rank{r}.log") for r in range(world_size)},
                )
            if time.monotonic() > deadline:
                logs = {r: _tail(out / f"rank{r}.log") for r in range(world_size)}
                raise RankFailed(f"timed out after {timeout:.0f}s; rank 0 log:\n{logs[0]}", None, logs)
            time.sleep(0.05)
    finally:
        _kill(procs)
    if expect_failure:
        return [(p.returncode, (out / f"rank{r}.log").read_text(errors="replace")) for r, p in enumerate(procs)]
    failed = [r for r, p in enumerate(procs) if p.returncode != 0]
    if failed:
        raise RankFailed(f"rank {failed[0]} failed:\n{_tail(out / f'rank{failed[0]}.log')}", failed[0], {})
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


def run_commands(commands: list[list[str]], timeout: float, env: dict[str, str] | None = None) -> list[str]:
    """Run several commands at once (e.g. two torchrun "nodes"), each in its own session; return their
    output. Any failure or the timeout kills every one of them (and their children)."""
    out = Path(tempfile.mkdtemp(prefix="shardlab-cmd-"))
    full_env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        **(env or {}),
    }
    procs = [
        subprocess.Popen(
            cmd,
            env=full_env,
            stdout=open(out / f"{i}.log", "w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=ROOT,
        )
        for i, cmd in enumerate(commands)
    ]
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs):
            failed = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
            if failed:
                raise RankFailed(f"command {failed[0]} failed:\n{_tail(out / f'{failed[0]}.log')}", None, {})
            if time.monotonic() > deadline:
                raise RankFailed(f"timed out after {timeout:.0f}s:\n{_tail(out / '0.log')}", None, {})
            time.sleep(0.1)
    finally:
        _kill(procs)
    failed = [i for i, p in enumerate(procs) if p.returncode != 0]
    if failed:
        raise RankFailed(f"command {failed[0]} failed:\n{_tail(out / f'{failed[0]}.log')}", None, {})
    return [(out / f"{i}.log").read_text(errors="replace") for i in range(len(commands))]
