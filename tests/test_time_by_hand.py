"""The time model by hand (budget/predicted/step_time.py, clocks.py): units of given seconds played on the engine's
schedule, and given rates and per-op, per-unit and per-call costs priced, each figure worked out in its docstring."""

from __future__ import annotations

import pytest

from lightning_shardlab.budget.predicted.compute_rate import ComputeRate, EngineCost
from lightning_shardlab.budget.predicted.compute_trace import ComputeTrace, UnitWork, Work
from lightning_shardlab.budget.predicted.step_time import predict_step_time
from lightning_shardlab.budget.predicted.zero_table import INTERCONNECTS, Links
from lightning_shardlab.core.config import PrecisionPolicy, ShardLabConfig, Stage


@pytest.mark.parametrize("late", [0.0, 4.0])
def test_stage_3_played_by_hand(late: float) -> None:
    """Two units A, B and the root; every gather 1 s (B's 1 + ``late``), forward 3 s, backward 6 s, each
    reduce-scatter 2 s, the root computes nothing. Forward: A's and the root's gathers open the step (2 s exposed);
    B's, launched at A's pre-forward (t = 2), is exposed by max(0, gather(B) - compute(A)). Backward: B
    stayed gathered; A's gather flies behind B's backward; B's reduce-scatter behind A's; at the end A's and then the
    root's reduce-scatter are waited for (4 s exposed)."""
    from lightning_shardlab.budget.predicted.step_time import Schedule, UnitTimes, play

    root = UnitTimes("root", gather=1.0, reduce=2.0)
    a = UnitTimes("A", forward=3.0, backward=6.0, gather=1.0, regather=1.0, reduce=2.0)
    b = UnitTimes("B", forward=3.0, backward=6.0, gather=1.0 + late, regather=1.0, reduce=2.0)
    line = play(root, [a, b], Schedule(Stage.PARAMETERS))
    exposed = max(0.0, b.gather - a.forward)
    assert line.exposed == pytest.approx({"all_gather": 2.0 + exposed, "reduce_scatter": 4.0})
    assert line.wire == pytest.approx({"all_gather": 4.0 + late, "reduce_scatter": 6.0})  # B is not gathered again
    assert line.now == pytest.approx(18.0 + 6.0 + exposed)  # compute + exposed
    # launch to end: the root's gather queued 1 s behind A's on the link
    assert line.in_flight == pytest.approx({"all_gather": 5.0 + late, "reduce_scatter": 6.0})
    kept = play(root, [a, b], Schedule(Stage.PARAMETERS, reshard_after_forward=False))
    assert kept.wire["all_gather"] == pytest.approx(3.0 + late)  # no backward gathers
    stage_2 = play(root, [a, b], Schedule(Stage.GRADIENTS))
    assert "all_gather" not in stage_2.exposed and stage_2.now == pytest.approx(18.0 + 4.0)  # no refresh given


def test_a_launch_is_paid_as_compute_if_compute_runs_before_its_wait_else_in_its_wait_by_hand() -> None:
    """Each call costs the host 0.5 s (``UnitTimes.launch``), links move only while compute waits (a CPU's,
    ``link_share`` 0). Stage 3 launches 7 calls: the root's and A's gathers open the step and are waited for before
    anything computes (paid in their waits), B's gather is launched before A's forward (paid as compute in forward);
    in backward, A's regather and B's reduce-scatter fly while B and A compute (paid as compute), A's and the root's
    reduce-scatters are waited for at the end (in their waits). Stage 2: B's reduce-scatter flies while A computes;
    A's, the root's and the 3 refreshes after the optimizer step are waited for at once. Either way the step is
    longer by every launch, and the parts that launched are longer by those paid as compute."""
    from lightning_shardlab.budget.predicted.step_time import Schedule, UnitTimes, play

    def units(launch: float) -> tuple[UnitTimes, list[UnitTimes]]:
        root = UnitTimes("root", gather=1.0, reduce=2.0, refresh=1.0, launch=launch)
        ab = [UnitTimes(n, 3.0, 6.0, 0.0, 1.0, 1.0, 2.0, 0.0, 1.0, launch) for n in "AB"]
        return root, ab

    for stage, as_compute, calls in (
        (Stage.PARAMETERS, {"forward": 0.5, "backward": 1.0}, 7),
        (Stage.GRADIENTS, {"backward": 0.5}, 6),
    ):
        free, paid = (play(*units(launch), Schedule(stage), link_share=0.0) for launch in (0.0, 0.5))
        assert paid.launching == pytest.approx(as_compute), stage
        assert paid.now == pytest.approx(free.now + 0.5 * calls), stage
        in_waits = 0.5 * calls - sum(as_compute.values())
        assert sum(paid.exposed.values()) == pytest.approx(sum(free.exposed.values()) + in_waits), stage


