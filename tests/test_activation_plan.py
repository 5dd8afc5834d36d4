"""Activations planned without running: the fake-tensor trace (budget/predicted/forward_trace.py) against a real CPU
forward counted the same way, the 7B-shaped plan with nothing allocated, and ``--device-memory`` verdicts."""

from __future__ import annotations

import functools
import json
import resource
import warnings
from typing import Any

import pytest
import torch
import torch.utils.checkpoint
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves

from lightning_shardlab.budget.predicted import changes
from lightning_shardlab.budget.predicted.fake_step import unit_members
from lightning_shardlab.budget.predicted.forward_trace import trace_forward
from lightning_shardlab.budget.predicted.setting import Setting
from lightning_shardlab.cli import plan as plan_command
from lightning_shardlab.core.config import ShardLabConfig
from lightning_shardlab.examples.gpt import GPT
from lightning_shardlab.sharding.checkpointing import chosen_modules
from lightning_shardlab.sharding.policy import choose_units

transformers = pytest.importorskip("transformers")

CONFIG = ShardLabConfig(unit_bucket_params=0)  # a unit per block, as a model of big blocks gets by default
GPT_ARGS = {"vocab_size": 61, "block_size": 64, "n_layer": 2, "n_head": 4, "n_embd": 32}
LLAMA_ARGS = {
    "vocab_size": 61, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 64,
}  # fmt: skip


def build(kind: str) -> nn.Module:
    if kind == "gpt":
        return GPT(**GPT_ARGS)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA_ARGS))


def real_loss(kind: str, model: nn.Module, ids: Tensor, targets: Tensor) -> Tensor:
    if kind == "gpt":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # self.log() without a Trainer
            return model.training_step((ids, targets), 0)
    return model(input_ids=ids, labels=targets).loss


# ---- the reference: a real forward on real tensors, counted by a pack hook written here ----


def measure(kind: str, batch: int, seq: int, checkpointing: bool, precision: str = "32-true") -> dict[str, Any]:
    """Bytes saved for backward by unit in a real CPU forward (each storage once, parameters left out, charged to
    the innermost running unit); with ``checkpointing`` each chosen module runs under torch's non-reentrant
    checkpoint and its tensor inputs are counted as what it keeps. Also each checkpointed module's own saves
    less its inputs (what its recomputation adds), from the plain run."""
    torch.manual_seed(0)
    model = build(kind)
    if precision == "bf16-mixed":  # the gathered compute copies are bf16; buffers keep their dtype
        for p in model.parameters():
            p.data = p.data.to(torch.bfloat16)
    choice = choose_units(model, CONFIG)
    names = chosen_modules(model, True, unit_members(choice), warn=False)
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    running: list[str] = []
    by_unit: dict[str, int] = {}
    seen: set[int] = set()
    inside: list[tuple[str, set[int], dict[str, int]]] = []
    recompute: dict[str, int] = {}

    def count(unit: str, t: Tensor, seen: set[int], into: dict[str, int]) -> None:
        key = t.untyped_storage()._cdata
        if key not in seen and key not in params:
            seen.add(key)
            into[unit] = into.get(unit, 0) + t.untyped_storage().nbytes()

    def pack(t: Tensor) -> Tensor:
        unit = running[-1] if running else "root"
        count(unit, t, seen, by_unit)
        if inside:
            count("own", t, inside[-1][1], inside[-1][2])
        return t

    def push(path: str) -> Any:
        return lambda module, args: running.append(path)  # returns None: the inputs stay

    def pop(module: nn.Module, args: Any, output: Any) -> None:
        running.pop()

    handles = []
    for path in choice.paths[1:]:
        for member in choice.modules_of(path):
            module = model.get_submodule(member)
            handles.append(module.register_forward_pre_hook(push(path)))
            handles.append(module.register_forward_hook(pop))

    def enter(module: nn.Module, args: tuple, kwargs: dict) -> None:
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)]
        if checkpointing:
            for t in inputs:
                count(running[-1], t, seen, by_unit)
        else:
            inside.append((running[-1], {t.untyped_storage()._cdata for t in inputs}, {}))

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        if not checkpointing:
            unit, _, own = inside.pop()
            recompute[unit] = max(recompute.get(unit, 0), own.get("own", 0))

    for name in names:
        module = model.get_submodule(name)
        handles.append(module.register_forward_pre_hook(enter, with_kwargs=True))
        handles.append(module.register_forward_hook(leave))
        if checkpointing:
            forward = module.forward
            module.forward = functools.partial(torch.utils.checkpoint.checkpoint, forward, use_reentrant=False)
    vocab = GPT_ARGS["vocab_size"]
    ids, targets = torch.randint(0, vocab, (batch, seq)), torch.randint(0, vocab, (batch, seq))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed", cache_enabled=False)
    with autocast, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = real_loss(kind, model, ids, targets)
    loss.backward()  # the checkpointed run recomputes: it must work on real tensors
    for h in handles:
        h.remove()
    return {"by_unit": by_unit, "total": sum(by_unit.values()), "recompute_peak": max(recompute.values(), default=0)}


