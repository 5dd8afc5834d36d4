"""The time per step predicted (budget/predicted/step_time.py): pure arithmetic on layouts, traced work and links, no
processes, no clocks. Rates and links are given here, so no figure depends on this machine."""

from __future__ import annotations

import dataclasses
import functools
import json
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from lightning_shardlab.budget.predicted import changes
from lightning_shardlab.budget.predicted.changes import plan_time
from lightning_shardlab.budget.predicted.clocks import Timeline
from lightning_shardlab.budget.predicted.compute_rate import ComputeRate, EngineCost
from lightning_shardlab.budget.predicted.compute_trace import ComputeTrace
from lightning_shardlab.budget.predicted.first_batch import predict_first_batch
from lightning_shardlab.budget.predicted.forward_trace import trace_forward
from lightning_shardlab.budget.predicted.plan import plan_model
from lightning_shardlab.budget.predicted.run_time import time_predicted_for_run
from lightning_shardlab.budget.predicted.setting import Setting
from lightning_shardlab.budget.predicted.step_time import PARTS, predict_step_time
from lightning_shardlab.budget.predicted.zero_table import INTERCONNECTS, Interconnect, Links
from lightning_shardlab.cli.plan import main
from lightning_shardlab.core.config import Accumulation, PrecisionPolicy, ShardLabConfig, Stage
from lightning_shardlab.examples.gpt import GPT
from lightning_shardlab.sharding.policy import plan_units

INIT = {"vocab_size": 128, "block_size": 64, "n_layer": 3, "n_head": 2, "n_embd": 64}
ONE_UNIT_PER_BLOCK = {"unit_bucket_params": 0}  # the tiny blocks would be bucketed into one unit
RATE = ComputeRate(
    "given for the tests", flops_per_second=1e10, bytes_per_second=1e10, seconds_per_op=1e-6, device="cpu"
)
KEYS = {*PARTS, "step", "comm_hidden", "by_unit", "by_collective"}


@functools.cache
def gpt() -> nn.Module:
    with torch.device("meta"):
        return GPT(**INIT)


def setting(link: str = "10gbe", rate: ComputeRate = RATE, world_size: int = 2, **options: Any) -> Setting:
    config = ShardLabConfig(**{**ONE_UNIT_PER_BLOCK, **options})
    inter = INTERCONNECTS[link]
    timed = Setting(gpt(), config, world_size, "32-true", "adamw", inter, inter, "gpt", 2, 32, rate)
    timed.traces["compute", 2, bool(config.activation_checkpointing)] = _trace(config.activation_checkpointing)
    return timed


@functools.cache
def _trace(checkpointing: bool) -> ComputeTrace:
    config = ShardLabConfig(**ONE_UNIT_PER_BLOCK, activation_checkpointing=checkpointing)
    return trace_forward(gpt(), 2, 32, "32-true", config=config).work.checkpointed(checkpointing)