def test_a_busy_ranks_latency_only_where_compute_runs_beside_a_call_by_hand() -> None:
    """A call's messages take its link's latency when it is waited for back to back, and a busy rank's where compute
    runs while it is pending (``UnitTimes.beside``: 0.25 s more a call here; links move only while compute waits).
    Stage 3: B's gather (launched before A's forward), A's regather (behind B's backward) and B's reduce-scatter
    (behind A's backward) take it, 0.75 s; the root's and A's gathers that open the step and the reduce-scatters
    waited for at the end of backward do not. Stage 2: B's reduce-scatter alone, 0.25 s; the refreshes after the
    optimizer step are waited for at once."""
    from lightning_shardlab.budget.predicted.step_time import Schedule, UnitTimes, play

    def units(beside: float) -> tuple[UnitTimes, list[UnitTimes]]:
        root = UnitTimes("root", gather=1.0, reduce=2.0, refresh=1.0, beside=beside)
        ab = [UnitTimes(n, 3.0, 6.0, 0.0, 1.0, 1.0, 2.0, 0.0, 1.0, beside=beside, beside_regather=beside) for n in "AB"]
        return root, ab

    for stage, extra in ((Stage.PARAMETERS, 0.75), (Stage.GRADIENTS, 0.25)):
        plain, busy = (play(*units(beside), Schedule(stage), link_share=0.0) for beside in (0.0, 0.25))
        assert busy.now == pytest.approx(plain.now + extra), stage
        assert sum(busy.wire.values()) == pytest.approx(sum(plain.wire.values()) + extra), stage
        assert sum(busy.exposed.values()) == pytest.approx(sum(plain.exposed.values()) + extra), stage


def test_one_reduce_scatter_in_flight_by_hand() -> None:
    """Three units, C's reduce-scatter slow (10 s): B's post-backward waits for it (4 s exposed, as
    MAX_REDUCTIONS_IN_FLIGHT = 1), and A's backward gather, queued behind it on the link, is 1 s late."""
    from lightning_shardlab.budget.predicted.step_time import Schedule, UnitTimes, play

    root = UnitTimes("root", gather=1.0, reduce=2.0)
    a, b = (UnitTimes(n, forward=3.0, backward=6.0, gather=1.0, regather=1.0, reduce=2.0) for n in "AB")
    c = UnitTimes("C", forward=3.0, backward=6.0, gather=1.0, regather=1.0, reduce=10.0)
    line = play(root, [a, b, c], Schedule(Stage.PARAMETERS))
    # all_gather: the root's and A's at the start (2), A's backward gather behind C's reduce-scatter (1);
    # reduce_scatter: C's at B's post-backward (4), A's and the root's at the end of backward (2 + 2)
    assert line.exposed == pytest.approx({"all_gather": 3.0, "reduce_scatter": 8.0})
    assert line.now == pytest.approx(27.0 + 11.0)


@pytest.mark.quick
@pytest.mark.parametrize("micro_batches", [1, 2])
def test_per_op_and_per_unit_costs_by_hand(micro_batches: int) -> None:
    """The time model on given rates (budget/predicted/compute_rate.py, engine_cost.py): a unit's forward is its
    FLOPs / FLOP/s + bytes / bandwidth + kernels x the cost of a kernel in a step + the engine's work per unit; its
    backward 2 x the FLOPs, the bytes once and 2 x the kernels, + the engine's backward work per unit; the
    optimizer's kernels at the cost of a bare kernel; the data as given. No collective (the units have no flat
    parameters)."""
    rate = ComputeRate(
        "by hand", flops_per_second=1e9, bytes_per_second=1e8, seconds_per_op=1e-5, device="cpu",
        seconds_per_bare_op=2e-6, engine=EngineCost(1e-4, 3e-4, 5e-5, 7e-5),
    )  # fmt: skip
    work = {"root": Work(flops=2e6, bytes=1e5, ops=10), "a": Work(flops=4e6, bytes=0.0, ops=20)}
    compute = ComputeTrace({name: UnitWork(w) for name, w in work.items()})
    link = INTERCONNECTS["nvlink"]
    out = predict_step_time(
        {"root": [], "a": []}, compute, rate, ShardLabConfig(stage=3), PrecisionPolicy(), Links(link, link),
        micro_batches=micro_batches, optimizer=Work(bytes=1e5, ops=50), data_seconds=0.004,
    )  # fmt: skip
    # the root: a unit's engine work + the step's (holding the root, the end of backward)
    forward = {"root": 0.002 + 0.001 + 10e-5 + 1e-4 + 5e-5, "a": 0.004 + 0.0 + 20e-5 + 1e-4}
    # backward: 2 x the FLOPs, the bytes once, 2 x the kernels
    backward = {"root": 2 * 0.002 + 0.001 + 2 * 10e-5 + 3e-4 + 7e-5, "a": 2 * (0.004 + 20e-5) + 3e-4}
    for name in work:
        assert out["by_unit"][name]["forward"] == pytest.approx(micro_batches * forward[name]), name
        assert out["by_unit"][name]["backward"] == pytest.approx(micro_batches * backward[name]), name
    assert out["optimizer"] == pytest.approx(1e5 / 1e8 + 50 * 2e-6) and out["data"] == 0.004
    assert out["comm_exposed"] == 0.0 and out["step"] == pytest.approx(
        micro_batches * (sum(forward.values()) + sum(backward.values())) + 0.0011 + 0.004
    )
