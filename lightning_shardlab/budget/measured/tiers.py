"""Where each byte lives (device, host, disk) and what moves between the tiers per step: predicted from the
offload option and the layout, measured from the real tensors and the process's I/O counters.

Without offload every category lives on the device. ``offload='cpu'`` keeps the masters and the optimizer
state of trainable flat parameters in host memory, and each step moves the fp32 gradient down (device to
host) and the updated compute shard up (host to device). ``offload='disk'`` keeps the optimizer state on disk,
and the master too when it is a tensor of its own (mixed precision; in fp32 the master is the compute shard,
which stays): each step reads every offloaded file once and writes it back once (offload/disk.py).
Measured: each storage's tier (a file of the disk tier, host memory on a GPU run, else the device), and on
Linux the bytes the process read from and wrote to storage (``/proc/self/io``) during each step.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.table import Table
from torch import Tensor

from lightning_shardlab.budget.measured.memory import MEMORY_CATEGORIES, measure_memory
from lightning_shardlab.budget.predicted.zero_table import predict_memory
from lightning_shardlab.core.config import PrecisionPolicy, Stage
from lightning_shardlab.core.display import mib
from lightning_shardlab.sharding.flat_param import FlatParamLayout
from lightning_shardlab.sharding.optimizer import OptimizerShape
from lightning_shardlab.sharding.sharded_model import ShardedModel

TIERS = ("device", "host", "disk")
# int8 reductions' residuals (error_feedback) are not offloaded: the memory table shows them, the tiers leave them out
CATEGORIES = tuple(c for c in MEMORY_CATEGORIES if c not in ("padding", "error_feedback"))


@dataclass(frozen=True)
class Link:
    """A path between tiers: bytes per second each way (down: toward the slower tier)."""

    name: str
    down: float
    up: float


LINKS = {
    "nvme": Link("NVMe SSD (PCIe 4.0), ~5 GB/s write, ~7 GB/s read", 5e9, 7e9),
    "ssd": Link("SATA SSD, ~0.5 GB/s write, ~0.55 GB/s read", 0.5e9, 0.55e9),
    "pcie4": Link("PCIe 4.0 x16 host link, ~25 GB/s each way", 25e9, 25e9),
    "pcie5": Link("PCIe 5.0 x16 host link, ~50 GB/s each way", 50e9, 50e9),
}
DEFAULT_LINK = {"cpu": "pcie5", "disk": "nvme"}


def offloaded(category: str, offload: str, mixed: bool, trainable: bool = True, real: bool = True) -> str:
    """The tier ``category`` of a flat parameter lives in under ``offload`` ('none', 'cpu', 'disk'); ``mixed``:
    its master is a tensor of its own (compute dtype != its dtype). A frozen one is never stepped: it stays;
    so does, on disk, a shard of padding only (``real`` False: nothing to offload)."""
    if not trainable:
        return "device"
    if offload == "cpu" and category in ("master", "optimizer_state"):
        return "host"
    if offload == "disk" and real and (category == "optimizer_state" or (category == "master" and mixed)):
        return "disk"
    return "device"


def split_by_tier(memory: dict[str, float], offload: str, mixed: bool) -> dict[str, dict[str, float]]:
    """{tier: {category: bytes}} from per-rank bytes by category (a parameter count: all of it trainable)."""
    out = {tier: dict.fromkeys(CATEGORIES, 0.0) for tier in TIERS}
    for category in CATEGORIES:
        out[offloaded(category, offload, mixed)][category] += memory.get(category, 0.0)
    return out


def predict_locations(
    layouts: list[FlatParamLayout],
    stage: Stage,
    policy: PrecisionPolicy,
    rank: int,
    optimizer: OptimizerShape | None,
    offload: str,
    scalars_in: str = "device",
) -> dict[str, dict[str, float]]:
    """{tier: {category: bytes}} of ``rank`` from the layout, flat parameter by flat parameter. The optimizer's
    step counters stay where torch makes them (``scalars_in``: on a GPU, host memory unless fused)."""
    out = {tier: dict.fromkeys(CATEGORIES, 0.0) for tier in TIERS}
    for lay in layouts:
        mixed = policy.compute_for(lay.dtype) != lay.dtype
        real = lay.shard_numel > lay.padding_in_shard(rank)
        for category, nbytes in predict_memory([lay], stage, policy, rank, optimizer, offload).items():
            if category not in CATEGORIES:
                continue
            if category == "optimizer_state" and optimizer is not None and lay.requires_grad:
                scalars = len(lay.slots) * optimizer.scalar_bytes  # step counters: kept beside the optimizer
                out[scalars_in][category] += scalars
                nbytes -= scalars
            out[offloaded(category, offload, mixed, lay.requires_grad, real)][category] += nbytes
    return out


def predict_moves(
    layouts: list[FlatParamLayout], policy: PrecisionPolicy, offload: str, optimizer: OptimizerShape | None, rank: int
) -> dict[str, float]:
    """Bytes moved between tiers per optimizer step by ``rank``, from the layout: ``down`` (to the slower tier)
    and ``up``. The disk's files hold whole shards, and only shards with real elements have files."""
    down = up = 0.0
    for lay in layouts:
        if not lay.requires_grad or (offload == "disk" and lay.shard_numel == lay.padding_in_shard(rank)):
            continue
        m, c = lay.dtype.itemsize, policy.compute_for(lay.dtype).itemsize
        s = lay.shard_numel
        if offload == "cpu":
            down += s * m  # the fp32 gradient for the step
            up += s * c  # the updated compute shard
        elif offload == "disk":
            files = s * m * (optimizer.per_element if optimizer is not None else 0) + (s * m if c != m else 0)
            down += files  # written back
            up += files  # read in
    return {"down": down, "up": up}


