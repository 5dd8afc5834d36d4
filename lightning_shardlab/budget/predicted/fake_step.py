"""The user's own step run under fake tensors: a batch of the right shapes, the step's loss, the module's parameters
faked for the run's precision, and the units' forward hooks, shared by what a trace counts (forward_trace.py) and by
the step's timeline (step_timeline.py).

The step is the LightningModule's own ``training_step`` when it runs under fake tensors (what it logs, reads of its
trainer and ``.item()`` stood in for: step_stand_ins.py), else ``forward`` and a loss. A model on the meta device runs
under ``FakeTensorMode``: shapes only, nothing allocated, so a 7B-shaped model runs in about a second.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_map

from lightning_shardlab.budget.measured.activations import storage_key
from lightning_shardlab.budget.predicted.step_stand_ins import in_words, standing_in
from lightning_shardlab.sharding.policy import UnitChoice

MakeInputs = Callable[[nn.Module, int, int], Any]  # (model, micro-batch size, sequence length) -> a batch
Step = Callable[[nn.Module, Any], Tensor]  # (model, batch) -> the loss
AUTOCAST = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
CONVERTED = {"bf16-true": torch.bfloat16, "64-true": torch.float64}  # the module converted, and the default dtype
LOW = {**AUTOCAST, **CONVERTED}  # the floating parameters' dtype as computed
T = TypeVar("T")


class Untraced(ValueError):
    """A model none of whose steps ran under fake tensors; ``why``: the first step's failure in a few words."""

    def __init__(self, message: str, why: str) -> None:
        super().__init__(message)
        self.why = why


# ---- the batch and the loss, for token models unless the caller gives its own ----


def vocab_size(model: nn.Module) -> int:
    """A Hugging Face config's ``vocab_size``, the hyperparameter, else the first embedding's rows."""
    for holder in (getattr(model, "config", None), getattr(model, "hparams", None)):
        value = holder.get("vocab_size") if isinstance(holder, Mapping) else getattr(holder, "vocab_size", None)
        if isinstance(value, int):
            return value
    embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if embedding is None:
        raise ValueError(
            f"{type(model).__name__} names no vocabulary size (no config.vocab_size, no hparams, no nn.Embedding)."
            " HINT: pass make_inputs= (and step=) to trace_forward."
        )
    return embedding.num_embeddings


def token_batch(model: nn.Module, micro_batch_size: int, seq_len: int) -> tuple[Tensor, Tensor]:
    """(token ids, targets), both (B, T), drawn from the model's vocabulary."""
    vocab = vocab_size(model)
    shape = (micro_batch_size, seq_len)
    return torch.randint(0, vocab, shape), torch.randint(0, vocab, shape)


def lightning_step(model: nn.Module, batch: Any) -> Tensor:
    """The LightningModule's own ``training_step(batch, 0)``: its loss (a tensor, or a dict's ``loss``), with what it
    logs, its metrics and the numbers it reads from tensors stood in for (budget/predicted/step_stand_ins.py)."""
    with warnings.catch_warnings(), standing_in(model):
        warnings.simplefilter("ignore")  # the trainer's warnings about a module read outside its loop
        out = model.training_step(batch, 0)  # type: ignore[operator]
    loss = out["loss"] if isinstance(out, Mapping) else out
    if not isinstance(loss, Tensor):
        raise ValueError(f"training_step returned {type(out).__name__}, not a loss to trace a backward from")
    return loss


def forward_step(model: nn.Module, batch: Any) -> Tensor:
    """``forward`` and a loss on (ids, targets): a Hugging Face model's own (``labels=``), else cross-entropy of
    the logits against the targets."""
    ids, targets = batch
    params = inspect.signature(model.forward).parameters
    if "input_ids" in params and "labels" in params:
        return model(input_ids=ids, labels=targets).loss
    out = model(ids)
    logits = out if isinstance(out, Tensor) else getattr(out, "logits", None)
    if logits is None:
        logits = out[0]
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten())


STEPS: dict[str, Step] = {"training_step": lightning_step, "forward": forward_step}  # by ActivationTrace.step


def steps_for(model: nn.Module) -> list[Step]:
    """The ways to run ``model``'s step, in order: its own ``training_step`` (a LightningModule's), then ``forward``."""
    from lightning.pytorch import LightningModule

    own = isinstance(model, LightningModule) and type(model).training_step is not LightningModule.training_step
    return [lightning_step, forward_step] if own else [forward_step]


