"""``shardlab plan`` and the predictions with hybrid sharding and reshard groups: pure arithmetic, no processes.

A world of W ranks is R = W / G shard groups of G ranks. Inside a group the model is sharded as a world of G
would shard it (the layouts are built at world size G); each reduction's gradient shard is then all-reduced
across the R groups. With ``reshard_after_forward=k`` a unit's backward all-gather runs inside k ranks.
"""

from __future__ import annotations

import json

import pytest

from lightning_shardlab.budget.report import per_step
from lightning_shardlab.cli.plan import INTERCONNECTS, main, make_plan, meta_model, parser
from lightning_shardlab.core.config import ShardLabConfig
from lightning_shardlab.sharding.policy import plan_units

GPT = "lightning_shardlab.examples.gpt.GPT"
P, W, G = 70e9, 64, 8
R = W // G
HYBRID_70B = "--params 70e9 --world-size 64 --shard-group-size 8 --intra nvlink --inter infiniband".split()


def plan_json(capsys: pytest.CaptureFixture, argv: list[str]) -> dict:
    main([*argv, "--json"])
    return json.loads(capsys.readouterr().out)


def test_70b_in_8_groups_of_8_is_the_zero_table_at_8_and_times_each_link(capsys: pytest.CaptureFixture) -> None:
    plan = plan_json(capsys, HYBRID_70B)
    assert (plan["shard_group_size"], plan["replicas"], plan["reshard_size"]) == (8, 8, None)
    # bf16-mixed AdamW, stage 3, per parameter: 2 B bf16 copy + 2 B bf16 grad + 4 B fp32 master + 8 B moments
    # = 16 B, sharded over the G = 8 ranks of a shard group (not the 64 of the world)
    zero_at_8 = {"params": 2 * P / G, "grads": 2 * P / G, "master": 4 * P / G, "optimizer_state": 8 * P / G}
    assert plan["memory_per_rank"] == pytest.approx({**zero_at_8, "padding": 0})
    assert sum(zero_at_8.values()) == pytest.approx(16 * P / G)
    # inside each shard group: bf16 all-gathers before forward and before backward, one fp32 reduce-scatter;
    # across groups: the fp32 gradient shard (1/G of 4 B x P) all-reduced among the R groups
    by_scope = plan["traffic"]["by_scope"]
    assert by_scope == {
        "shard": {"all_gather": [2, 2 * 2 * P], "reduce_scatter": [1, 4 * P]},
        "replica": {"all_reduce": [1, 4 * P / G]},
    }
    nvlink, infiniband = INTERCONNECTS["nvlink"], INTERCONNECTS["infiniband"]
    intra = (G - 1) / G * (2 * 2 * P + 4 * P) / nvlink.bandwidth + 3 * (G - 1) * nvlink.latency  # ring of G, 3 calls
    inter = 2 * (R - 1) / R * (4 * P / G) / infiniband.bandwidth + 2 * (R - 1) * infiniband.latency  # ring of R
    assert plan["link_seconds"] == pytest.approx({"intra": intra, "inter": inter})
    assert intra > 0 and inter > 0
    assert plan["comm_seconds"] == pytest.approx(intra + inter)
    assert plan["links"] == {"intra": nvlink.name, "inter": infiniband.name}

    main(HYBRID_70B)
    text = capsys.readouterr().out
    assert nvlink.name in text and infiniband.name in text
    assert "140.00 GB" in text  # model state per rank: 16 B x 70e9 / 8
    assert "35.00 GB" in text  # moved across shard groups: 4 B x 70e9 / 8
    assert "8 shard groups x 8 ranks" in text


