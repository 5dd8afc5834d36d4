"""The overlap of communication kernels with compute kernels, read from a profiler trace
(budget/measured/kernel_overlap.py): by hand on given kernels, and the format of torch.profiler's own trace."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_shardlab.budget.measured.kernel_overlap import kernel_kind, overlap_by_kind, overlap_in_trace


def kernel(name: str, start: float, end: float, stream: int = 7) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": start, "dur": end - start, "pid": 0, "tid": stream}


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "all_gather"),
        ("ncclKernel_ReduceScatter_RING_LL_Sum_float", "reduce_scatter"),
        ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "all_reduce"),
        ("ncclDevKernel_SendRecv", "other"),
        ("ampere_sgemm_128x64_tn", None),
        ("void at::native::vectorized_elementwise_kernel<4, ...>", None),
    ],
)
def test_a_kernel_is_named_by_its_collective_or_is_compute(name: str, kind: str | None) -> None:
    assert kernel_kind(name) == kind


def test_each_kinds_time_under_compute_by_hand() -> None:
    """Compute runs 0-10 and 12-20 us (two streams overlapping at 8-10); an all-gather 5-15 is hidden for 5 + 3 of
    its 10 us; two reduce-scatters 20-25 and 24-30 (one span of 10 us) start as compute ends: none hidden."""
    events = [
        kernel("sgemm", 0, 10),
        kernel("elementwise", 8, 10, stream=9),
        kernel("softmax", 12, 20),
        kernel("ncclDevKernel_AllGather_RING_LL", 5, 15, stream=20),
        kernel("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", 20, 25, stream=21),
        kernel("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", 24, 30, stream=21),
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 40},  # host time: not a kernel
        {"ph": "i", "cat": "kernel", "name": "ncclDevKernel_AllGather", "ts": 0},  # not a complete event
    ]
    out = overlap_by_kind(events)
    assert set(out) == {"all_gather", "reduce_scatter"}
    assert out["all_gather"] == pytest.approx({"seconds": 10e-6, "hidden": 8e-6, "fraction": 0.8})
    assert out["reduce_scatter"] == pytest.approx({"seconds": 10e-6, "hidden": 0.0, "fraction": 0.0})


def test_a_cpu_runs_trace_holds_no_communication_kernels(tmp_path: Path) -> None:
    """torch.profiler's own trace file is read (its events under ``traceEvents``); on CPU it has no kernels."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.randn(8, 8) @ torch.randn(8, 8)
    prof.export_chrome_trace(str(tmp_path / "trace.json"))
    assert overlap_in_trace(tmp_path / "trace.json") == {}