@pytest.mark.quick
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_every_key_is_there_non_negative_and_the_step_is_the_sum_of_its_parts(stage: int) -> None:
    time = setting(stage=Stage(stage)).predict()
    assert KEYS <= set(time)
    assert all(time[k] >= 0 for k in (*PARTS, "step", "comm_hidden"))
    assert time["step"] == pytest.approx(sum(time[k] for k in PARTS))  # comm_hidden overlaps: not a part
    assert time["waiting_for_ranks"] == 0.0 and time["data"] == 0.0
    assert list(time["by_unit"]) == ["root", "blocks.0", "blocks.1", "blocks.2"]
    units = time["by_unit"].values()  # backward: 2 x the FLOPs and kernels, the memory-bound bytes once
    assert all(v["forward"] > 0 and v["forward"] < v["backward"] < 2 * v["forward"] for v in units)
    assert time["forward"] == pytest.approx(sum(v["forward"] for v in time["by_unit"].values()))
    assert set(time["by_collective"]) == {"all_gather", "reduce_scatter"}
    kinds_by_name = time["by_collective"]
    kinds = kinds_by_name.values()
    exposed, hidden = sum(v["exposed"] for v in kinds), sum(v["hidden"] for v in kinds)
    assert exposed == pytest.approx(time["comm_exposed"]) and hidden == pytest.approx(time["comm_hidden"])
    for v in kinds:  # each call flies from its launch to its end: before its wait (hidden), then waited for
        assert v["in_flight"] == pytest.approx(v["hidden"] + v["exposed"]) and v["in_flight"] >= v["seconds"] * (
            1 - 1e-9
        )
    assert time["optimizer"] > 0
    played = time["timeline"]  # the same step as the picture draws it: each part, each exposed wait, each call
    assert played["step_seconds"] == pytest.approx(time["step"])
    for cat in ("forward", "backward", "optimizer", "comm_exposed"):
        drawn = sum(e["dur"] for e in played["events"] if e["cat"] == cat and e["lane"] == "compute")
        assert drawn == pytest.approx(time[cat], abs=1e-12), cat
    for kind, v in kinds_by_name.items():
        assert sum(e["dur"] for e in played["events"] if e["cat"] == kind) == pytest.approx(v["in_flight"]), kind


def test_a_call_in_flight_is_hidden_until_its_wait_and_exposed_after_it_as_the_clock_counts_it() -> None:
    line = Timeline()
    line.launch(("gather", "a"), "all_gather", "intra", 1.0)
    line.launch(("gather", "b"), "all_gather", "intra", 0.5)  # queued behind the first: 1.0 s to 1.5 s
    line.compute(1.2)
    line.wait(("gather", "a"))  # ended at 1.0, before its wait: hidden 1.0
    line.wait(("gather", "b"))  # waited for from 1.2 to 1.5: hidden 1.2, exposed 0.3
    assert line.hidden["all_gather"] == pytest.approx(2.2) and line.exposed["all_gather"] == pytest.approx(0.3)
    assert line.in_flight["all_gather"] == pytest.approx(2.5) and line.wire["all_gather"] == pytest.approx(1.5)
    assert line.to_wait["all_gather"] == pytest.approx(1.2 + 1.5)  # a's end seen at its wait (1.2), b's at 1.5


def test_a_link_that_keeps_a_share_of_its_speed_while_compute_runs_finishes_the_rest_while_waited_for() -> None:
    """``Timeline(share)``: at 0 a call moves only while its rank waits (a CPU whose cores all compute), at 0.5 half
    of it moves behind compute; what is left is exposed, queued calls included."""
    for share, exposed in ((0.0, 1.5), (0.5, 0.9)):
        line = Timeline(share)
        line.launch(("gather", "a"), "all_gather", "intra", 1.0)
        line.launch(("gather", "b"), "all_gather", "intra", 0.5)
        line.launch(("across", "a"), "all_reduce", "inter", 0.2)  # another link: it works while the others wait
        line.compute(1.2)  # share 0.5: 0.6 s of a done
        line.wait(("gather", "b"))  # a's rest and then b, at full speed
        line.wait(("gather", "a"))  # ended before b: nothing more exposed
        line.wait(("across", "a"))  # went through during the wait on b
        assert line.exposed["all_gather"] == pytest.approx(exposed), share
        assert line.now == pytest.approx(1.2 + exposed) and "all_reduce" not in line.exposed, share
        assert line.to_wait["all_gather"] == pytest.approx(2 * (1.2 + exposed)), share  # both seen at b's end
    line = Timeline(0.0)
    line.launch(("reduce", "a"), "reduce_scatter", "intra", 0.4)
    line.compute(1.0)
    line.wait(("reduce", "a"))
    assert line.hidden["reduce_scatter"] == pytest.approx(1.0) and line.in_flight["reduce_scatter"] == pytest.approx(
        1.4
    )


