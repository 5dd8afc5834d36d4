"""What the engine's own work costs per unit, measured on this machine: the price a step pays beside its kernels.

A unit's forward and backward run the engine's hooks (sharding/hooks.py) around the model's kernels: unshard, reshard,
lay gradients out and launch their reduce-scatter. On a CPU, where the host runs every kernel itself, that Python work
adds to the step, and for a small model it is most of it (benchmarks/TIME_PREDICTION.md, the tiny stack).
``engine_cost`` runs tiny blocks (compute_rate.py's ``ProbeBlock``), one unit each, sharded at the run's stage on a
world of one (every hook runs, no collective leaves the process: links are timed apart) beside the same blocks
unsharded, with 2 and 6 blocks: the slope is a unit's cost, the intercept (less the root's unit) the step's own. A
GPU's host queues this work ahead of the device's kernels: 0 there.
"""

from __future__ import annotations

import copy
import dataclasses
import functools

import torch
from torch import nn

from lightning_shardlab.budget.predicted.compute_rate import ComputeRate, EngineCost, ProbeBlock, median_seconds
from lightning_shardlab.comm.collectives import Comm
from lightning_shardlab.core.config import ShardLabConfig, Stage
from lightning_shardlab.sharding.build import shard_model

SIZES = (2, 6)  # blocks (units) in the two probes: per unit from the slope, per step from the intercept
WARM_UP = 3  # steps run before timing


def _extra_seconds(blocks: int, stage: int, dev: torch.device) -> tuple[float, float]:
    """(forward, backward) seconds the engine adds to ``blocks`` tiny blocks, one unit each, at ``stage``."""
    plain = nn.Sequential(*(ProbeBlock(8) for _ in range(blocks))).to(dev)
    sharded = copy.deepcopy(plain)
    config = ShardLabConfig(stage=Stage(stage), unit_classes=[ProbeBlock])
    shard_model(sharded, config, Comm(rank=0, world_size=1, device=dev))
    x = torch.randn(2, 8, device=dev)
    for _ in range(WARM_UP):  # the engine's first steps differ (no forward order to prefetch by yet)
        for module in (plain, sharded):
            module(x).sum().backward()
    forward = [median_seconds(lambda m=m: m(x).sum(), dev) for m in (plain, sharded)]
    step = [median_seconds(lambda m=m: m(x).sum().backward(), dev) for m in (plain, sharded)]
    extra_forward = forward[1] - forward[0]
    return extra_forward, step[1] - step[0] - extra_forward


@functools.cache
def engine_cost(device: str, threads: int, stage: int) -> EngineCost:
    """The engine's work at ``stage`` on ``device`` (the module's docstring); nothing on a GPU."""
    dev = torch.device(device)
    if dev.type != "cpu":
        return EngineCost()
    (f1, b1), (f2, b2) = (_extra_seconds(n, stage, dev) for n in SIZES)
    span = SIZES[1] - SIZES[0]
    unit_f, unit_b = max((f2 - f1) / span, 0.0), max((b2 - b1) / span, 0.0)
    # the root is a unit too: what is left at no blocks is one unit's work + the step's own
    step_f = max(f1 - (SIZES[0] + 1) * unit_f, 0.0)
    step_b = max(b1 - (SIZES[0] + 1) * unit_b, 0.0)
    return EngineCost(unit_f, unit_b, step_f, step_b)


def with_engine_cost(rate: ComputeRate, stage: int) -> ComputeRate:
    """``rate`` (measured on this machine's ``rate.device``) with the engine's work at ``stage`` measured beside it,
    in the same process and thread count."""
    return dataclasses.replace(rate, engine=engine_cost(rate.device, torch.get_num_threads(), int(stage)))
