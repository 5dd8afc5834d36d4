"""``activation_checkpointing``: chosen modules recompute their forward in backward, exact at every stage.

One 2-rank launch trains each model with Lightning's ``ddp`` *without* checkpointing (the reference), then with
shardlab at stages 1, 2 and 3 *with* it (one unit per block: ``unit_bucket_params=0``), and compares every step's
loss and the final weights (fp32 tolerance): the example GPT (with dropout: the recomputation draws the same
masks), a tiny Hugging Face Llama and GPT-2, and GPT-2 with Hugging Face's own ``gradient_checkpointing_enable()``
beside ``activation_checkpointing=True`` (its blocks are left to it, with a warning: no double wrap). The option's
forms are all used: True, classes, an import path, a callable.

In the same launch, on the engine alone: the bytes autograd saves for backward inside each checkpointed unit drop
from many times its inputs to nothing (it keeps its inputs), the all-gathers and reduce-scatters per step are the
same with and without checkpointing at stage 3 (the recomputation reads the backward gather), and Fabric's
strategy applies the option on the same setup path.
"""

from __future__ import annotations

import copy
import os
import sys
import warnings
from collections import Counter
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.testing import assert_close

from lightning_shardlab import ShardLabConfig, ShardLabStrategy, cli, shard_model, shard_optimizer
from lightning_shardlab import fabric as shardlab_fabric
from lightning_shardlab.examples.gpt import GPT, MLP, Block
from lightning_shardlab.sharding import checkpointing
from tests.helpers.launch import run_ranks
from tests.helpers.reference import FP32, init_from_env, shutdown
from tests.models import OrderedData, token_dataset

STEPS, LOCAL_BATCH, VOCAB, SEQ = 5, 2, 37, 11


def _build(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "gpt":
        return GPT(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=2, n_embd=16, dropout=0.1)
    import transformers

    if kind == "llama":
        config = transformers.LlamaConfig(
            vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=32,
        )  # fmt: skip
        return transformers.LlamaForCausalLM(config)
    gpt2 = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=16, n_layer=2, n_head=2, n_embd=16, bos_token_id=None, eos_token_id=None
    )
    model = transformers.GPT2LMHeadModel(gpt2)
    if kind == "gpt2_hf":
        model.gradient_checkpointing_enable()  # Hugging Face's own (non-reentrant) checkpointing of each block
    return model