def test_the_links_share_is_what_the_ranks_compute_threads_leave_of_the_cores(monkeypatch) -> None:
    from lightning_shardlab.budget.predicted import compute_rate

    monkeypatch.setattr(compute_rate.torch, "get_num_threads", lambda: 1)
    assert compute_rate.link_share("cuda", 8) == 1.0
    for cores, ranks, share in ((16, 2, 1.0), (2, 2, 0.0), (3, 2, 0.5), (2, 4, 0.0)):
        monkeypatch.setattr(
            compute_rate.os, "sched_getaffinity", lambda _, cores=cores: set(range(cores)), raising=False
        )
        assert compute_rate.link_share("cpu", ranks) == share, (cores, ranks)


@pytest.mark.parametrize(
    "options",
    [
        {"stage": Stage(1)},
        {"stage": Stage(2)},
        {"stage": Stage(3)},
        {"stage": Stage(3), "reshard_after_forward": False},
        {"stage": Stage(3), "shard_group_size": 2},
        {"stage": Stage(2), "shard_group_size": 1},  # replicas only: every gradient all-reduced across them
        {"stage": Stage(3), "reshard_after_forward": 2},
    ],
)
def test_the_wire_adds_up_to_the_plans_lower_bound_and_more_bandwidth_never_costs_more(options: dict) -> None:
    slow, fast = INTERCONNECTS["10gbe"], Interconnect("10gbe, twice the bandwidth", 2 * 1.25e9, 50e-6)
    world = 4
    time = setting(world_size=world, **options).predict()
    config = ShardLabConfig(**ONE_UNIT_PER_BLOCK, **options)
    plan = plan_model(gpt(), config, world, "32-true", "adamw", slow, "gpt")
    # one call per flat parameter, at the ring bound of its link: the same sum as the plan's, call for call
    assert sum(v["seconds"] for v in time["by_collective"].values()) == pytest.approx(plan.comm_seconds)
    timed = setting(world_size=world, **options)
    timed.intra = timed.inter = fast
    faster = timed.predict()
    for kind, entry in time["by_collective"].items():
        assert faster["by_collective"][kind]["seconds"] < entry["seconds"]
    assert faster["comm_exposed"] <= time["comm_exposed"] + 1e-12
    assert faster["step"] <= time["step"] + 1e-12


def test_stage_3_exposes_at_least_the_first_units_gather_however_slow_compute_is() -> None:
    slow_compute = ComputeRate("slow", 1e6, 1e6, 1e-3)  # every collective could hide behind this compute
    time = setting(rate=slow_compute, stage=Stage(3)).predict()
    link = INTERCONNECTS["10gbe"]
    units = plan_units(gpt(), ShardLabConfig(**ONE_UNIT_PER_BLOCK), 2).layouts()
    first = [lay for name in ("root", "blocks.0") for lay in units[name]]  # gathered as the step begins
    gathers = sum(link.ring_seconds(lay.padded_numel * 4, 2) for lay in first)  # fp32: 4 bytes per element
    assert time["by_collective"]["all_gather"]["exposed"] >= gathers * (1 - 1e-9)
    assert time["by_collective"]["all_gather"]["seconds"] > time["by_collective"]["all_gather"]["exposed"]
    stage_2 = setting(rate=slow_compute, stage=Stage(2)).predict()
    refresh = stage_2["by_collective"]["all_gather"]  # after the optimizer step: waited for, nothing computes
    assert refresh["exposed"] == pytest.approx(refresh["seconds"])


def test_accumulation_repeats_compute_and_gathers_and_defer_reduces_once() -> None:
    one = setting(stage=Stage(3)).predict()
    two = setting(stage=Stage(3)).predict(micro_batches=2)
    defer = setting(stage=Stage(3), accumulation=Accumulation.DEFER).predict(micro_batches=2)
    assert two["forward"] == pytest.approx(2 * one["forward"]) and two["optimizer"] == pytest.approx(one["optimizer"])
    gathered, reduced = (
        (lambda t: t["by_collective"]["all_gather"]["seconds"]),
        (lambda t: t["by_collective"]["reduce_scatter"]["seconds"]),
    )
    assert gathered(two) == pytest.approx(2 * gathered(one)) and reduced(two) == pytest.approx(2 * reduced(one))
    assert gathered(defer) == pytest.approx(gathered(two)) and reduced(defer) == pytest.approx(reduced(one))