def test_a_model_plan_files_hybrid_calls_by_scope_as_its_layout_says(capsys: pytest.CaptureFixture) -> None:
    init = {"n_layer": 2, "n_embd": 320}  # blocks of 1.2M parameters: one unit each
    argv = ["--model", GPT, "--init-args", json.dumps(init), "--world-size", "4", "--shard-group-size", "2"]
    plan = plan_json(capsys, argv)
    units = plan_units(meta_model(GPT, init), ShardLabConfig(), 2).layouts()  # the layout at G = 2
    assert len(units) == 3  # the root and two blocks
    assert all(lay.world_size == 2 for lays in units.values() for lay in lays)
    last = [name for name in units if name != "root"][-1]
    # stage 3, bf16-mixed: the root and the unit that runs forward last gather once per step, every other unit
    # twice (forward, backward), 2 B per padded element; each trainable flat parameter reduce-scatters its
    # fp32 gradient (4 B per padded element) once, then all-reduces its fp32 shard (4 B per shard element)
    # across the 2 shard groups
    gathers = [(1 if name in ("root", last) else 2, lay) for name, lays in units.items() for lay in lays]
    trainable = [lay for lays in units.values() for lay in lays if lay.requires_grad]
    assert plan["traffic"]["by_scope"] == {
        "shard": {
            "all_gather": [sum(n for n, _ in gathers), sum(n * lay.padded_numel * 2 for n, lay in gathers)],
            "reduce_scatter": [len(trainable), sum(lay.padded_numel * 4 for lay in trainable)],
        },
        "replica": {"all_reduce": [len(trainable), sum(lay.shard_numel * 4 for lay in trainable)]},
    }
    assert plan["traffic"]["all_gather_calls"] == sum(n for n, _ in gathers)  # the totals over scopes
    assert (plan["shard_group_size"], plan["replicas"]) == (2, 2)
    # world rank r holds what rank r mod G of its shard group holds
    assert len(plan["per_rank"]) == 4 and plan["per_rank"][2:] == plan["per_rank"][:2]
    assert plan["link_seconds"]["intra"] > 0 and plan["link_seconds"]["inter"] > 0


def test_reshard_groups_take_the_backward_gathers(capsys: pytest.CaptureFixture) -> None:
    init = {"n_layer": 3, "n_embd": 320}  # blocks of 1.2M parameters: one unit each
    argv = ["--model", GPT, "--init-args", json.dumps(init), "--world-size", "4", "--shard-group-size", "4"]
    plain = plan_json(capsys, argv)
    plan = plan_json(capsys, [*argv, "--reshard-after-forward", "2"])
    assert (plan["shard_group_size"], plan["replicas"], plan["reshard_size"]) == (4, 1, 2)
    units = plan_units(meta_model(GPT, init), ShardLabConfig(), 4).layouts()
    middle = [lay for name, lays in list(units.items())[1:-1] for lay in lays]  # neither the root nor the last
    assert list(units)[0] == "root" and middle  # some unit is gathered again for its backward
    # forward gathers stay in the world (the shard group); the backward ones (one per middle flat parameter)
    # move to the reshard groups of 2, with the same full bf16 tensor
    gathered = sum(len(lays) for lays in units.values())
    by_scope = plan["traffic"]["by_scope"]
    assert by_scope["reshard"] == {"all_gather": [len(middle), sum(lay.padded_numel * 2 for lay in middle)]}
    assert by_scope["world"]["all_gather"][0] == gathered
    assert plain["traffic"]["by_scope"]["world"]["all_gather"][0] == gathered + len(middle)
    assert set(by_scope) == {"world", "reshard"} and set(plain["traffic"]["by_scope"]) == {"world"}
    for key in ("all_gather_calls", "all_gather_bytes", "reduce_scatter_calls", "reduce_scatter_bytes"):
        assert plan["traffic"][key] == plain["traffic"][key]  # the totals count every scope
    # between forward and backward each unit that ran forward keeps 1/k of itself: a higher peak
    assert plan["gathered_peak"] > plain["gathered_peak"]
    assert plan["link_seconds"]["inter"] == 0.0


@pytest.mark.parametrize("source", [["--params", "70e9"], ["--model", GPT]])
def test_a_group_size_that_does_not_divide_the_world_is_refused_by_name(
    source: list[str], capsys: pytest.CaptureFixture
) -> None:
    argv = [*source, "--world-size", "64", "--shard-group-size", "6"]
    with pytest.raises(ValueError, match="shard_group_size"):
        make_plan(parser().parse_args(argv))
    with pytest.raises(SystemExit, match="shard_group_size=6.*must divide the world size 64"):
        main(argv)