class CausalLM(L.LightningModule):
    """A language model of ``kind`` under ``self.net``, recording each step's local loss."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind, self.net = kind, _build(kind)
        self.losses: list[Tensor] = []

    def forward(self, idx: Tensor) -> Tensor:
        return self.net(idx) if self.kind == "gpt" else self.net(input_ids=idx, use_cache=False).logits

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x).flatten(0, 1), y.flatten())
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)

    def on_train_start(self) -> None:
        torch.manual_seed(1 + self.global_rank)  # dropout: every run of a rank draws from the same stream


def _is_llama_layer(module: nn.Module) -> bool:
    return type(module).__name__ == "LlamaDecoderLayer"


# kind -> (label, activation_checkpointing, the modules checkpointed); the GPT and GPT-2 references are shared
BLOCKS = ["net.blocks.0", "net.blocks.1"]
LLAMA = ["net.model.layers.0", "net.model.layers.1"]
GPT2 = ["net.transformer.h.0", "net.transformer.h.1"]
RUNS: dict[str, list[tuple[str, Any, list[str]]]] = {
    "gpt": [
        ("stage 1", [Block], BLOCKS),
        ("stage 2", "lightning_shardlab.examples.gpt.Block", BLOCKS),
        ("stage 3", True, BLOCKS),
        ("stage 3", [MLP], ["net.blocks.0.mlp", "net.blocks.1.mlp"]),  # inside the units
    ],
    "llama": [("stage 1", True, LLAMA), ("stage 2", True, LLAMA), ("stage 3", _is_llama_layer, LLAMA)],
    "gpt2": [("stage 1", True, GPT2), ("stage 2", True, GPT2), ("stage 3", True, GPT2)],
    "gpt2_hf": [("stage 3", True, [])],  # Hugging Face checkpoints its blocks itself
}


def _fit(model: CausalLM, strategy: Any) -> L.Trainer:
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=STEPS, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(model, OrderedData(token_dataset(STEPS * LOCAL_BATCH * 2, vocab=VOCAB, block_size=SEQ), LOCAL_BATCH))
    return trainer


def _parity(kind: str, reference: CausalLM, rank: int) -> dict:
    ref_state = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    out = {}
    for label, option, expected in RUNS[kind]:
        model = CausalLM(kind)
        strategy = ShardLabStrategy(stage=int(label[-1]), unit_bucket_params=0, activation_checkpointing=option)
        watched, calls = expected or GPT2, Counter()  # the first child of each module that recomputes
        for name in watched:
            child = next(model.get_submodule(name).children())
            child.register_forward_hook(lambda module, args, output, n=name: calls.update([n]))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer = _fit(model, strategy)
        where = f"{kind}, {label}, activation_checkpointing={option!r}, rank {rank}"
        sharded = trainer.strategy.sharded
        assert sharded.checkpointed == expected, where
        for name in expected:  # the module keeps its class and names; only the instance's forward is replaced
            assert checkpointing._is_checkpointed(model.get_submodule(name)), where
        assert len(model.losses) == len(reference.losses) == STEPS, where
        assert calls == {name: 2 * STEPS for name in watched}, (where, calls)  # forward, then recomputed in backward
        assert_close(torch.stack(model.losses), torch.stack(reference.losses), **FP32, msg=lambda m: f"{where}\n{m}")
        state = trainer.strategy.full_state_dict()
        if rank == 0:
            assert list(state) == list(ref_state), where
            for key, value in ref_state.items():
                assert_close(state[key], value, **FP32, msg=lambda m, k=key: f"{k}: {where}\n{m}")
        left = [str(w.message) for w in caught if "already run under the model's own" in str(w.message)]
        out[f"{label} {option!r}"] = {"checkpointed": sharded.checkpointed, "left_to_model": left}
    return out


# ---- the engine alone: saved bytes and collectives, with and without checkpointing ----


def _storage(t: Tensor) -> int:
    return t.untyped_storage()._cdata


class SavedBytes:
    """What autograd saves in one forward, by storage (each once), charged to the unit whose forward is running
    (``None``: outside every unit), and each unit's tensor inputs. Parameters and flat buffers are left out."""

    def __init__(self, sharded: Any, units: dict[str, nn.Module]) -> None:
        self.excluded = {_storage(p) for p in sharded.module.parameters()}
        for fp in sharded.flat_params:
            self.excluded |= {_storage(t) for t in (fp.full, fp.shard, fp.master) if isinstance(t, Tensor)}
        self.seen: set[int] = set()
        self.saved: dict[str | None, int] = {}
        self.inputs: dict[str, int] = {}
        self.running: list[str] = []
        self.handles = []
        for name, module in units.items():
            self.handles.append(module.register_forward_pre_hook(lambda m, args, n=name: self._enter(n, args)))
            self.handles.append(module.register_forward_hook(self._leave))

    def _enter(self, name: str, args: tuple) -> None:
        self.running.append(name)
        self.inputs[name] = sum(a.untyped_storage().nbytes() for a in args if isinstance(a, Tensor))

    def _leave(self, module: nn.Module, args: tuple, output: Any) -> None:
        self.running.pop()

    def pack(self, t: Tensor) -> Tensor:
        key = _storage(t)
        if key not in self.seen and key not in self.excluded:
            self.seen.add(key)
            unit = self.running[-1] if self.running else None
            self.saved[unit] = self.saved.get(unit, 0) + t.untyped_storage().nbytes()
        return t

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _engine_step(option: Any, x: Tensor, y: Tensor) -> tuple[dict, list[dict], list[float], list]:
    comm = init_from_env()
    torch.manual_seed(0)
    model = GPT(vocab_size=VOCAB, block_size=SEQ, n_layer=3, n_head=2, n_embd=32)
    config = ShardLabConfig(stage=3, unit_bucket_params=0, activation_checkpointing=option)
    sharded = shard_model(model, config, comm)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    shard_optimizer(optimizer, sharded)
    units = {u.name: u.modules[0] for u in sharded.units if not u.is_root}
    mine = slice(comm.rank * LOCAL_BATCH, (comm.rank + 1) * LOCAL_BATCH)
    saved: dict = {}
    counts, losses = [], []
    for step in range(3):
        before = {k: t.count for k, t in comm.ledger.by_kind.items()}
        meter = SavedBytes(sharded, units) if step == 1 else None
        with sharded.step(keep_root_gathered=True):
            if meter is None:
                loss = F.cross_entropy(model(x[mine]).flatten(0, 1), y[mine].flatten())
            else:
                with torch.autograd.graph.saved_tensors_hooks(meter.pack, lambda t: t):
                    loss = F.cross_entropy(model(x[mine]).flatten(0, 1), y[mine].flatten())
                meter.remove()
                saved = {"saved": meter.saved, "inputs": meter.inputs}
        sharded.prepare_backward(loss)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        counts.append({k: t.count - before.get(k, 0) for k, t in comm.ledger.by_kind.items()})
        losses.append(loss.item())
    return saved, counts[1:], losses, sharded.checkpointed