def test_checkpointing_adds_one_forward_of_each_unit_to_its_backward() -> None:
    plain = setting(stage=Stage(3)).predict()
    recomputed = setting(stage=Stage(3), activation_checkpointing=True).predict()
    for name in ("blocks.0", "blocks.1", "blocks.2"):
        unit = recomputed["by_unit"][name]
        assert unit["backward"] == pytest.approx(plain["by_unit"][name]["backward"] + unit["forward"])
        assert unit["forward"] == pytest.approx(plain["by_unit"][name]["forward"])
    assert recomputed["by_unit"]["root"] == pytest.approx(plain["by_unit"]["root"])  # the root is not checkpointed


def forward_flops(trace: ComputeTrace) -> dict[str, float]:
    """Forward FLOPs per unit."""
    return {name: work.forward.flops for name, work in trace.by_unit.items()}


@pytest.mark.quick
def test_flops_per_unit_are_the_hand_count_of_a_linear() -> None:
    n_in, n_out, batch, tokens = 24, 40, 3, 5
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(n_in, n_out), nn.ReLU(), nn.Linear(n_out, n_in))
    config = ShardLabConfig(unit_classes=(nn.Linear,))
    traced = trace_forward(
        model, batch, tokens, config=config, make_inputs=lambda *_: torch.randn(batch, tokens, n_in),
        step=lambda m, x: m(x).sum(),
    )  # fmt: skip
    trace = traced.work
    flops = forward_flops(trace)
    assert flops == {"root": 0.0, "0": 2 * n_in * n_out * batch * tokens, "2": 2 * n_out * n_in * batch * tokens}
    assert trace.by_unit["root"].forward.bytes > 0  # the ReLU and the sum: memory-bound, the root's
    assert trace.by_unit["0"].forward.bytes == 0  # a Linear's work is its matmul
    assert sorted(trace.matmuls) == [(1, batch * tokens, n_in, n_out), (1, batch * tokens, n_out, n_in)]


def test_the_runs_first_batch_traces_as_the_plans_micro_batch() -> None:
    config = ShardLabConfig(**ONE_UNIT_PER_BLOCK)
    batch = (torch.randint(0, 128, (2, 32)), torch.randint(0, 128, (2, 32)))
    _, run = predict_first_batch(gpt(), batch, config, "32-true")
    assert run.error is None and list(run.by_unit) == ["root", "blocks.0", "blocks.1", "blocks.2"]
    assert forward_flops(run) == forward_flops(_trace(False))
    c, t, ff = INIT["n_embd"], 2 * 32, 4 * INIT["n_embd"]
    # a block: qkv (c -> 3c), proj (c -> c), fc (c -> 4c), proj (4c -> c) on t tokens, and attention's two matmuls
    # (2 x 2 B H T T d = 4 B T T c, as torch counts it: causal masking not subtracted)
    block = 2 * t * (3 * c * c + c * c + 2 * c * ff) + 4 * 2 * 32 * 32 * c
    assert forward_flops(run)["blocks.1"] == block
    assert run.by_unit["root"].lead.bytes > 0 and run.by_unit["root"].lead.flops == 0  # the embeddings


def _stand_in(timed: Setting) -> Any:
    """What ``time_predicted_for_run`` reads of a ShardedModel, for a plain world of 2 (no processes)."""
    units = plan_units(gpt(), timed.config, 2).layouts()
    flat = [
        SimpleNamespace(name=name, flat_params=[SimpleNamespace(layout=lay) for lay in lays])
        for name, lays in units.items()
    ]
    group = SimpleNamespace(world_size=1, rank=0)
    mesh = SimpleNamespace(replica=group, reshard=group, shard=SimpleNamespace(rank=0, world_size=2), regrouped=False)
    comm = SimpleNamespace(device=torch.device("cpu"), rank=0)
    return SimpleNamespace(forward_order=flat, config=timed.config, mesh=mesh, comm=comm, policy=PrecisionPolicy())


