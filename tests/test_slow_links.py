"""Slow links and collectives that send fewer bytes (docs/slow_links.md).

- the int8 block quantizer by hand: its round trip, and every element within half a step of its block's scale;
- the options refused where they cannot apply, and each through a LightningCLI YAML;
- one run on 2 ranks (a kept world) serving many checks: the defaults unchanged bit for bit (the packing's block
  size, off, changes nothing and the ledger shows only fp32), bf16 traffic summed in fp32 (1 + 2^-8 averages
  exactly, where a bf16 sum rounds it away), int8 gathers (every rank computes with the same unpacked weights,
  masters exact), int8 reductions' error feedback (the residual after a call is what packing lost, carried into
  the next step), each option's bytes in the ledger under its wire dtype, the residuals' memory measured = predicted,
  the int8 gathers' error per unit against the masters (by hand), sampled packed reductions set against exact ones
  (training unchanged, the extra calls under their own label);
- ``shardlab plan``'s time saved per option (by hand: (N-1)/N of the bytes saved over the link's bandwidth);
- the emulated link (benchmarks/slow_link.py): 2 nodes x 1 rank at stage 3 train to the same weights, bit for bit,
  as the same run on loopback, and the link probe cannot read faster than the shaped rate.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml

from lightning_shardlab import ShardLabConfig, ShardLabStrategy, shard_model, shard_optimizer
from lightning_shardlab.comm.packing import Packing, dequantize, quantize
from tests.helpers.launch import run_ranks
from tests.helpers.reference import init_from_env, shutdown
from tests.models import OddNet, TinyGPT, regression_batches

# ---- the block quantizer, by hand ----


def test_int8_blocks_round_trip_by_hand_and_stay_within_half_a_step() -> None:
    x = torch.tensor([1.27, -0.6, 0.0, 0.01, 0.0, 0.0, 0.0, 0.0, -5.0, 1.0, 0.0, 0.0, 2.5])  # blocks of 4, and 1
    scales, q = quantize(x, 4)
    assert torch.equal(scales, torch.tensor([1.27, 0.0, 5.0, 2.5]) / 127)  # max|x| / 127 each; zeros: 0
    assert q.tolist() == [127, -60, 0, 1, 0, 0, 0, 0, -127, 25, 0, 0, 127]
    packing = Packing("int8", 4)
    packed = packing.pack(x)
    assert (
        packed.dtype == torch.uint8 and packed.numel() == packing.nbytes(13) == 4 * 4 + 13 + 3
    )  # scales, values, padding to 4 bytes
    back = packing.unpack(packed, torch.empty(13))
    assert torch.equal(back, dequantize(scales, q, 4))
    assert (
        back[[2, 4, 5, 6, 7]].eq(0).all() and back[8] == -5.0 and back[12] == 2.5
    )  # zeros and each block's largest exact
    g = torch.Generator().manual_seed(0)
    y = torch.randn(10_000, generator=g) * torch.logspace(-4, 2, 10_000)  # blocks of very different scales
    scales, q = quantize(y, 256)
    err = (dequantize(scales, q, 256) - y).abs()
    half_step = scales.repeat_interleave(256)[: y.numel()] / 2
    assert (err <= half_step * (1 + 1e-6)).all()  # half a step of its own block's scale, per element
    non_finite = packing.unpack(packing.pack(torch.tensor([1.0, float("inf")])), torch.empty(2))
    assert torch.isnan(non_finite).all()  # an overflow still reads as one after the trip


def test_bf16_packing_rounds_each_element_once() -> None:
    x = torch.tensor([1.0 + 2**-8, 3.0, -(2.0**-20)])
    back = Packing("bfloat16").unpack(Packing("bfloat16").pack(x), torch.empty(3))
    assert torch.equal(back, x.to(torch.bfloat16).float())


# ---- the options: refused where they cannot apply, and through YAML ----


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"stage": 2, "gather_dtype": "int8"}, ["gather_dtype='int8'", "stage 3", "HINT"]),
        ({"gather_dtype": "bf16"}, ["gather_dtype='bf16'", "None, 'int8'"]),
        ({"reduce_dtype": "int4"}, ["reduce_dtype='int4'", "'int8'"]),
        ({"quant_block_size": 0}, ["quant_block_size=0", "integer >= 1"]),
    ],
)
def test_packed_options_are_refused_where_they_cannot_apply(options: dict, words: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        ShardLabConfig(**options)
    for word in words:
        assert word in str(info.value), info.value


def test_each_option_through_yaml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:  # noqa: ANN001
    from lightning_shardlab import cli

    config = tmp_path / "strategy.yaml"
    config.write_text(
        "trainer:\n  strategy:\n    class_path: lightning_shardlab.ShardLabStrategy\n    init_args:\n"
        "      stage: 3\n      reduce_dtype: int8\n      gather_dtype: int8\n      quant_block_size: 512\n"
        "model:\n  class_path: lightning_shardlab.examples.gpt.GPT\n"
    )
    monkeypatch.setattr(sys, "argv", ["shardlab"])
    with pytest.raises(SystemExit):
        cli.main(["fit", "--config", str(config), "--print_config"])
    printed = capsys.readouterr().out
    for line in ("reduce_dtype: int8", "gather_dtype: int8", "quant_block_size: 512"):
        assert line in printed, printed
    init_args = yaml.safe_load(config.read_text())["trainer"]["strategy"]["init_args"]  # what the CLI passes
    strategy = ShardLabStrategy(**init_args)
    assert (strategy.config.reduce_dtype, strategy.config.gather_dtype, strategy.config.quant_block_size) == (
        "int8",
        "int8",
        512,
    )
    with pytest.raises(ValueError, match=r"gather_dtype='int8'.*stage 3.*HINT"):
        ShardLabStrategy(**{**init_args, "stage": 2})


# ---- one run on 2 ranks: defaults, bf16 summed in fp32, int8 gathers, error feedback ----

VARIANTS = {
    "default": {},
    "default_block_16": {"quant_block_size": 16},  # the packing's size, with packing off: changes nothing
    "bf16_reduce": {"reduce_dtype": "bf16"},
    "int8_gather": {"gather_dtype": "int8", "quant_block_size": 16},
    "int8_reduce": {"reduce_dtype": "int8", "quant_block_size": 16},
}


def _train(comm, options: dict, steps: int = 4, local_batch: int = 3, sample: bool = False) -> dict:  # noqa: ANN001
    from lightning_shardlab.checkpoint.save_load import full_state_dict
    from lightning_shardlab.sharding.packing_error import as_lists, gather_error_sums
    from lightning_shardlab.sharding.reduce_sample import EXACT_LABEL, ReduceSample

    torch.manual_seed(0)
    model = OddNet()
    sharded = shard_model(model, ShardLabConfig(stage=3, unit_bucket_params=0, **options), comm)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    shard_optimizer(optimizer, sharded)
    mine = slice(comm.rank * local_batch, (comm.rank + 1) * local_batch)
    residuals, samples = [], []
    for step, (x, y) in enumerate(regression_batches(steps, local_batch * comm.world_size)):
        if step == 1:
            comm.ledger.reset()  # the steady steps: the first learns the order its units run in
        sampled = ReduceSample() if sample else None  # every step also reduces exactly, beside the packed one
        for unit in sharded.units:
            unit.reduce_sample = sampled
        optimizer.zero_grad()
        with sharded.step(keep_root_gathered=True):
            loss = F.mse_loss(model(x[mine]), y[mine])
        sharded.prepare_backward(loss)
        loss.backward()
        optimizer.step()
        residuals.append({fp.layout.name: fp.residual.clone() for fp in sharded.flat_params if fp.residual is not None})
        samples.append(sampled.sums if sampled else {})
    by_dtype = {key: (t.count, t.bytes) for key, t in comm.ledger.by_dtype.items()}
    exact_calls = [(k, t.count, t.bytes) for k, t in comm.ledger.by_call.items() if k[2] == EXACT_LABEL and t.count]
    predicted = _predicted(sharded, steps - 1)
    memory = _memory(sharded, optimizer)
    unit = sharded.units[1]  # blocks.0: gathered for a look at what every rank computes with
    unit.unshard()
    gathered = {fp.layout.name: (fp.full.clone(), fp.shard.clone(), fp.master.clone()) for fp in unit.flat_params}
    unit.reshard()
    packing = {fp.layout.name: fp.gather_packing for fp in unit.flat_params}
    state = full_state_dict(sharded)
    return {
        "state": state,
        "by_dtype": by_dtype,
        "residuals": residuals,
        "gathered": gathered,
        "packing": packing,
        "predicted": predicted,
        "memory": memory,
        "samples": samples,
        "exact_calls": exact_calls,
        "gather_error": as_lists(gather_error_sums(sharded), "test"),
        "packed_layouts": {fp.layout.name: fp.layout.padded_numel for fp in sharded.flat_params if fp.reduce_packing},
    }


def _memory(sharded, optimizer) -> dict:  # noqa: ANN001
    """The budget's memory between steps, measured from the real tensors and predicted from the layout."""
    from lightning_shardlab.budget.measured.memory import measure_memory
    from lightning_shardlab.budget.predicted.zero_table import predict_memory
    from lightning_shardlab.sharding.optimizer import OptimizerShape

    layouts = [fp.layout for fp in sharded.flat_params]
    shape = OptimizerShape.of(optimizer)
    return {
        "measured": measure_memory(sharded.flat_params, [optimizer]),
        "predicted": predict_memory(
            layouts,
            sharded.config.stage,
            sharded.policy,
            sharded.comm.rank,
            shape,
            error_feedback=sharded.config.reduce_dtype == "int8",
        ),
        "residuals": sum(fp.residual.nbytes for fp in sharded.flat_params if fp.residual is not None),
    }


