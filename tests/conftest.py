"""Tests marked ``gpu`` need CUDA; without it they are skipped with that reason.

Once the tests are collected (torch, Lightning and every test module imported), their objects are frozen out of
the garbage collector's sight: they live as long as the session, and a full collection (the strategy's teardown
runs one per fit) would otherwise walk all of them each time, a fifth of a second apiece. tests/helpers/worker.py
does the same in every rank.
"""

from __future__ import annotations

import gc

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    reason = pytest.mark.skip(reason="needs a CUDA GPU: torch.cuda.is_available() is False on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(reason)


def pytest_collection_finish(session: pytest.Session) -> None:
    gc.collect()
    gc.freeze()