def test_a_runs_time_is_its_layouts_played_on_its_schedule() -> None:
    timed = setting(stage=Stage(3))
    sharded, link = _stand_in(timed), INTERCONNECTS["10gbe"]
    run = time_predicted_for_run(sharded, _trace(False), 1, "32-true", link=link, rate=RATE)
    assert run["basis"]["link"] == link.name and run["basis"]["optimizer"] == "AdamW"
    planned = timed.predict()
    for key in (*PARTS, "step", "comm_hidden"):
        assert run[key] == pytest.approx(planned[key]), key
    missing = time_predicted_for_run(sharded, None, 1, "32-true", link=link, rate=RATE)
    assert set(missing) == {"error", "why"} and "[rank 0]" in missing["error"] and "HINT" in missing["error"]
    assert missing["why"] == "no batch was traced"


def test_a_slower_link_makes_the_cheapest_change_appear() -> None:
    fast = plan_time(setting("nvlink", RATE, stage=Stage(3)))
    assert fast["comm_exposed"] < 0.01 * fast["step"] and "changes" not in fast
    slow = plan_time(setting("10gbe", RATE, stage=Stage(3)))
    assert slow["comm_exposed"] > 0.01 * slow["step"] and slow["changes"]
    choice = slow["choice"]
    assert choice is not None and choice["available"] and choice["step"] < slow["step"]
    offered = [c for c in slow["changes"] if c["available"]]
    assert choice["step"] == min(c["step"] for c in offered)
    assert any(not c["available"] for c in slow["changes"])  # prefetching further: shown, never chosen


def test_a_change_that_fits_costs_what_the_time_model_plays_for_it() -> None:
    """Each change the fit rule tries is priced by the step played with it (step_time.py), not by a rule of its own:
    checkpointing adds its recomputation, a smaller micro-batch its repeated collectives, offload its host transfers
    on top."""
    timed = setting("10gbe", RATE, stage=Stage(1))
    base, now = timed.plan(), timed.predict()

    def added(name: str, options: dict[str, Any], **how: Any) -> float:
        made = changes.made(timed, base, changes.Try(name, options, **how), now["step"])
        assert made is not None
        return made.added_seconds

    recompute = timed.predict(activation_checkpointing=True)
    assert recompute["backward"] > now["backward"]  # the checkpointed blocks' forward again
    assert added("activation_checkpointing", {"activation_checkpointing": True}) == pytest.approx(
        recompute["step"] - now["step"]
    )
    smaller = added("micro-batch 1 x 2", {"micro_batch_size": 1, "accumulate_grad_batches": 2}, micro_batch_size=1,
                    micro_batches=2)  # fmt: skip
    assert smaller == pytest.approx(timed.predict(1, 2)["step"] - now["step"]) and smaller > 0
    host = timed.plan(offload="cpu").tier_seconds
    assert host > 0 and added("offload cpu", {"offload": "cpu"}) == pytest.approx(
        timed.predict(offload="cpu")["step"] - now["step"] + host
    )


def test_the_plan_command_prints_the_time_per_step_for_10gbe(capsys: pytest.CaptureFixture) -> None:
    argv = ["--model", "lightning_shardlab.examples.gpt.GPT", "--init-args", json.dumps(INIT), "--world-size", "2"]
    timed = [*argv, "--interconnect", "10gbe", "--micro-batch-size", "2", "--seq-len", "32", "--precision", "32-true"]
    main([*timed, "--flops", "1e12"])
    out = capsys.readouterr().out
    assert "time per step (predicted)" in out and "comm exposed" in out and "comm hidden" in out
    assert "10 Gigabit Ethernet" in out and "given: 1e+12 FLOP/s" in out
    assert "cheapest change that hides communication" in out  # a 10 GbE link exposes it at this size
    main([*timed, "--json"])
    time = json.loads(capsys.readouterr().out)["time"]
    assert KEYS <= set(time) and time["step"] == pytest.approx(sum(time[k] for k in PARTS))
    main(["--params", "7e9", "--world-size", "8", "--interconnect", "10gbe"])
    out = capsys.readouterr().out
    assert "time per step: communication" in out and "on the wire" in out and "reduce_scatter" in out
    assert "needs a model" in out and "time per step (predicted)" not in out