def fake_like(batch: Any) -> Any:
    """``batch`` with each tensor an empty one of its shape and dtype on the CPU (fake, made inside a fake mode)."""
    return tree_map(lambda t: torch.empty_like(t, device="cpu") if isinstance(t, Tensor) else t, batch)


# ---- the fake model ----


@contextmanager
def fake_parameters(model: nn.Module, mode: FakeTensorMode, precision: str) -> Iterator[set[int]]:
    """Inside: ``model``'s parameters and buffers are fake tensors on the CPU (tied ones stay tied; floating ones in
    ``precision``'s compute dtype, buffers too when the module is converted); yields the parameters' storage keys."""
    low = LOW.get(precision)
    made: dict[int, Tensor] = {}
    saved: list[tuple[dict[str, Any], str, Any]] = []

    def fake(t: Tensor, cast: bool) -> Tensor:
        dtype = low if cast and low is not None and t.is_floating_point() else t.dtype
        with mode:
            return torch.empty(t.shape, dtype=dtype, device="cpu")

    for module in model.modules():
        for table, is_param in ((module._parameters, True), (module._buffers, False)):
            for name, t in list(table.items()):
                if t is None:
                    continue
                if id(t) not in made:
                    if is_param:
                        made[id(t)] = nn.Parameter(fake(t, True), requires_grad=t.requires_grad)
                    else:
                        made[id(t)] = fake(t, precision in CONVERTED)
                saved.append((table, name, t))
                table[name] = made[id(t)]
    try:
        yield {storage_key(p) for p in model.parameters()}
    finally:
        for table, name, t in saved:
            table[name] = t


@contextmanager
def training(model: nn.Module) -> Iterator[None]:
    """``model`` in training mode inside (dropout keeps its masks), each module's own mode put back on leaving."""
    modes = {m: m.training for m in model.modules()}
    model.train()
    try:
        yield
    finally:
        for module, mode in modes.items():
            module.training = mode


@contextmanager
def computing(precision: str) -> Iterator[None]:
    """Autocast (mixed precision), or the converted dtype as the default (bf16-true, 64-true), as Lightning's
    precision plugins run forward (common/precision.py)."""
    with ExitStack() as stack:
        if precision in AUTOCAST:
            stack.enter_context(torch.autocast("cpu", dtype=AUTOCAST[precision], cache_enabled=False))
        elif precision in CONVERTED:
            before = torch.get_default_dtype()
            torch.set_default_dtype(CONVERTED[precision])
            stack.callback(torch.set_default_dtype, before)
        yield


def unit_members(choice: UnitChoice) -> dict[str, str]:
    """The name of each module of a non-root unit -> that unit's name (sharding/checkpointing.py's ``units``)."""
    return {member: path for path in choice.paths[1:] for member in choice.modules_of(path)}


def hook_units(model: nn.Module, choice: UnitChoice, enter: Callable[[str], Any], leave: Callable[[], Any]) -> list:
    """Forward hooks on each module of every unit but the root: ``enter(unit)`` before it runs, ``leave()`` after
    (what they return is dropped: a hook's would replace the module's inputs or output)."""
    handles = []
    for member, path in unit_members(choice).items():

        def before(*_: Any, unit: str = path) -> None:
            enter(unit)

        def after(*_: Any) -> None:
            leave()

        module = model.get_submodule(member)
        handles += [module.register_forward_pre_hook(before), module.register_forward_hook(after)]
    return handles


def first_step_that_runs(
    model: nn.Module, steps: list[Step], precision: str, run: Callable[[Step, FakeTensorMode, set[int]], T]
) -> tuple[T, Step]:
    """``run(step, mode, parameters' storage keys)`` for the first of ``steps`` that runs, ``model`` training on fake
    parameters (``fake_parameters``); ``Untraced`` naming why each failed when none does."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    errors, first = [], None
    with training(model), fake_parameters(model, mode, precision) as params:
        for step in steps:
            try:
                return run(step, mode, params), step
            except Exception as err:  # noqa: BLE001 - the next way to run it, or the error below
                errors.append(f"{getattr(step, '__name__', step)}: {type(err).__name__}: {err}")
                first = first or err
    raise Untraced("; ".join(errors), in_words(first) if first is not None else "nothing to run")