CASES = [(kind, b, t) for kind in ("gpt", "llama") for b in (1, 3) for t in (16, 48)]


def meta(kind: str) -> nn.Module:
    with torch.device("meta"):
        return build(kind)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize(("kind", "batch", "seq"), CASES)
def test_traced_activations_match_a_real_forward_counted_the_same_way(
    kind: str, batch: int, seq: int, checkpointing: bool
) -> None:
    traced = trace_forward(meta(kind), batch, seq, "32-true", config=CONFIG).activations
    real = measure(kind, batch, seq, checkpointing)
    predicted = traced.checkpointed_by_unit if checkpointing else traced.by_unit
    print(f"\n{kind} B={batch} T={seq} {'checkpointed' if checkpointing else 'plain'}: unit measured / predicted")
    for unit, value in predicted.items():
        print(f"  {unit:16} {real['by_unit'].get(unit, 0):>8} / {value:>8}")
    assert set(real["by_unit"]) <= set(predicted)
    for unit, value in predicted.items():
        assert value == pytest.approx(real["by_unit"].get(unit, 0), rel=0.10), unit
    assert traced.saved(checkpointing) == pytest.approx(real["total"], rel=0.10)
    if not checkpointing:
        assert traced.recompute_peak == pytest.approx(real["recompute_peak"], rel=0.10)
        assert traced.checkpointed_total < traced.total  # checkpointing keeps less


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_traced_activations_under_bf16_mixed_match_a_real_autocast_forward(kind: str) -> None:
    traced = trace_forward(meta(kind), 2, 32, "bf16-mixed", config=CONFIG).activations
    real = measure(kind, 2, 32, False, "bf16-mixed")
    for unit, value in traced.by_unit.items():
        assert value == pytest.approx(real["by_unit"].get(unit, 0), rel=0.10), unit
    assert traced.total < trace_forward(meta(kind), 2, 32, "32-true", config=CONFIG).activations.total


def test_the_trace_puts_the_models_own_tensors_back() -> None:
    model = meta("gpt")
    before = {name: p for name, p in model.named_parameters()}
    trace_forward(model, 1, 8, "bf16-mixed", config=CONFIG)
    after = dict(model.named_parameters())
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)
    assert model.lm_head.weight is model.wte.weight and model.wte.weight.is_meta


# ---- the plan: a 7B-shaped model with nothing allocated, and --device-memory verdicts ----

LLAMA_7B = {
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 4096,
}  # fmt: skip


def plan(*argv: str) -> Any:
    return plan_command.make_plan(plan_command.parser().parse_args(list(argv)))