def test_the_budget_keeps_one_label_in_two_groups_apart() -> None:
    """Measured per step: by kind (every group), by group then kind, and by call with the group named."""
    training = {
        ("world", "all_gather", "blocks.0"): (4, 400, 0.4),
        ("reshard", "all_gather", "blocks.0"): (2, 400, 0.2),
        ("replica", "all_reduce", "blocks.0"): (2, 100, 0.1),
    }
    comm, by_scope, by_unit = per_step(training, steps=2)
    assert comm["all_gather"] == pytest.approx({"calls": 3, "bytes": 400, "seconds": 0.3})
    assert by_scope["reshard"]["all_gather"] == pytest.approx({"calls": 1, "bytes": 200, "seconds": 0.1})
    assert by_scope["replica"]["all_reduce"]["bytes"] == 50
    assert set(by_unit) == {"all_gather blocks.0", "reshard all_gather blocks.0", "replica all_reduce blocks.0"}


def test_offload_moves_the_state_below_the_device_and_says_whether_the_rest_fits(capsys: pytest.CaptureFixture) -> None:
    """70B, 8 ranks, bf16-mixed AdamW, stage 3: 16 B per parameter / 8 = 140 GB per rank does not fit in 80 GB;
    with offload='cpu' the device keeps the 2 B copy and 2 B gradient (35 GB) and the host the 4 B master and
    8 B moments (105 GB); each step moves the fp32 gradient down (4 B) and the bf16 shard up (2 B)."""
    base = "--params 70e9 --world-size 8 --device-memory 80GB".split()
    plain = plan_json(capsys, base)
    assert plain["device_bytes"] == pytest.approx(16 * P / 8) and plain["fits"] is False
    host = plan_json(capsys, [*base, "--offload", "cpu"])
    assert sum(host["locations"]["device"].values()) == pytest.approx(4 * P / 8) and host["fits"] is True
    assert host["locations"]["host"] == pytest.approx({"params": 0, "grads": 0, "master": 4 * P / 8,
                                                       "optimizer_state": 8 * P / 8})  # fmt: skip
    assert host["tier_moves"] == pytest.approx({"down": 4 * P / 8, "up": 2 * P / 8})
    assert host["tier_seconds"] == pytest.approx(6 * P / 8 / 50e9)  # PCIe 5, 50 GB/s each way
    # disk, fp32 SGD with momentum: the master is the compute shard and stays; the momentum (4 B) goes to disk
    disk = plan_json(capsys, [*base, "--offload", "disk", "--precision", "32-true", "--optimizer", "sgd"])
    assert disk["locations"]["disk"] == pytest.approx({"params": 0, "grads": 0, "master": 0,
                                                       "optimizer_state": 4 * P / 8})  # fmt: skip
    assert disk["tier_moves"] == pytest.approx({"down": 4 * P / 8, "up": 4 * P / 8})
    assert disk["tier_seconds"] == pytest.approx(4 * P / 8 / 5e9 + 4 * P / 8 / 7e9)  # NVMe write, read


def test_a_model_plan_with_disk_offload_files_each_trainable_shard(capsys: pytest.CaptureFixture) -> None:
    argv = ["--model", GPT, "--init-args", '{"n_layer": 2}', "--world-size", "2", "--offload", "disk"]
    plan = plan_json(capsys, [*argv, "--precision", "bf16-mixed"])
    layouts = [lay for lays in plan_units(meta_model(GPT, {"n_layer": 2}), ShardLabConfig(), 2).layouts().values()
               for lay in lays if lay.requires_grad]  # fmt: skip
    files = sum(4 * lay.shard_numel * 3 for lay in layouts)  # master, exp_avg, exp_avg_sq, fp32, whole shards
    assert plan["tier_moves"] == {"down": files, "up": files}
    assert plan["locations"]["disk"]["master"] + plan["locations"]["disk"]["optimizer_state"] == files
