"""How fast a device works: the rates that turn traced work (budget/predicted/compute_trace.py) into seconds.

    seconds = FLOPs / flops_per_second + bytes / bytes_per_second + kernels x seconds_per_op

(a sum, not the roofline's max: a unit's matmuls and its memory-bound ops run one after the other). A rate is either
**given** (cli/plan.py's ``preset_rate``): a named device's dense peak (zero_table.py's ``DEVICES``) x ``--mfu``, or
``--flops``, with its datasheet memory bandwidth (``MEMORY_BANDWIDTH``) and no per-kernel cost (a GPU queues kernels
ahead of the ones running); or **measured** here (``measure_rate``) at the run's thread count, on the traced model's
own work (what each probe runs: docs/budget.md, "The time per step"): for FLOP/s its heaviest matmul shapes (rows
cut so one call stays under ~0.4 GFLOP on a CPU, 1 TFLOP on a GPU), convolutions and attention, as many as carry 95 %
of its FLOPs (``flop_rate``); its heaviest memory-bound ops for bytes/s, each call's fixed cost taken off
(``model_bandwidth``: on a CPU norms, softmax and casts run slower per byte than a copy); four tiny hooked blocks
forward and backward for a kernel as a step dispatches it (``seconds_per_op``), and in-place multiplications under
``no_grad`` for one an optimizer dispatches (``seconds_per_bare_op``). Without a
trace: a 512 x 512 x 512 matmul and a 64 MiB copy (1 GiB on a GPU).

Each probe runs a warm-up call, then at least 5 calls and more until ~50 ms have passed (at most 200), and keeps the
median: a small op's five calls take microseconds, and their median moved by half from one process to the next.
They are cached per process, by device, dtype, shape and thread count: a run or a plan pays them once (0.1-0.5 s
for the models of benchmarks/TIME_PREDICTION.md on one CPU core; ``measure_rate`` returns the seconds it spent as
``probe_seconds``).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_map

from lightning_shardlab.budget.predicted.compute_trace import ComputeTrace, TensorSpec, TracedOp, Work, WorkMode

MEMORY_BANDWIDTH = {  # bytes per second of device memory, from each vendor's datasheet
    "h100": 3.35e12,  # H100 SXM5 80 GB, HBM3 (NVIDIA H100 Tensor Core GPU datasheet)
    "a100": 2.039e12,  # A100 80 GB SXM, HBM2e (NVIDIA A100 datasheet)
    "h200": 4.8e12,  # H200 SXM 141 GB, HBM3e (NVIDIA H200 datasheet)
    "l4": 300e9,  # L4 24 GB, GDDR6 (NVIDIA L4 datasheet)
    "cpu-core": 10e9,  # one core's share of a DDR socket: an assumption; measure a CPU with `--flops here`
}
PROBE_FLOPS = {"cpu": 4e8, "cuda": 1e12}  # FLOPs: the most one timed matmul call may do
PROBE_BYTES = {"cpu": 64 * 2**20, "cuda": 2**30}  # bytes: the copy timed for the memory bandwidth
BUDGET = 0.05  # seconds: each probe repeats until this much has passed
CALLS = (5, 200)  # the fewest and the most calls a probe times
FLOP_SHARE, KINDS = 0.95, 8  # the FLOP rate times the heaviest kinds of op that carry this share of FLOPs, this many


@dataclass(frozen=True)
class EngineCost:
    """Seconds of the engine's own work (its hooks, budget/predicted/engine_cost.py): per unit and micro-batch, and
    per step (holding the root for it, the end of backward), each in forward and in backward."""

    unit_forward: float = 0.0
    unit_backward: float = 0.0
    step_forward: float = 0.0
    step_backward: float = 0.0

    def scaled(self, k: float) -> EngineCost:
        return EngineCost(*(k * v for v in dataclasses.astuple(self)))

    @staticmethod
    def median(costs: list[EngineCost]) -> EngineCost:
        return EngineCost(*(statistics.median(values) for values in zip(*map(dataclasses.astuple, costs))))


@dataclass(frozen=True)
class ComputeRate:
    """What a device sustains: FLOP/s on matmuls, bytes/s on memory-bound ops, seconds per kernel."""

    name: str  # where the numbers come from, e.g. "h100 x 0.4" or "measured here: cpu, 1 thread, bfloat16"
    flops_per_second: float  # FLOP/s
    bytes_per_second: float  # bytes/s
    seconds_per_op: float = 0.0  # seconds per kernel
    device: str = "cuda"  # the device type the rate is for
    probe_seconds: float = 0.0  # how long measuring took (0: given)
    engine: EngineCost = EngineCost()  # the engine's own work, per unit and per step (engine_cost.py; 0: given)
    seconds_per_bare_op: float = 0.0  # a kernel outside modules and autograd (the optimizer's); 0: seconds_per_op

    def seconds(self, work: Work, bare: bool = False) -> float:
        """Seconds for ``work``: FLOPs at the matmul rate + bytes at the memory bandwidth + each kernel's cost
        (``bare``: kernels dispatched outside modules and autograd, as an optimizer's step runs them)."""
        per_op = self.seconds_per_bare_op if bare and self.seconds_per_bare_op else self.seconds_per_op
        return work.flops / self.flops_per_second + work.bytes / self.bytes_per_second + work.ops * per_op


# ---- measured ----


def median_seconds(call: Callable[[], object], device: torch.device) -> float:
    """Median seconds of ``call()`` after a warm-up, repeated until ``BUDGET`` seconds pass (``CALLS``: within)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *_: None)
    call()
    sync(device)
    samples: list[float] = []
    began = time.perf_counter()
    fewest, most = CALLS
    while len(samples) < fewest or (len(samples) < most and time.perf_counter() - began < BUDGET):
        start = time.perf_counter()
        call()
        sync(device)
        samples.append(time.perf_counter() - start)
    return max(statistics.median(samples), 1e-9)


@functools.cache
def matmul_rate(shape: tuple[int, int, int, int], dtype: torch.dtype, device: str, threads: int) -> float:
    """FLOP/s of a (batch, m, k, n) matmul on ``device`` in ``dtype`` (m cut down to keep one call short)."""
    dev = torch.device(device)
    batch, m, k, n = shape
    m = max(1, min(m, int(PROBE_FLOPS[dev.type] / (2 * batch * k * n))))
    lhs = torch.randn(batch, m, k, device=dev).to(dtype)
    rhs = torch.randn(batch, k, n, device=dev).to(dtype)
    seconds = median_seconds(lambda: torch.bmm(lhs, rhs) if batch > 1 else lhs[0] @ rhs[0], dev)
    return 2.0 * batch * m * k * n / seconds


@functools.cache
def memory_bandwidth(device: str, threads: int) -> float:
    """Bytes/s of a copy on ``device``: read + written."""
    dev = torch.device(device)
    source = torch.empty(PROBE_BYTES[dev.type] // 4, device=dev).fill_(1.0)
    target = torch.empty_like(source)
    return 2.0 * PROBE_BYTES[dev.type] / median_seconds(lambda: target.copy_(source), dev)


class ProbeBlock(torch.nn.Module):
    """A block of a model as small as it gets: a norm, a linear, an activation and a residual add."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.linear = torch.nn.LayerNorm(width), torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.nn.functional.gelu(self.linear(self.norm(x)))


@functools.cache
def seconds_per_op(device: str, threads: int) -> float:
    """Seconds of one kernel as a training step dispatches it (and launches it, on a GPU): through a module's call
    with a unit's forward hooks on it, autograd recording, and its backward. Four tiny blocks (``ProbeBlock``, each
    hooked as the engine hooks a unit) run forward and backward, timed; the kernels of their forward are counted as a
    trace counts them (compute_trace.py's ``WorkMode``), and the time model prices a backward as twice its forward,
    so one kernel's cost is the whole over three times that count: forward and backward priced as they ran."""
    dev = torch.device(device)
    blocks = torch.nn.Sequential(*(ProbeBlock(8) for _ in range(4))).to(dev)
    for block in blocks:
        block.register_forward_pre_hook(lambda module, args: None)
        block.register_forward_hook(lambda module, args, output: None)
    x = torch.randn(2, 8, device=dev)
    with WorkMode() as counted:
        blocks(x).sum()

    def step() -> None:
        blocks(x).sum().backward()

    return median_seconds(step, dev) / (3 * counted.ops)


@functools.cache
def seconds_per_bare_op(device: str, threads: int) -> float:
    """Seconds of one tiny kernel dispatched from Python outside modules and autograd, as an optimizer's step runs its
    kernels: 100 in-place multiplications of a small tensor under ``no_grad``, over 100."""
    dev = torch.device(device)
    x = torch.ones(8, device=dev)

    @torch.no_grad()
    def chain() -> None:
        for _ in range(100):
            x.mul_(1.0)

    return median_seconds(chain, dev) / 100


def _realized(spec: TensorSpec, dev: torch.device) -> torch.Tensor:
    """A real tensor for a traced one: random values if floating, zeros (valid indices) otherwise."""
    if spec.dtype.is_floating_point:
        return torch.randn(spec.shape, device=dev).to(spec.dtype)
    return torch.zeros(spec.shape, dtype=spec.dtype, device=dev)


def call_seconds(op: TracedOp, dev: torch.device) -> float | None:
    """Seconds of one call of a traced op, run for real on tensors of its traced shapes; None when it does not run
    on random values (an op that needs indices in range, a mask)."""
    try:
        args, kwargs = tree_map(lambda v: _realized(v, dev) if isinstance(v, TensorSpec) else v, op.template)
        return median_seconds(lambda: op.func(*args, **kwargs), dev)
    except Exception:  # noqa: BLE001 - left out
        return None


def model_bandwidth(ops: list[TracedOp], dev: torch.device, fixed: float, copy: float, least: float) -> float | None:
    """Bytes/s of the model's own heaviest memory-bound ops (a trace's ``memory_ops``), each run for real: the bytes
    one call of each moves over the time one call of each takes beyond an op's fixed cost when called directly
    (``fixed``: ``seconds_per_bare_op``; the time model charges each kernel's apart). An op whose bytes a copy
    (``copy`` bytes/s) moves in less than ``least`` seconds (a kernel's cost in a step) tells nothing of bandwidth,
    its call being mostly dispatch, and is left out (a small model's norms read a few MB/s so); None when none is
    left."""
    ran = []
    for op in ops:
        nbytes = op.bytes / max(op.calls, 1)
        if nbytes / copy > least and (seconds := call_seconds(op, dev)) and seconds > fixed:
            ran.append((nbytes, seconds - fixed))
    moved, seconds = sum(b for b, _ in ran), sum(t for _, t in ran)
    return moved / seconds if moved and seconds else None


def flop_rate(
    matmuls: dict[tuple[int, int, int, int], float], flop_ops: list[TracedOp], dtype: torch.dtype, dev: torch.device
) -> float:
    """FLOP/s of the model's own FLOP-carrying shapes, matmuls (``matmul_rate``) and other ops (convolutions,
    attention: ``call_seconds``): the heaviest that carry ``FLOP_SHARE`` of its FLOPs (at most ``KINDS``), each
    weighted by the FLOPs it carries in the step, so that every kind's seconds add up as the step's do; a square
    512 x 512 x 512 matmul when none was traced (or none ran)."""
    threads = torch.get_num_threads()

    def matmul(shape: tuple[int, int, int, int]) -> Callable[[], float]:
        return lambda: matmul_rate(shape, dtype, str(dev), threads)

    def other(op: TracedOp) -> Callable[[], float | None]:
        return lambda: (op.flops / max(op.calls, 1) / t) if (t := call_seconds(op, dev)) else None

    kinds = [(flops, matmul(shape)) for shape, flops in matmuls.items()] + [(op.flops, other(op)) for op in flop_ops]
    total, carried, timed = sum(flops for flops, _ in kinds), 0.0, []
    for flops, probe in sorted(kinds, key=lambda kv: -kv[0])[:KINDS]:
        if carried >= FLOP_SHARE * total:
            break
        carried += flops
        if rate := probe():
            timed.append((flops, rate))
    timed = timed or [(1.0, matmul((1, 512, 512, 512))())]
    return sum(flops for flops, _ in timed) / sum(flops / rate for flops, rate in timed)


def measure_rate(device: torch.device | str, dtype: torch.dtype, traced: ComputeTrace | None = None) -> ComputeRate:
    """The rates measured on ``device`` at this process's thread count: the FLOP rate of the ``traced`` model's
    heaviest matmuls and other FLOP ops (convolutions, attention) in ``dtype`` (``flop_rate``); the bandwidth of its own
    heaviest memory-bound ops (norms, activations, softmax run slower per byte than a copy), else of a copy; a
    kernel's cost. The probes of fixed shapes are cached per process."""
    dev, threads, began = torch.device(device), torch.get_num_threads(), time.perf_counter()
    traced = traced or ComputeTrace()
    rate = flop_rate(traced.matmuls, traced.flop_ops, dtype, dev)
    per_op, bare = seconds_per_op(str(dev), threads), seconds_per_bare_op(str(dev), threads)
    copy = memory_bandwidth(str(dev), threads)
    bandwidth = model_bandwidth(traced.memory_ops, dev, bare, copy, per_op) or copy
    name = (
        f"measured here: {dev.type}, {threads} thread{'s' if threads > 1 else ''}, {str(dtype).removeprefix('torch.')}"
    )
    return ComputeRate(name, rate, bandwidth, per_op, dev.type, time.perf_counter() - began, seconds_per_bare_op=bare)


def median_rate(rates: list[ComputeRate]) -> ComputeRate | None:
    """One rate for the ranks of a machine, from each one's probe: the median of each figure (a probe that another
    process slowed is outvoted, and ranks doing the same work get the same prediction); None for none."""
    if not rates:
        return None
    if len(rates) == 1:
        return rates[0]
    return dataclasses.replace(
        rates[0], name=f"{rates[0].name}, the median of {len(rates)} ranks' probes",
        flops_per_second=statistics.median(r.flops_per_second for r in rates),
        bytes_per_second=statistics.median(r.bytes_per_second for r in rates),
        seconds_per_op=statistics.median(r.seconds_per_op for r in rates),
        seconds_per_bare_op=statistics.median(r.seconds_per_bare_op for r in rates),
        engine=EngineCost.median([r.engine for r in rates]),
        probe_seconds=max(r.probe_seconds for r in rates),
    )  # fmt: skip


def _cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def sharing_cores(rate: ComputeRate, ranks_here: int) -> ComputeRate:
    """``rate`` as each of ``ranks_here`` ranks on this CPU gets it when their threads outnumber its cores: the
    OS time-slices them, so each rank sustains cores / (ranks x threads) of what one probe alone measured (the
    probes run in one process at a time). A GPU, or a CPU with a core for every thread, is left as it is."""
    if rate.device != "cpu":
        return rate
    cores = _cores()
    share = min(1.0, cores / (ranks_here * torch.get_num_threads()))
    if share == 1.0:
        return rate
    name = f"{rate.name}, x {share:.2f}: {ranks_here} ranks share {cores} cores"
    return dataclasses.replace(
        rate, name=name, flops_per_second=rate.flops_per_second * share,
        bytes_per_second=rate.bytes_per_second * share, seconds_per_op=rate.seconds_per_op / share,
        seconds_per_bare_op=rate.seconds_per_bare_op / share, engine=rate.engine.scaled(1 / share),
    )  # fmt: skip


def link_share(device: str, ranks_here: int) -> float:
    """The share of its speed a link keeps while the ``ranks_here`` ranks on this machine compute: 1 on a GPU (its
    collectives run beside the kernels); on a CPU, the cores the ranks' compute threads leave over for their
    collectives' threads, one per rank at full speed: (cores - ranks x threads) / ranks, within [0, 1]. At 0 a
    collective launched behind compute moves only while its rank waits (benchmarks/TIME_PREDICTION.md: on 2 cores
    with 2 ranks, what stage 3's exposed communication measured)."""
    if device != "cpu":
        return 1.0
    cores = _cores()
    return min(1.0, max(0.0, (cores - ranks_here * torch.get_num_threads()) / ranks_here))
