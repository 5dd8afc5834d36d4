"""Which modules become units, and which unit owns each parameter (in one process, world size 1)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_shardlab import Comm, ShardLabConfig, shard_model
from lightning_shardlab.sharding.placeholders import ShardedAtRest
from lightning_shardlab.sharding.policy import choose_units, owning_unit, param_uses
from tests.models import OddNet, TinyGPT

PER_BLOCK = ShardLabConfig(unit_bucket_params=0)  # the policy itself: a unit per block (buckets: test_buckets.py)


def test_default_policy_makes_each_repeated_block_a_unit() -> None:
    assert choose_units(TinyGPT(n_layer=3), PER_BLOCK).paths == ["", "blocks.0", "blocks.1", "blocks.2"]
    # a Sequential of different layer types is not a repeated block; neither is a list of parameterless modules
    mixed = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 3))
    assert choose_units(mixed, PER_BLOCK).paths == [""]


def test_unit_classes_by_import_path_and_minimum_size() -> None:
    config = ShardLabConfig(unit_classes=("torch.nn.Linear",))
    assert choose_units(OddNet(), config).paths == [
        "",
        "inp",
        "blocks.0.l1",
        "blocks.0.l2",
        "blocks.1.l1",
        "blocks.1.l2",
        "tiny",
        "out",
    ]
    config = ShardLabConfig(unit_classes=("torch.nn.Linear",), min_unit_params=100)
    assert choose_units(OddNet(), config).paths == [
        "",
        "inp",
        "blocks.0.l1",
        "blocks.0.l2",
        "blocks.1.l1",
        "blocks.1.l2",
    ]


def test_tied_parameter_lives_in_the_lowest_common_unit() -> None:
    model = TinyGPT(n_layer=2)
    model.blocks[1].ln_1.weight = model.blocks[0].ln_1.weight  # tie across two block units
    units = choose_units(model, PER_BLOCK).paths
    owners = {use.fqns[0]: owning_unit(use, units) for use in param_uses(model)}
    assert owners["wte.weight"] == ""  # embedding and head, both at the root
    assert owners["blocks.0.ln_1.weight"] == ""  # used by blocks 0 and 1: their common ancestor is the root
    assert owners["blocks.0.ln_2.weight"] == "blocks.0"
    uses = {u.fqns[0]: u.fqns for u in param_uses(model)}
    assert uses["wte.weight"] == ["wte.weight", "lm_head.weight"]


def test_one_flat_param_per_dtype_and_requires_grad() -> None:
    model = OddNet()
    model.blocks[0].l1.weight.requires_grad_(False)
    model.blocks[0].l2.to(torch.float64)
    sharded = shard_model(model, PER_BLOCK, Comm.single())
    unit = next(u for u in sharded.units if u.name == "blocks.0")
    kinds = [(fp.layout.dtype, fp.layout.requires_grad, [s.name for s in fp.layout.slots]) for fp in unit.flat_params]
    assert kinds == [
        (torch.float32, False, ["blocks.0.l1.weight"]),
        (torch.float32, True, ["blocks.0.l1.bias"]),
        (torch.float64, True, ["blocks.0.l2.weight", "blocks.0.l2.bias"]),
    ]
    # names never change, and at rest (stage 3) the parameters keep their shapes but refuse their values
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in OddNet().named_parameters()]
    assert isinstance(model.blocks[0].l1.weight, ShardedAtRest) and model.blocks[0].l1.weight.shape == (17, 15)
    assert model.blocks[0].l2.weight.dtype == torch.float64


def test_stages_1_and_2_keep_real_parameters_on_the_module() -> None:
    model = OddNet()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    shard_model(model, ShardLabConfig(stage=2, unit_bucket_params=0), Comm.single())
    assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())


def test_default_units_need_evidence_that_every_forward_runs_every_block() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    from tests.models import BranchyNet, ByIndex, Checkpointed, DictValues, MoENet, Reused, SkipsOne

    def units(model: nn.Module) -> list[str]:
        return choose_units(model, PER_BLOCK).paths

    hf = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=40, bos_token_id=0, eos_token_id=0))
    assert units(hf) == ["", "transformer.h.0", "transformer.h.1"]  # `for i, block in enumerate(self.h)`
    assert units(nn.Sequential(*[nn.Linear(3, 3) for _ in range(3)])) == ["", "0", "1", "2"]
    for model in (DictValues("dict"), Checkpointed(), Reused()):
        assert units(model) == ["", "layers.0", "layers.1", "layers.2"], type(model).__name__
    # data- or step-dependent: the blocks stay in the enclosing unit, and the policy says why
    for model, declined in (
        (MoENet(experts=4), "moe.experts"),
        (BranchyNet(), "branches"),
        (SkipsOne(), "layers"),
        (ByIndex(), "layers"),
    ):
        choice = choose_units(model, PER_BLOCK)
        assert choice.paths == [""] and choice.declined == [declined], (type(model).__name__, choice)
    with pytest.warns(UserWarning, match=r"'moe\.experts' \(Expert\) are not made units.*unit_classes"):
        shard_model(MoENet(experts=4), PER_BLOCK, Comm.single())
    # MoE blocks run in order: the blocks are units, the experts inside them are not considered
    assert units(MoENet(experts=6, top_k=2, blocks=2)) == ["", "blocks.0", "blocks.1"]
    # the user's word overrides the evidence
    assert choose_units(MoENet(), ShardLabConfig(unit_classes=("tests.models.routing.Expert",))).paths[1:] == [
        f"moe.experts.{i}" for i in range(4)
    ]