def test_a_7b_shaped_llama_plans_its_activations_with_nothing_allocated() -> None:
    planned = plan(
        "--model", "transformers.LlamaForCausalLM", "--init-args", json.dumps(LLAMA_7B), "--world-size", "8",
        "--micro-batch-size", "2", "--seq-len", "4096", "--device-memory", "80GB",
    )  # fmt: skip
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    acts = planned.activations
    assert 6.5e9 < planned.params < 7e9 and len(acts["by_unit"]) == 33  # the root and 32 layers
    assert acts["total"] > 20e9 and acts["checkpointed_total"] < acts["total"] / 10  # tens of GB traced ...
    assert maxrss < 2e9, f"max RSS {maxrss / 1e9:.2f} GB"  # ... none of it allocated
    peak = planned.step_peak
    # the busiest moment of forward and backward, traced on the engine's schedule: everything saved is live as
    # backward starts, so the moment holds at least that, beside the layout's state and the units gathered then
    assert peak["total"] == peak["model_state"] + peak["traced"] + peak["gathered"] + peak["in_flight"]
    assert peak["model_state"] == planned.device_bytes - planned.gathered_peak
    assert peak["traced"] >= acts["total"] and 0 < peak["gathered"] <= planned.gathered_peak
    assert planned.fits is (peak["total"] <= 80e9) and planned.fit["fits"] is planned.fits


GPT_SMALL = json.dumps({"vocab_size": 512, "block_size": 256, "n_layer": 8, "n_head": 4, "n_embd": 256})


def gpt_plan(*extra: str) -> Any:
    """A 6M-parameter GPT (four units of two blocks) on 8 ranks, sequences of 256 tokens."""
    base = ("--model", "lightning_shardlab.examples.gpt.GPT", "--init-args", GPT_SMALL, "--world-size", "8")
    return plan(*base, "--seq-len", "256", *extra)


def applied(options: dict[str, Any], argv: tuple[str, ...]) -> list[str]:
    """``argv`` with a change's options set."""
    pairs = [a for a in argv if a != "--activation-checkpointing"]
    out, given = [], dict(zip(pairs[::2], pairs[1::2]))
    given.update({f"--{k.replace('_', '-')}": str(v) for k, v in options.items() if k in ("stage", "micro_batch_size")})
    given.update({"--offload": options["offload"]} if "offload" in options else {})
    if "shard_group_size" in options:
        given.pop("--shard-group-size", None)
        given.update({"--shard-group-size": str(options["shard_group_size"])} if options["shard_group_size"] else {})
    for key, value in given.items():
        out += [key, value]
    return out + (["--activation-checkpointing"] if options.get("activation_checkpointing") or ckpt(argv) else [])


def ckpt(argv: tuple[str, ...]) -> bool:
    return "--activation-checkpointing" in argv


def memory(nbytes: float) -> tuple[str, str]:
    return "--device-memory", f"{nbytes:.0f}B"


@pytest.mark.parametrize(
    "argv", [("--stage", "3", "--micro-batch-size", "1"), ("--stage", "1", "--micro-batch-size", "8")]
)
def test_device_memory_fits_exactly_when_the_arithmetic_says_so(argv: tuple[str, ...]) -> None:
    peak = gpt_plan(*argv).step_peak
    assert peak["total"] == peak["model_state"] + peak["traced"] + peak["gathered"] + peak["in_flight"]
    assert gpt_plan(*argv, *memory(peak["total"])).fits is True
    short = gpt_plan(*argv, *memory(peak["total"] - 1))
    assert short.fits is False and short.fit["step_peak"] == peak["total"]


SETTINGS = [
    ("--stage", "1", "--micro-batch-size", "1", "--activation-checkpointing", "--precision", "32-true"),
    ("--stage", "2", "--micro-batch-size", "8"),  # at stage 1 the end of backward (every reduction at once) decides
    ("--stage", "3", "--micro-batch-size", "1"),
    ("--stage", "3", "--micro-batch-size", "4", "--activation-checkpointing"),
    ("--stage", "2", "--micro-batch-size", "2", "--shard-group-size", "2"),
]