def predict_move_seconds(moves: dict[str, float], link: Link) -> float:
    return moves["down"] / link.down + moves["up"] / link.up


def tier_of(sharded: ShardedModel) -> Any:
    """A function: the tier a tensor of ``sharded``'s run lives in (measured from where it is)."""
    offload, device = sharded.offload, sharded.comm.device

    def where(t: Tensor) -> str:
        if offload is not None and offload.tier == "disk" and offload.holds(t):
            return "disk"
        return "host" if t.device.type == "cpu" and device.type != "cpu" else "device"

    return where


def measure_locations(sharded: ShardedModel, optimizers: list[Any]) -> dict[str, dict[str, int]]:
    """{tier: {category: bytes}}, read from the real tensors' storages."""
    where = tier_of(sharded)
    out = {}
    for tier in TIERS:
        memory = measure_memory(sharded.flat_params, optimizers, keep=lambda t, tier=tier: where(t) == tier)
        out[tier] = {c: memory[c] for c in CATEGORIES}
    return out


def tier_counters(sharded: ShardedModel) -> tuple[float, float, float] | None:
    """(bytes read from storage, bytes written to it, seconds inside offloaded optimizer steps) so far; None
    without offload (nothing to read each step)."""
    if sharded.offload is None:
        return None
    io = io_counters()
    seconds = sharded.offload.step_seconds
    return None if io is None else (float(io[0]), float(io[1]), seconds)


def io_counters() -> tuple[int, int] | None:
    """(bytes read from storage, bytes written to it) by this process so far (Linux), else None."""
    try:
        fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines() if line)
    except OSError:
        return None
    return int(fields["read_bytes"]), int(fields["write_bytes"])


def offload_of(sharded: ShardedModel) -> str:
    """The tier this run offloads to: 'none', 'cpu' or 'disk' ('auto' resolved for its device)."""
    return sharded.config.offload_tier(sharded.comm.device)


def tier_report(sharded: ShardedModel, optimizers: list[Any], optimizer: OptimizerShape | None) -> dict[str, Any]:
    """The budget's offload entries for this rank (measured locations, predicted locations and moves)."""
    offload = offload_of(sharded)
    layouts = [fp.layout for fp in sharded.flat_params]
    stage, policy, rank = sharded.config.stage, sharded.policy, sharded.mesh.shard.rank
    return {
        "offload": offload,
        "locations_measured": measure_locations(sharded, optimizers),
        "locations_predicted": predict_locations(
            layouts, stage, policy, rank, optimizer, offload, "device" if sharded.comm.device.type == "cpu" else "host"
        ),
        "tier_moves_predicted_per_step": (moves := predict_moves(layouts, policy, offload, optimizer, rank)),
        "tier_seconds_predicted_per_step": predict_move_seconds(moves, LINKS[DEFAULT_LINK.get(offload, "pcie5")]),
    }


