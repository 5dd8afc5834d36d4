"""Is ``offload_dir`` usable? Checked before training: writable on every rank before the process group opens,
and (once the layout and the optimizers are known) large enough for what every rank on this machine will
keep there, agreed by all ranks before any file is made, so a short disk is the same error everywhere."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from torch.optim import Optimizer

from lightning_shardlab.comm import collectives
from lightning_shardlab.comm.collectives import Comm
from lightning_shardlab.offload.mapped_files import OffloadSpaceError
from lightning_shardlab.sharding.flat_param import FlatParam
from lightning_shardlab.sharding.optimizer import OptimizerShape


def offload_directory(option: str | None) -> Path:
    return Path(option) if option is not None else Path(tempfile.gettempdir())


def check_writable(option: str | None) -> Path:
    """The directory ``offload_dir`` names, or ``ValueError`` naming it and the fix (no collective)."""
    directory = offload_directory(option)
    hint = "HINT: create it, or set offload_dir to a writable directory on a local disk."
    if not directory.is_dir():
        raise ValueError(f"`offload_dir={str(directory)!r}` is not a directory. {hint}")
    try:
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as err:
        raise ValueError(f"`offload_dir={str(directory)!r}` is not writable ({err.strerror}). {hint}") from err
    return directory


def bytes_needed(flat_params: list[FlatParam], optimizers: list[Optimizer], moves_master: object) -> int:
    """What one rank keeps in ``offload_dir``: the masters that move, and each optimizer's per-element state
    (its known state tensors per element, sharding/optimizer.py) of every trainable shard."""
    total = 0
    for fp in flat_params:
        if not fp.layout.requires_grad:
            continue
        s = fp.layout.shard_numel * fp.master.dtype.itemsize
        total += s if moves_master(fp) else 0  # type: ignore[operator]
        total += sum(s * OptimizerShape.of(o).per_element for o in optimizers)
    return total


def agree_space(directory: Path, need: int, local_ranks: int, comm: Comm) -> None:
    """Collective: every rank checks that ``directory`` has room for ``need`` bytes per rank times the ranks of
    its machine; if any rank's does not, every rank raises ``OffloadSpaceError`` with what each lacks."""
    free = shutil.disk_usage(directory).free
    mine = None
    if need * local_ranks > free:
        mine = (
            f"rank {comm.rank}: offload_dir={str(directory)!r} has {free:,} bytes free, but the layout needs"
            f" {need:,} bytes per rank x {local_ranks} rank(s) on this machine = {need * local_ranks:,}"
        )
    everyone = collectives.all_gather_object(mine, comm, label="offload space")
    short = [m for m in everyone if m is not None]
    if short:
        raise OffloadSpaceError(
            28, "; ".join(short) + ". HINT: free space there, point offload_dir at a larger disk, or use more ranks"
        )
