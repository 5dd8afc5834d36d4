"""Run a benchmark function on N local ranks (processes) and collect what each returns; the quiet Trainer
every timed Lightning run uses.

Each rank gets the environment torchrun would give it (MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK,
LOCAL_RANK, NODE_RANK), so a ``Trainer(devices=N)`` or ``init_process_group("gloo")`` inside joins as is.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, fn: Callable[..., Any], world: int, port: int, kwargs: dict, results: dict) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
        LOCAL_RANK=str(rank), NODE_RANK="0", OMP_NUM_THREADS="1",
    )  # fmt: skip
    torch.set_num_threads(1)
    results[rank] = fn(**kwargs)


def run_ranks(fn: Callable[..., Any], world: int, kwargs: dict | None = None) -> list[Any]:
    """``fn(**kwargs)`` on ``world`` ranks; each rank's return value, in rank order (a failure raises)."""
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank, args=(fn, world, free_port(), kwargs or {}, results), nprocs=world, join=True)
        return [results[r] for r in range(world)]


# a timed run: nothing but training (no logger, checkpoints, progress bar, summary or validation)
QUIET = {
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "num_sanity_val_steps": 0,
    "limit_val_batches": 0,
}


def timing_trainer(**kwargs: Any) -> Any:
    """``lightning.Trainer(**kwargs)`` with ``QUIET``'s settings."""
    import lightning as L

    return L.Trainer(**QUIET, **kwargs)


def interleaved(variants: Any, repeats: int, sample: Callable[[str], dict]) -> dict[str, list[dict]]:
    """``repeats`` rounds, each running every variant once in turn (so drift hits all alike): samples by variant."""
    samples: dict[str, list[dict]] = {v: [] for v in variants}
    for _ in range(repeats):
        for variant in variants:
            samples[variant].append(sample(variant))
    return samples


def save_report(out: str, samples: dict[str, list[dict]], text: str) -> None:
    """The markdown to ``out``, the raw samples beside it (``.json``), the markdown to stdout."""
    import json
    from pathlib import Path

    Path(out).with_suffix(".json").write_text(json.dumps(samples, indent=1))
    Path(out).write_text(text + "\n")
    print(text)


def timed(fn: Callable[..., Any], record: Callable[[float], Any]) -> Callable[..., Any]:
    """``fn``, with the seconds each call spends inside handed to ``record`` (also when it raises)."""

    def run(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            record(time.perf_counter() - started)

    return run