def _fabric_run(option: bool) -> tuple[list[float], list[str]]:
    strategy = shardlab_fabric.ShardLabStrategy(stage=3, unit_bucket_params=0, activation_checkpointing=option)
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    model = GPT(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=2, n_embd=16)
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    x, y = token_dataset(8, vocab=VOCAB, block_size=SEQ).tensors
    losses = []
    for _ in range(3):
        rows = slice(fabric.global_rank * 4, (fabric.global_rank + 1) * 4)
        loss = F.cross_entropy(model(x[rows]).flatten(0, 1), y[rows].flatten())
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, fabric.strategy.sharded_model(model).checkpointed


def activation_checkpointing_parity(kinds: list[str]) -> dict:
    rank = int(os.environ["RANK"])
    x, y = token_dataset(2 * LOCAL_BATCH, vocab=VOCAB, block_size=SEQ, seed=5).tensors
    report: dict[str, Any] = {"engine": {str(option): _engine_step(option, x, y) for option in (False, True)}}
    shutdown()  # the engine's process group; Fabric and the Trainer open their own
    report["fabric"] = {str(option): _fabric_run(option) for option in (False, True)}
    try:  # a module holding units: refused on every rank at setup, before any collective or step
        _fit(CausalLM("gpt"), ShardLabStrategy(unit_bucket_params=0, activation_checkpointing=nn.ModuleList))
        report["refused"] = None
    except ValueError as error:
        report["refused"] = str(error)
    references: dict[str, CausalLM] = {}
    for kind in kinds:
        base = "gpt2" if kind == "gpt2_hf" else kind  # the same initial model, trained without checkpointing
        if base not in references:
            references[base] = CausalLM(base)
            _fit(references[base], "ddp")
        report[kind] = _parity(kind, references[base], rank)
    return report


def test_checkpointed_units_train_like_ddp_without_checkpointing_at_every_stage() -> None:
    kinds = ["gpt", "llama", "gpt2", "gpt2_hf"]
    ranks = run_ranks(
        "tests.test_activation_checkpointing:activation_checkpointing_parity", 2, {"kinds": kinds}, timeout=300
    )
    for rank, report in enumerate(ranks):
        hf = report["gpt2_hf"]["stage 3 True"]
        assert hf["checkpointed"] == [] and len(hf["left_to_model"]) == (rank == 0), hf  # warned once, on rank 0
        assert all(repr(name) in hf["left_to_model"][0] for name in GPT2) if rank == 0 else True, hf
        assert "`activation_checkpointing` chose 'net.blocks' (ModuleList), which holds the units" in report["refused"]
    # the engine: what autograd saves inside each unit, and the collectives, with and without checkpointing
    plain, checkpointed = ranks[0]["engine"]["False"], ranks[0]["engine"]["True"]
    assert plain[3] == [] and checkpointed[3] == ["blocks.0", "blocks.1", "blocks.2"]
    assert plain[2] == checkpointed[2]  # the same arithmetic, bit for bit
    assert checkpointed[0]["inputs"].keys() == {"blocks.0", "blocks.1", "blocks.2"}
    for unit, inputs in checkpointed[0]["inputs"].items():
        assert plain[0]["saved"][unit] > 4 * inputs, (unit, plain[0])  # without: many times its input
        assert checkpointed[0]["saved"][unit] == inputs, (unit, checkpointed[0])  # with: its input, saved once
    total, plain_total = sum(checkpointed[0]["saved"].values()), sum(plain[0]["saved"].values())
    assert sum(checkpointed[0]["inputs"].values()) <= total < plain_total / 2, (checkpointed[0], plain[0])
    # no extra collective: the root gathered once (held for the step, refreshed after it), each block in forward
    # and blocks.0-1 again in backward (blocks.2, the last forward, is kept): the recomputation reads that gather
    assert plain[1] == checkpointed[1], (plain[1], checkpointed[1])
    assert checkpointed[1][0]["all_gather"] == 1 + 3 + 2 and checkpointed[1][0]["reduce_scatter"] == 4, checkpointed
    # Fabric's strategy applies the option on the same setup path; the same numbers as without it
    for report in ranks:
        (plain_losses, none), (losses, names) = report["fabric"]["False"], report["fabric"]["True"]
        assert none == [] and names == ["blocks.0", "blocks.1"]
        assert losses == plain_losses