def _predicted(sharded, steps: int) -> dict:  # noqa: ANN001
    """The budget's prediction of this run's all-gathers and reduce-scatters: {kind: (calls, bytes)} for ``steps``."""
    from lightning_shardlab.budget.predicted.zero_table import predict_traffic
    from lightning_shardlab.comm.packing import packing_for

    config = sharded.config
    units = {u.name: [fp.layout for fp in u.flat_params] for u in sharded.forward_order}
    traffic = predict_traffic(
        units,
        config.stage,
        sharded.policy,
        gather_packing=packing_for(config.gather_dtype, config.quant_block_size),
        reduce_packing=packing_for(config.reduce_dtype, config.quant_block_size),
    )
    return {
        "all_gather": (traffic.all_gather_calls * steps, traffic.all_gather_bytes * steps),
        "reduce_scatter": (traffic.reduce_scatter_calls * steps, traffic.reduce_scatter_bytes * steps),
    }


def _bf16_sum_and_feedback(comm) -> dict:  # noqa: ANN001
    """Rank 0 sends 1, rank 1 sends 2^-8 (both exact in bf16): averaged in fp32, 0.5 + 2^-9; a bf16 sum rounds
    1 + 2^-8 to 1. Then one int8 call with a residual, for the driver to check by hand."""
    from lightning_shardlab.comm import collectives, packed_collectives

    value = 1.0 if comm.rank == 0 else 2.0**-8
    full = torch.full((8,), value)
    ours = torch.empty(4)
    packed_collectives.reduce_scatter_packed(ours, full, comm, Packing("bfloat16"), label="probe")
    narrow = torch.empty(4, dtype=torch.bfloat16)
    collectives.reduce_scatter(narrow, full.to(torch.bfloat16), comm, label="probe")  # summed in bf16
    g = torch.Generator().manual_seed(comm.rank)
    grad, before = torch.randn(64, generator=g), torch.randn(64, generator=g) * 0.01
    residual = before.clone()
    out = torch.empty(32)
    packed_collectives.reduce_scatter_packed(out, grad, comm, Packing("int8", 8), label="probe", residual=residual)
    return {"ours": ours, "bf16": narrow.float(), "grad": grad, "before": before, "after": residual, "out": out}