def tier_table(everyone: list[dict[str, Any]]) -> Table:
    """Per rank and tier: bytes by category, measured (predicted); the disk's bytes read and written per step."""
    table = Table(title=f"shardlab budget: where each byte lives (offload={everyone[0]['offload']!r}), MiB measured"
                  " (predicted); per step: bytes to and from the tier")  # fmt: skip
    columns = ("per step down (predicted)", "per step up (predicted)", "optimizer step s (link bound)")
    for col in ("rank", "tier", *CATEGORIES, *columns):
        table.add_column(col, justify="right")
    for r in everyone:
        moves, io = r["tier_moves_predicted_per_step"], r.get("storage_io_per_step")
        for tier in TIERS:
            m, p = r["locations_measured"][tier], r["locations_predicted"][tier]
            if not any(m.values()) and not any(p.values()):
                continue
            cells = [f"{mib(m[c])} ({mib(p[c])})" for c in CATEGORIES]
            down = up = seconds = ""
            if tier != "device" and (tier == "disk" or r["offload"] == "cpu"):
                measured = io if tier == "disk" and io is not None else None
                down = (mib(measured["written"]) + " " if measured else "") + f"({mib(moves['down'])})"
                up = (mib(measured["read"]) + " " if measured else "") + f"({mib(moves['up'])})"
                bound = f"({r['tier_seconds_predicted_per_step']:.4f})"
                seconds = (f"{measured['offload_seconds']:.4f} " if measured else "") + bound
            table.add_row(str(r["rank"]), tier, *cells, down, up, seconds)
    return table


# ---- shardlab plan: the tiers of a planned run, and whether the device holds the rest ----


def plan_fields(
    locations: dict[str, dict[str, float]],
    moves: dict[str, float],
    offload: str,
    link: str | None,
    device_memory: float | None,
    gathered_peak: float,
) -> dict[str, Any]:
    """The Plan's offload fields: where each category lives, the bytes moved between tiers per step and their
    time on ``link`` (default: NVMe for disk, PCIe 5 for the host), and, given ``device_memory`` bytes,
    whether the device-resident model state plus the gathered units at their peak fit (activations are
    not counted: they depend on the batch)."""
    chosen = LINKS[link or DEFAULT_LINK.get(offload, "pcie5")]
    device = sum(locations["device"].values()) + gathered_peak
    return {
        "offload": offload,
        "locations": locations,
        "tier_moves": moves,
        "tier_link": chosen.name,
        "tier_seconds": predict_move_seconds(moves, chosen) if offload != "none" else 0.0,
        "device_bytes": device,
        "device_memory": device_memory,
        "fits": None if device_memory is None else device <= device_memory,
    }


def plan_rows(fields: dict[str, Any]) -> list[tuple[str, float | str]]:
    """(label, bytes or text) rows for the plan's table."""
    rows: list[tuple[str, float | str]] = []
    if fields["offload"] != "none":
        for tier in TIERS:
            rows.append(
                (
                    f"lives in {tier} memory" if tier != "disk" else "lives on disk",
                    sum(fields["locations"][tier].values()),
                )
            )
        below = "disk" if fields["offload"] == "disk" else "host"
        rows.append((f"moved per step to the {below}", fields["tier_moves"]["down"]))
        rows.append((f"moved per step from the {below}", fields["tier_moves"]["up"]))
        rows.append((f"tier transfers >= ({fields['tier_link']})", f"{fields['tier_seconds'] * 1e3:,.1f} ms"))
    if fields["device_memory"] is not None:
        verdict = "fits" if fields["fits"] else "does not fit"
        rows.append(("device memory needed (state + gathered units; no activations)", fields["device_bytes"]))
        rows.append((f"in {fields['device_memory'] / 1e9:,.0f} GB of device memory", verdict))
    return rows