# ---- the option itself, in this process ----


def test_the_option_takes_true_classes_import_paths_and_callables_and_refuses_the_rest() -> None:
    assert ShardLabConfig().activation_checkpointing is False
    assert ShardLabConfig(activation_checkpointing=None).activation_checkpointing is False
    assert ShardLabConfig(activation_checkpointing=[]).activation_checkpointing is False
    assert ShardLabConfig(activation_checkpointing=True).activation_checkpointing is True
    by_path = ShardLabConfig(activation_checkpointing=["lightning_shardlab.examples.gpt.Block", MLP])
    assert by_path.activation_checkpointing == (Block, MLP)
    assert ShardLabConfig(activation_checkpointing=Block).activation_checkpointing == (Block,)
    assert ShardLabConfig(activation_checkpointing=_is_llama_layer).activation_checkpointing is _is_llama_layer
    for bad in (3, "no.such.Block", [torch.optim.SGD], "torch.optim.SGD"):
        with pytest.raises(ValueError, match=r"activation_checkpointing.*Allowed values: False or None"):
            ShardLabConfig(activation_checkpointing=bad)
    with pytest.raises(ValueError, match="activation_checkpointing"):
        ShardLabStrategy(activation_checkpointing=2.5)


def _choose(option: Any, model: nn.Module, units: dict[str, str]) -> list[str]:
    return checkpointing.chosen_modules(
        model, ShardLabConfig(activation_checkpointing=option).activation_checkpointing, units
    )


def test_a_module_holding_units_is_refused_and_nested_choices_keep_the_outer() -> None:
    model = GPT(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=2, n_embd=16)
    units = {"blocks.0": "blocks.0", "blocks.1": "blocks.1"}
    assert _choose(True, model, units) == ["blocks.0", "blocks.1"]
    assert _choose([Block, MLP], model, units) == ["blocks.0", "blocks.1"]  # MLP inside a chosen Block
    assert _choose(lambda m: isinstance(m, MLP), model, units) == ["blocks.0.mlp", "blocks.1.mlp"]
    with pytest.raises(
        ValueError, match=r"chose 'blocks' \(ModuleList\), which holds the units 'blocks.0', 'blocks.1'"
    ):
        _choose(nn.ModuleList, model, units)
    with pytest.warns(UserWarning, match="chose no module of GPT .it has no unit but the root"):
        assert _choose(True, model, {}) == []


def test_apply_and_undo_keep_the_module_its_names_and_its_numbers() -> None:
    torch.manual_seed(0)
    model = GPT(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=2, n_embd=16)
    reference = copy.deepcopy(model)
    names = dict(model.named_parameters())
    checkpointing.apply(model, ["blocks.0", "blocks.1"])
    assert dict(model.named_parameters()) == names and type(model.blocks[0]) is Block
    x = token_dataset(2, vocab=VOCAB, block_size=SEQ).tensors[0]
    model(x).square().mean().backward()
    reference(x).square().mean().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad), name
    checkpointing.undo(model, ["blocks.0", "blocks.1"])
    assert "forward" not in vars(model.blocks[0]) and not checkpointing._is_checkpointed(model.blocks[1])


def test_yaml_names_the_modules_to_checkpoint(
    tmp_path: Any, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "strategy.yaml"
    config.write_text(
        "trainer:\n  strategy:\n    class_path: lightning_shardlab.ShardLabStrategy\n    init_args:\n"
        "      activation_checkpointing: [lightning_shardlab.examples.gpt.Block]\n"
        "model:\n  class_path: lightning_shardlab.examples.gpt.GPT\n"
    )
    monkeypatch.setattr(sys, "argv", ["shardlab"])
    with pytest.raises(SystemExit):
        cli.main(["fit", "--config", str(config), "--print_config"])
    printed = capsys.readouterr().out
    assert "activation_checkpointing:\n      - lightning_shardlab.examples.gpt.Block" in printed, printed
    strategy = ShardLabStrategy(activation_checkpointing=["lightning_shardlab.examples.gpt.Block"])
    assert strategy.config.activation_checkpointing == (Block,)
