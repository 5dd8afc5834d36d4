"""Reads of device values by the host, counted: the one seam through which the engine and its callbacks bring a
value computed on the device into Python.

On a GPU, reading a device tensor on the host (``.item()``, ``.tolist()``, ``.cpu()``, ``bool(t)``) waits for
everything queued before it: the CPU stops running ahead, and the next unit's kernels and collectives are not
queued while this one computes. So what the ranks agree on that the host knows travels on the host side
(comm/host_side.py), and the device values the guard, the budget and the vitals need are read here, where they
are counted by why they were read. A steady step of the default configuration reads none: the guard's digests
come over without a wait (``Later``), the budget's step clock reads at its exchanges, the vitals (opt-in) once per
logged step (tests/test_host_syncs.py counts them on CPU ranks;
``torch.cuda.set_sync_debug_mode("error")`` proves it on a GPU, tests/test_gpu.py).

    to_host(tensor, why)   the tensor's values on the host (the tensor itself when it is there already), counted
    wait_for(event, why)   the host waits until the device has passed ``event`` (a CUDA event), counted
    Later(tensor, why)     a copy to the host that does not wait: started now, read later (a wait, counted, only
                           if the device has not got there by then)
    to_device(tensor, d)   a tensor on device ``d``, from the host without a wait (through pinned memory)
    READS                  why -> reads since the process started
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
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


class Later:
    """``tensor``'s values on the host, copied without a wait: on a GPU into pinned memory behind an event on the
    current stream; on the host, the tensor itself. ``value()`` waits (counted) only if the copy is not done."""

    def __init__(self, tensor: Tensor, why: str) -> None:
        self.why, self.event = why, None
        if tensor.device.type == "cuda":
            self.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self.host.copy_(tensor, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = tensor

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def value(self) -> Tensor:
        if not self.ready():
            wait_for(self.event, self.why)
        return self.host


def to_device(tensor: Tensor, device: torch.device) -> Tensor:
    """``tensor`` on ``device``; from the host to a GPU through pinned memory, so the host does not wait."""
    if tensor.device.type != "cpu" or device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