def test_predict_step_time_takes_layouts_directly() -> None:
    units = plan_units(gpt(), ShardLabConfig(**ONE_UNIT_PER_BLOCK), 2).layouts()
    link = INTERCONNECTS["10gbe"]
    time = predict_step_time(units, _trace(False), RATE, ShardLabConfig(), PrecisionPolicy(), Links(link, link))
    assert KEYS <= set(time) and time["optimizer"] == 0.0  # no optimizer work given


def test_the_link_is_the_slope_and_intercept_of_two_batch_sizes() -> None:
    """budget/measured/local_link.py: batches of CALLS all-gathers at two sizes per rank give the bandwidth (slope) and
    the latency (what is left of the small batch: calls waited for back to back), for any group size, and beside it a
    busy rank's wait for a small call over its N-1 messages where longer (calls their rank computed beside); noise that
    makes the large batch no slower than the small one falls back to the large batch alone."""
    from lightning_shardlab.budget.measured.local_link import CALLS, SIZES, fit_link

    true = Interconnect("true", bandwidth=2e9, latency=3e-4)
    for world in (2, 4):
        batch = [CALLS * true.ring_seconds(world * b, world) for b in SIZES]
        link = fit_link("fitted", batch, world)
        assert link.bandwidth == pytest.approx(true.bandwidth) and link.latency == pytest.approx(true.latency)
        assert link.name.startswith("fitted: 2.00 GB/s, 300 us")
    batch = [CALLS * true.ring_seconds(2 * b, 2) for b in SIZES]
    launched = fit_link("fitted", batch, 2, launch=2e-4, busy_wait=1e-4)  # a busy rank waits less: the batches'
    assert (launched.launch, launched.latency) == (2e-4, pytest.approx(3e-4))
    assert launched.name.endswith("300 us, 200 us of compute a call")
    busy = fit_link("fitted", [CALLS * true.ring_seconds(4 * b, 4) for b in SIZES], 4, busy_wait=1.5e-3)
    assert busy.latency == pytest.approx(3e-4) and busy.bandwidth == pytest.approx(true.bandwidth)  # back to back
    assert busy.busy_latency == pytest.approx(5e-4)  # beside compute: 1.5 ms over 3 messages
    assert "300 us (500 us beside compute)" in busy.name
    assert busy.busy_extra(4, calls=2) == pytest.approx(2 * 3 * 2e-4)
    swamped = fit_link("noisy", [0.02, 0.01], 2)
    assert swamped.bandwidth == pytest.approx(CALLS * SIZES[1] / 0.01) and swamped.latency == 0.0


def test_the_ranks_of_one_machine_take_turns_to_measure_the_rate_and_share_it_once(monkeypatch) -> None:
    """budget/callback.py: 3 ranks on host "a" and 1 on "b": 3 turns (barriers) on every rank; each measures in
    its own turn (b's rank in the first); the ranks of a machine then take the median of its probes (the same rate
    for the same work), and its share of the cores."""
    from lightning_shardlab.budget import callback
    from lightning_shardlab.budget.callback import ShardLabBudget

    hosts, turns = ["a", "a", "b", "a"], []
    probes = [
        dataclasses.replace(RATE, flops_per_second=f, seconds_per_op=s) for f, s in ((3, 1), (1, 5), (7, 7), (2, 2))
    ]
    monkeypatch.setattr(callback.collectives, "barrier", lambda comm, label="": turns.append(("barrier", label)))
    monkeypatch.setattr(callback.collectives, "all_gather_object", lambda rate, comm, label="", kind="": probes)
    shared = []
    monkeypatch.setattr(callback, "sharing_cores", lambda rate, here: shared.append(here) or rate)
    for rank, host in enumerate(hosts):
        monkeypatch.setattr(callback.socket, "gethostname", lambda host=host: host)
        monkeypatch.setattr(callback, "run_rate", lambda sharded, work, r=rank: turns.append(("probe", r)) or probes[r])
        turns.clear()
        budget = ShardLabBudget()
        budget.predicted_work = SimpleNamespace(error=None)
        run = SimpleNamespace(sharded=SimpleNamespace(mesh=SimpleNamespace(world=SimpleNamespace(rank=rank))))
        rate = budget._rate_in_turns(run, hosts)
        # host a: the median of ranks 0, 1 and 3's probes, figure by figure; host b: its one probe
        assert (rate.flops_per_second, rate.seconds_per_op) == ((2, 2) if host == "a" else (7, 7)), (rank, rate)
        mine = {0: 0, 1: 1, 2: 0, 3: 2}[rank]
        expected = [("barrier", f"rate probe {t}") for t in range(3)]
        expected.insert(mine, ("probe", rank))
        assert turns == expected, (rank, turns)
    assert shared == [3, 3, 1, 3]


