"""Reads of device values by the host, counted: the one seam through which the engine and its callbacks bring a
value computed on the device into Python.

On a GPU, reading a device tensor on the host (``.item()``, ``.tolist()``, ``.cpu()``, ``bool(t)``) waits for
everything queued before it: the CPU stops running ahead, and the next unit's kernels and collectives are not
queued while this one computes. So what the ranks agree on that the host knows travels on the host side
(comm/host_side.py), and the device values the guard, the budget and the vitals need are read here, where they
are counted by why they were read. A steady step of the default configuration reads none: the guard reads at
its check steps, the budget's step clock at its exchanges (tests/test_host_syncs.py counts them on CPU ranks;
``torch.cuda.set_sync_debug_mode("error")`` proves it on a GPU, tests/test_gpu.py).

    to_host(tensor, why)   the tensor's values on the host (the tensor itself when it is there already), counted
    wait_for(event, why)   the host waits until the device has passed ``event`` (a CUDA event), counted
    READS                  why -> reads since the process started
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from torch import Tensor

READS: Counter[str] = Counter()


def to_host(tensor: Tensor, why: str) -> Tensor:
    """``tensor`` on the CPU: a wait for the device's queue when it lives on one. Counted under ``why`` whatever
    the device (on CPU ranks the count says where a GPU run would wait)."""
    READS[why] += 1
    return tensor.cpu()


def wait_for(event: Any, why: str) -> None:
    """Block the host until the device has passed ``event`` (a ``torch.cuda.Event``), counted under ``why``."""
    READS[why] += 1
    event.synchronize()