def test_the_cheapest_change_that_fits_is_chosen_its_own_plan_fits_and_every_kind_is_chosen_somewhere(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """For each setting, at each candidate's own peak as the device memory: the choice fits, no fitting change costs
    less, and the plan with the choice applied has the step peak the verdict computed for it. Over the settings every
    kind of change is chosen somewhere (the rule is exercised, not one answer).

    Each setting is planned by the command once (at 1 byte: every candidate's peak); the verdict at each limit is the
    one the command gives there (``changes.verdict`` on that plan and its setting: the command's own verdict at 1 byte
    is checked to be exactly it), and the plan with the choice applied is a fresh run of the command."""
    made: list[tuple[Any, Setting]] = []

    def keep(plan: Any, setting: Setting, device_memory: float | None) -> Any:
        made.append((plan, setting))
        return changes.add_activations(plan, setting, device_memory)

    kinds = set()
    for argv in SETTINGS:
        with monkeypatch.context() as patched:
            patched.setattr(plan_command, "add_activations", keep)
            planned = gpt_plan(*argv, *memory(1))  # nothing fits 1 byte: every candidate's peak
        [(base, setting)] = made
        made.clear()
        assert changes.verdict(setting, base, 1) == planned.fit, argv  # the command's verdict, as called here
        tried = planned.fit["candidates"]
        assert tried, argv
        for limit in sorted({c["peak"]["total"] for c in tried}):
            fit = changes.verdict(setting, base, limit)
            choice = next(c for c in fit["candidates"] if c["name"] == fit["choice"])
            kinds.add(choice["name"].split(" ")[0])
            assert choice["fits"] and choice["peak"]["total"] <= limit, (argv, choice)
            assert all(c["added_seconds"] >= choice["added_seconds"] for c in fit["candidates"] if c["fits"]), argv
            again = gpt_plan(*applied(choice["options"], argv), *memory(limit))
            assert again.fits and again.step_peak["total"] == pytest.approx(choice["peak"]["total"]), (argv, choice)
    assert {"stage", "activation_checkpointing", "micro-batch", "offload", "shard_group_size"} <= kinds, kinds


def test_nothing_fits_says_so_and_the_step_peak_is_the_arithmetic() -> None:
    judged = gpt_plan("--stage", "3", "--micro-batch-size", "2", "--activation-checkpointing", "--device-memory", "1MB")
    assert judged.fits is False and judged.fit["choice"] is None and judged.fit["candidates"]
    peak, acts = judged.step_peak, judged.activations
    assert acts["checkpointing"] and acts["recompute_peak"] > 0
    # checkpointed: the busiest moment holds more than the blocks' inputs (a recomputation, its gradients), far
    # less than what the step would save without checkpointing
    assert acts["checkpointed_total"] < peak["traced"] < acts["total"]
    assert peak["model_state"] == judged.device_bytes - judged.gathered_peak
    assert peak["total"] == peak["model_state"] + peak["traced"] + peak["gathered"] + peak["in_flight"]


@pytest.mark.parametrize(
    "argv",
    [
        ("--params", "1e9", "--micro-batch-size", "2", "--seq-len", "8"),
        ("--model", "lightning_shardlab.examples.gpt.GPT", "--micro-batch-size", "2"),
        ("--model", "lightning_shardlab.examples.gpt.GPT", "--activation-checkpointing"),
        ("--model", "lightning_shardlab.examples.gpt.GPT", "--micro-batch-size", "1", "--seq-len", "4096"),
    ],
)
def test_bad_micro_batch_options_name_the_fix(argv: tuple[str, ...]) -> None:
    with pytest.raises(ValueError, match="HINT"):
        plan(*argv, "--world-size", "2")