def test_the_plan_measured_here_takes_the_rates_a_run_takes(monkeypatch) -> None:
    """``shardlab plan --interconnect local --flops here`` (cli/plan.py's ``rate_here``) prices as a run on this
    machine prices itself (budget/callback.py, run_time.py): the probes' rate with the engine's work at the plan's
    stage, shared by the ranks on the machine's cores, and the links' share of their speed while they compute."""
    from lightning_shardlab.budget.predicted import compute_rate
    from lightning_shardlab.cli import plan as cli_plan

    engine = EngineCost(1e-4, 2e-4, 3e-4, 4e-4)
    monkeypatch.setattr(cli_plan, "measure_rate", lambda device, dtype, traced: RATE)
    monkeypatch.setattr(cli_plan, "with_engine_cost", lambda rate, stage: dataclasses.replace(rate, engine=engine))
    monkeypatch.setattr(compute_rate, "_cores", lambda: 1)  # 2 ranks of 1 thread on 1 core: half each, no link share
    monkeypatch.setattr(compute_rate.torch, "get_num_threads", lambda: 1)  # as scripts/test.sh runs, whatever runs it
    timed = setting(stage=Stage(3))
    rate, share = cli_plan.rate_here(timed, 2)
    assert rate.flops_per_second == RATE.flops_per_second / 2 and rate.engine == engine.scaled(2) and share == 0.0
    args = SimpleNamespace(intra=None, inter=None, interconnect="local", ranks_per_node=None)
    assert cli_plan._local_ranks(args, timed) == timed.world_size  # every link local: every rank is here
    timed.rate, timed.link_share = rate, share
    assert timed.predict()["basis"]["link_share"] == 0.0


@pytest.mark.quick
def test_an_op_whose_call_is_mostly_dispatch_is_left_out_of_the_bandwidth() -> None:
    """compute_rate.py's ``model_bandwidth``: an add of 8 floats moves 96 bytes, which a copy at 10 GB/s moves in
    0.01 us, far under a kernel's 5 us: its time is dispatch and says nothing of bytes/s (a small model's ops read a
    few MB/s so, and the optimizer's bytes were priced 25x over). A 4 MiB add is timed beside it; only the rule is
    asserted."""

    from lightning_shardlab.budget.predicted.compute_rate import model_bandwidth
    from lightning_shardlab.budget.predicted.compute_trace import TensorSpec, TracedOp

    def add(n: int) -> TracedOp:
        spec = TensorSpec((n,), torch.float32)
        return TracedOp(torch.ops.aten.add.Tensor, ((spec, spec), {}), bytes=12.0 * n, calls=1)

    cpu = torch.device("cpu")
    assert model_bandwidth([add(8)], cpu, fixed=2e-6, copy=1e10, least=5e-6) is None
    large = model_bandwidth([add(8), add(2**20)], cpu, fixed=2e-6, copy=1e10, least=5e-6)
    assert large is not None and large > 0