def packed_runs() -> dict:
    """Worker (2 ranks): every variant's stage-3 training of OddNet, and the direct collective checks."""
    comm = init_from_env()
    report = {name: _train(comm, options) for name, options in VARIANTS.items()}
    report["sampled"] = {name: _train(comm, VARIANTS[name], sample=True) for name in ("bf16_reduce", "int8_reduce")}
    report["direct"] = _bf16_sum_and_feedback(comm)
    shutdown()
    return report


@pytest.fixture(scope="module")
def packed() -> list[dict]:
    return run_ranks("tests.test_slow_links:packed_runs", 2, timeout=180)


def _equal_states(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_defaults_stay_bit_for_bit_and_travel_in_fp32(packed: list[dict]) -> None:
    first = packed[0]
    assert _equal_states(first["default"]["state"], first["default_block_16"]["state"])
    dtypes = {dtype for (kind, dtype) in first["default"]["by_dtype"] if kind in ("all_gather", "reduce_scatter")}
    assert dtypes == {"float32"}
    for name in ("bf16_reduce", "int8_gather", "int8_reduce"):  # each option changes the numbers, a little
        other = first[name]["state"]
        assert not _equal_states(first["default"]["state"], other), name
        # AdamW moves an element by about lr a step whatever its gradient: 4 steps of lr=1e-2 bound any difference
        worst = max((other[k] - v).abs().max().item() for k, v in first["default"]["state"].items())
        assert worst < 4 * 1e-2, (name, worst)


def test_each_option_files_its_bytes_under_its_wire_dtype(packed: list[dict]) -> None:
    first = packed[0]
    exact = first["default"]["by_dtype"]
    for name, kind, dtype in [
        ("bf16_reduce", "reduce_scatter", "bfloat16"),
        ("int8_gather", "all_gather", "int8"),
        ("int8_reduce", "reduce_scatter", "int8"),
    ]:
        mine = first[name]["by_dtype"]
        assert (kind, "float32") not in mine, (name, mine)
        calls, nbytes = mine[(kind, dtype)]
        assert calls == exact[(kind, "float32")][0], (name, mine)  # the same calls, in fewer bytes
        assert nbytes < exact[(kind, "float32")][1] / (1.9 if dtype == "bfloat16" else 2.5), (name, mine)


def test_ledger_bytes_by_dtype_are_the_predicted_bytes(packed: list[dict]) -> None:
    for name in VARIANTS:
        run = packed[0][name]
        for kind, (calls, nbytes) in run["predicted"].items():
            measured = [v for (k, _), v in run["by_dtype"].items() if k == kind]
            assert len(measured) == 1, (name, kind, run["by_dtype"])  # one dtype per kind
            assert measured[0] == (calls, nbytes), (name, kind, measured[0], (calls, nbytes))


def test_bf16_traffic_is_summed_in_fp32(packed: list[dict]) -> None:
    for report in packed:
        direct = report["direct"]
        assert torch.equal(direct["ours"], torch.full((4,), (1.0 + 2.0**-8) / 2))  # exact
        assert torch.equal(direct["bf16"], torch.full((4,), 0.5))  # what a bf16 sum gives: 2^-8 rounded away


def test_int8_gathers_give_every_rank_the_same_weights_and_keep_the_masters(packed: list[dict]) -> None:
    a, b = packed[0]["int8_gather"], packed[1]["int8_gather"]
    for name, (full, shard, master) in a["gathered"].items():
        packing = a["packing"][name]
        assert packing == Packing("int8", 16)
        assert torch.equal(full, b["gathered"][name][0])  # every rank computes with the same weights
        s = shard.numel()
        assert torch.equal(full[:s], packing.unpack(packing.pack(shard), torch.empty(s)))  # rank 0's, unpacked
        assert not torch.equal(full[:s], shard) and master.dtype == torch.float32
        assert torch.equal(master, shard)  # fp32 training: the master is the exact shard, never the unpacked one


def test_int8_error_feedback_keeps_what_packing_lost_across_steps(packed: list[dict]) -> None:
    packing = Packing("int8", 8)
    for report in packed:
        d = report["direct"]
        sent = d["grad"] + d["before"]
        lost = torch.cat([c - packing.unpack(packing.pack(c), torch.empty(32)) for c in sent.split(32)])
        assert torch.equal(d["after"], lost)
        steps = report["int8_reduce"]["residuals"]
        assert len(steps) == 4 and all(steps[-1][f"blocks.{i}[float32]"].abs().sum() > 0 for i in (0, 1))
        assert not torch.equal(steps[0]["blocks.0[float32]"], steps[1]["blocks.0[float32]"])  # updated each step
        # (a one-element gate travels exactly: its block's scale is its own size, so it keeps no residual)
    assert not torch.equal(packed[0]["direct"]["after"], packed[1]["direct"]["after"])  # each rank its own


def test_error_feedback_residual_is_in_the_budget_measured_and_predicted(packed: list[dict]) -> None:
    for report in packed:
        for name in VARIANTS:
            memory = report[name]["memory"]
            measured, predicted = memory["measured"]["error_feedback"], memory["predicted"]["error_feedback"]
            assert measured == predicted == memory["residuals"], (name, memory)  # the real tensors' bytes
            assert (measured > 0) == (name == "int8_reduce"), (name, measured)
        residuals = report["int8_reduce"]["residuals"][-1]
        assert report["int8_reduce"]["memory"]["residuals"] == 4 * sum(r.numel() for r in residuals.values())


def test_int8_gather_error_per_unit_is_the_gathered_weights_against_the_masters(packed: list[dict]) -> None:
    from lightning_shardlab.sharding.packing_error import combine

    for report in packed:
        assert report["default"]["gather_error"] == {} and report["int8_reduce"]["gather_error"] == {}  # off: none
    figures = combine([report["int8_gather"]["gather_error"] for report in packed])
    full, _, master = packed[0]["int8_gather"]["gathered"]["blocks.0[float32]"]  # unit blocks.0: one flat param
    masters = torch.cat([report["int8_gather"]["gathered"]["blocks.0[float32]"][2] for report in packed])
    real = sum(report["int8_gather"]["gathered"]["blocks.0[float32]"][2].numel() for report in packed)
    error = full[:real] - masters[:real]  # what every rank computes with, against every rank's masters, by hand
    assert figures["blocks.0"]["max_abs"] == pytest.approx(error.abs().max().item(), rel=1e-6)
    assert figures["blocks.0"]["rel_l2"] == pytest.approx((error.norm() / masters[:real].norm()).item(), rel=1e-5)
    assert 0 < figures["blocks.0"]["rel_l2"] < 0.02  # int8 blocks of 16: a fraction of a step each


def test_sampled_reduction_error_is_measured_beside_an_exact_reduction(packed: list[dict]) -> None:
    from lightning_shardlab.sharding.packing_error import combine
    from lightning_shardlab.sharding.reduce_sample import EXACT_LABEL

    for name, bound in (("bf16_reduce", 2.0**-8), ("int8_reduce", 0.05)):
        runs = [report["sampled"][name] for report in packed]
        assert _equal_states(runs[0]["state"], packed[0][name]["state"])  # sampling changes nothing it trains
        for step in range(4):
            figures = combine([run["samples"][step] for run in runs])
            assert set(figures) >= {"blocks.0", "blocks.1"}, figures
            for unit in ("blocks.0", "blocks.1"):
                assert 0 < figures[unit]["rel_l2"] < bound, (name, step, unit, figures[unit])
        # one exact fp32 reduce-scatter per packed flat parameter per sampled step, under its own label
        (_, kind, label), calls, nbytes = runs[0]["exact_calls"][0]
        assert len(runs[0]["exact_calls"]) == 1 and (kind, label) == ("reduce_scatter", EXACT_LABEL)
        layouts = runs[0]["packed_layouts"]
        assert (calls, nbytes) == (3 * len(layouts), 3 * 4 * sum(layouts.values())), runs[0]["exact_calls"]
        assert packed[0][name]["exact_calls"] == []  # not sampled: no extra call


# ---- the plan: each option's time saved per step ----


@pytest.mark.parametrize("stage", [2, 3])
def test_plan_shows_each_options_time_saved_per_step(stage: int) -> None:
    from rich.console import Console

    from lightning_shardlab.budget.predicted.plan import plan_model
    from lightning_shardlab.budget.predicted.zero_table import INTERCONNECTS
    from lightning_shardlab.cli.plan_tables import options_table

    with torch.device("meta"):
        model = TinyGPT()
    link = INTERCONNECTS["10gbe"]
    config = ShardLabConfig(stage=stage, unit_bucket_params=0)
    plan = plan_model(model, config, 4, "32-true", "adamw", link, "TinyGPT")
    rows = {row["option"]: row for row in plan.options}
    exact = rows.pop("exact")
    assert exact["comm_seconds"] == plan.comm_seconds and exact["saved_seconds"] == 0  # the plan's own figure
    gathers = {"gather_dtype='int8'", "gather_dtype='int8' + reduce_dtype='int8'"}
    assert (gathers <= rows.keys()) == (stage == 3) and "reduce_dtype='int8'" in rows  # int8 gathers: stage 3 only
    reduced = plan.traffic["reduce_scatter_bytes"]  # fp32 full tensors: bf16 halves them
    assert rows["reduce_dtype='bf16'"]["bytes"] == exact["bytes"] - reduced // 2
    for name, row in rows.items():  # by hand: a ring moves (N-1)/N of the bytes; the same calls, the same latency
        saved = 3 / 4 * (exact["bytes"] - row["bytes"]) / link.bandwidth
        assert 0 < row["saved_seconds"] == pytest.approx(saved, rel=1e-9), (name, row)
    assert rows["reduce_dtype='int8'"]["saved_seconds"] > rows["reduce_dtype='bf16'"]["saved_seconds"]
    console = Console(width=200, record=True)
    console.print(options_table(plan))
    shown = console.export_text()
    assert "saved per step" in shown and "reduce_dtype='int8'" in shown and "10 Gigabit Ethernet" in shown, shown


# ---- the emulated link: 2 nodes x 1 rank against loopback ----


@pytest.fixture(scope="module")
def emulated_link():  # noqa: ANN201
    """Two emulated nodes on a 200 Mbit/s link (benchmarks/slow_link.py), deleted afterwards; skipped, with the
    reason, where network namespaces cannot be made."""
    from benchmarks.slow_link import EmulatedLink, unavailable

    reason = unavailable()
    if reason is not None:
        pytest.skip(reason)
    with EmulatedLink(nodes=2, rate="200mbit") as link:
        yield link
    assert not [name for name in os.listdir("/var/run/netns") if name.startswith(link.tag)]  # nothing left behind


def link_run() -> dict:
    """Worker: stage 3 with the defaults (OddNet, AdamW), then the run's own link probe over this group."""
    from benchmarks.slow_link import probe_link

    comm = init_from_env()
    state = _train(comm, {}, steps=3)["state"]
    probed = probe_link(sizes=(64 << 10, 512 << 10), repeats=2, comm=comm)
    shutdown()
    return {"state": state, "bandwidth": probed["bandwidth"]}


def test_emulated_link_trains_to_the_loopback_weights(emulated_link) -> None:  # noqa: ANN001
    envs = [emulated_link.rank_env(rank, 2, 1) for rank in range(2)]
    over_link = run_ranks("tests.test_slow_links:link_run", 2, timeout=120, rank_envs=envs)
    on_loopback = run_ranks("tests.test_slow_links:link_run", 2, timeout=120)
    assert _equal_states(over_link[0]["state"], on_loopback[0]["state"])
    # the shaping is in force: the probe cannot read faster than the link (a bound, not a speed: loopback reads
    # about 40x this here)
    assert over_link[0]["bandwidth"] < 1.15 * emulated_link.bits / 8, over_link[0]["bandwidth"]
