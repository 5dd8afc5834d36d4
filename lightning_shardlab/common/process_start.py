"""Ranks started from this process (``start_method`` 'spawn', 'fork' or 'forkserver'): what is refused before any
rank starts, for both front doors.

A rank started by fork is a copy of this process: if this process has initialised CUDA already, the copy cannot
use it (CUDA's state does not survive a fork), and the rank would fail at its first CUDA call, after the others
have started and are waiting for it. A rank started by spawn (or by forkserver's server) receives the trainer,
module and data by pickle: a class defined inside a function, a lambda or an open file held by the module fails
there, as a ``PicklingError`` from deep inside multiprocessing. Both are found here, in this process, and refused
naming the object and the fix, before anything starts.

Once started, a rank that fails (its exception, an exit code, a signal: the out-of-memory killer) ends the others
(torch's ``ProcessContext.join``: SIGTERM, then SIGKILL, so no rank is left behind) and its error is raised here;
``ranks_joined`` adds the rank and what to look at to it, and kills the ranks when this process is interrupted.
"""

from __future__ import annotations

import io
import multiprocessing
import pickle
from collections.abc import Generator, Iterable
from contextlib import contextmanager
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
from lightning.fabric.utilities.imports import _IS_INTERACTIVE
from torch.multiprocessing.spawn import ProcessException, ProcessRaisedException

NOTEBOOK_HINT = "strategy='shardlab_notebook' (start_method='fork')"


class _WithoutTensorBytes(ForkingPickler):
    """multiprocessing's own pickler, with tensors and storages left out: they always travel (torch registers
    their reductions), and leaving them out keeps the check cheap for a model of any size."""

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, (torch.Tensor, torch.UntypedStorage, torch.TypedStorage)):
            return id(obj)
        return None


def _pickle_error(obj: Any) -> BaseException | None:
    try:
        _WithoutTensorBytes(io.BytesIO(), pickle.HIGHEST_PROTOCOL).dump(obj)
    except Exception as error:  # pickle raises PicklingError, TypeError, AttributeError, ... by object
        return error
    return None


def refuse_unpicklable(start_method: str, named: Iterable[tuple[str, Any]]) -> None:
    """Under 'spawn' and 'forkserver', raise ``ValueError`` naming the first of ``named`` ((what, object) pairs, in
    the order a user would look for the cause: the module before the trainer that holds it) that does not pickle."""
    if start_method not in ("spawn", "forkserver"):
        return
    for what, obj in named:
        error = _pickle_error(obj)
        if error is not None:
            raise ValueError(
                f"start_method={start_method!r} sends {what} to each rank by pickling it, and it does not pickle:"
                f" {type(error).__name__}: {error}. Nothing was started. HINT: define its class (and the functions"
                " and objects it holds) at the top level of an importable module, not inside a function or a"
                f" notebook cell; or use {NOTEBOOK_HINT}, which copies this process instead of pickling."
            )


def refuse_in_notebook(start_method: str, external: bool, interactive: bool | None = None) -> None:
    """In a notebook (Lightning's test: an interactive interpreter), ranks can only be forked from the kernel:
    'popen' runs a script the kernel does not have, spawned ranks cannot import what the notebook's cells define.
    Refused when the strategy is made, naming our notebook strategy (Lightning's own message names
    ``ddp_notebook``). Ranks started outside (``external``: torchrun, SLURM) are not ours to start."""
    interactive = _IS_INTERACTIVE if interactive is None else interactive
    if not interactive or external or start_method == "fork":
        return
    why = {
        "popen": "starts its ranks by running the script again, and a notebook has no script to run",
        "spawn": "spawns ranks that import what they receive from __main__, which a notebook's kernel does not have",
        "forkserver": "starts ranks that import what they receive from __main__, which a notebook's kernel does not"
        " have",
    }[start_method]
    raise ValueError(
        f"start_method={start_method!r} {why}. HINT: use strategy='shardlab_notebook' (or a stage of it, e.g."
        " 'shardlab_notebook_stage_2', or start_method='fork'): the ranks are forked from the kernel and what fit"
        " leaves comes back to it (docs/notebooks.md)."
    )


def refuse_bad_fork(start_method: str, device_type: str) -> None:
    """Under 'fork', raise ``RuntimeError`` if this process has initialised CUDA and the ranks train on CUDA."""
    if start_method != "fork" or device_type != "cuda" or not torch.cuda.is_initialized():
        return
    raise RuntimeError(
        "start_method='fork' starts each rank as a copy of this process, and this process has initialised CUDA"
        " already (a tensor or module was put on a GPU, or a torch.cuda call ran): a forked rank cannot use CUDA."
        " Nothing was started. HINT: restart the kernel and leave CUDA untouched before fit (keep the module on the"
        " CPU: the strategy moves each rank's shards to its GPU); or, from a script, use strategy='shardlab_spawn'"
        " (start_method='spawn') or the default start_method='popen'."
    )


@contextmanager
def ranks_joined(first_rank: int) -> Generator[None, None, None]:
    """Around the start and join of ranks ``first_rank``, ``first_rank + 1``, ...: the error of the one that failed
    first is raised with a note naming its global rank (torch names the index of its process) and where its cause
    is; on any other exception here (the kernel interrupted: Lightning's launcher kills only script-started ranks)
    the ranks this call started are killed and reaped, so that none is left running."""
    before = set(multiprocessing.active_children())
    try:
        yield
    except ProcessException as error:  # torch's join has ended the other ranks
        _name_the_rank(error, first_rank + error.error_index)
        raise
    except BaseException:
        started = set(multiprocessing.active_children()) - before
        for process in started:
            process.kill()
        for process in started:
            process.join()
        raise


def _name_the_rank(error: ProcessException, rank: int) -> None:
    where = (
        "its traceback is above"
        if isinstance(error, ProcessRaisedException)
        else "it left no traceback: look for the out-of-memory killer (dmesg), a signal sent to it, or an exit"
        " called in the code"
    )
    note = (
        f"[rank {rank}] (process {error.error_pid}) failed and ended the run; the other ranks were ended with it."
        f" HINT: {where}."
    )
    if hasattr(error, "add_note"):
        error.add_note(note)
    else:  # Python 3.10
        error.args = (f"{error.args[0]}\n{note}", *error.args[1:])
