"""One label per phase, ``shardlab::<phase> (<subject>)``, e.g. ``shardlab::all_gather (blocks.3[float32])``.

The profiler shows them (``torch.profiler.profile``); outside a profile they cost nothing, so the hot
path does not pay ``record_function``'s few microseconds per call.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch


def phase(name: str, subject: str) -> AbstractContextManager:
    if not torch._C._autograd._profiler_enabled():
        return nullcontext()
    return torch.profiler.record_function(f"shardlab::{name} ({subject})")
