"""Activations predicted: one micro-batch of the user's own module traced under fake tensors, nothing allocated.

``trace_activations`` runs one training forward (the LightningModule's ``training_step`` when it has one and it
runs under fake tensors, else ``forward`` and a loss) of a model built on the meta device, under torch's
``FakeTensorMode``: every parameter becomes a fake tensor of its shape and dtype, every op computes shapes
only, so a 7B-shaped model traces in about a second with no memory behind its tensors. Each tensor autograd
saves for backward passes through a ``saved_tensors_hooks`` pack hook and is counted as the run's meter counts
it (budget/measured/activations.py: by storage, once; parameters' storages left out as model state), charged to the
innermost unit whose forward is running (the units of sharding/policy.py; outside all of them, the root).

Precision as the run computes (common/precision.py): under ``bf16-mixed`` / ``16-mixed`` the floating
parameters are the low-precision compute copies the units gather, and the trace runs under ``torch.autocast``;
under ``bf16-true`` parameters, buffers and the default dtype are bf16; ``32-true`` as built.

Activation checkpointing (sharding/checkpointing.py chooses the modules: ``True`` = every unit's modules but the
root's) is predicted from the same trace, since checkpointing changes what is kept, not what is computed: a
checkpointed module keeps only its tensor inputs (positional and keyword, inside tuples too: what torch's
checkpoint holds for the recomputation; charged to its unit, each storage once), what runs outside
every checkpointed module saves as before, and in backward each checkpointed module's forward runs again and
saves what it saved the first time, less its inputs (already kept): ``recompute_peak``, the largest of those, is
live on top of the rest while that module's backward runs.

Kernels are chosen for the CPU (fake tensors on device "cpu"): where a GPU picks another kernel that saves
differently (attention's math fallback keeps the B x H x T x T weights; flash and memory-efficient attention
keep the output and the log-sum-exp, as the CPU's flash kernel does) the figure follows the CPU's choice.
"""

from __future__ import annotations

import inspect
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_leaves

from lightning_shardlab.budget.measured.activations import ROOT, SavedBytes, storage_key
from lightning_shardlab.budget.predicted.step_stand_ins import in_words, standing_in
from lightning_shardlab.core.config import ShardLabConfig
from lightning_shardlab.sharding.checkpointing import chosen_modules
from lightning_shardlab.sharding.policy import UnitChoice, choose_units

MakeInputs = Callable[[nn.Module, int, int], Any]  # (model, micro-batch size, sequence length) -> a batch
Step = Callable[[nn.Module, Any], Tensor]  # (model, batch) -> the loss
AUTOCAST = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
CONVERTED = {"bf16-true": torch.bfloat16, "64-true": torch.float64}  # the module converted, and the default dtype
LOW = {**AUTOCAST, **CONVERTED}  # the floating parameters' dtype as computed


class Untraced(ValueError):
    """A model none of whose steps ran under fake tensors; ``why``: the first step's failure in a few words."""

    def __init__(self, message: str, why: str) -> None:
        super().__init__(message)
        self.why = why


@dataclass
class ActivationTrace:
    """What one micro-batch's forward saves for backward, by unit (the root first, then the units in order)."""

    micro_batch_size: int
    seq_len: int
    precision: str
    step: str  # what ran: "training_step" or "forward"
    by_unit: dict[str, int]  # bytes saved, without checkpointing
    checkpointed_by_unit: dict[str, int]  # bytes saved with the checkpointed modules keeping only their inputs
    recompute_by_unit: dict[str, int]  # per unit: the largest recomputation of one of its checkpointed modules
    checkpointed: list[str] = field(default_factory=list)  # the checkpointed modules' names
    seconds: float = 0.0  # how long the trace took

    @property
    def total(self) -> int:
        return sum(self.by_unit.values())

    @property
    def checkpointed_total(self) -> int:
        return sum(self.checkpointed_by_unit.values())

    @property
    def recompute_peak(self) -> int:
        return max(self.recompute_by_unit.values(), default=0)

    def saved(self, checkpointing: bool) -> int:
        """Bytes kept for backward at its start: with checkpointing, the modules' inputs in place of their insides."""
        return self.checkpointed_total if checkpointing else self.total

    def fields(self) -> dict[str, Any]:
        return {
            "micro_batch_size": self.micro_batch_size,
            "seq_len": self.seq_len,
            "precision": self.precision,
            "step": self.step,
            "by_unit": self.by_unit,
            "total": self.total,
            "checkpointed_by_unit": self.checkpointed_by_unit,
            "checkpointed_total": self.checkpointed_total,
            "recompute_peak": self.recompute_peak,
            "checkpointed": self.checkpointed,
            "seconds": self.seconds,
        }


# ---- the batch and the loss, for token models unless the caller gives its own ----


def vocab_size(model: nn.Module) -> int:
    """The number of token ids: a Hugging Face config's ``vocab_size``, the hyperparameter, else the first
    embedding's rows. ``ValueError`` when none says."""
    for holder in (getattr(model, "config", None), getattr(model, "hparams", None)):
        value = holder.get("vocab_size") if isinstance(holder, Mapping) else getattr(holder, "vocab_size", None)
        if isinstance(value, int):
            return value
    embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if embedding is None:
        raise ValueError(
            f"{type(model).__name__} names no vocabulary size (no config.vocab_size, no hparams, no nn.Embedding)."
            " HINT: pass make_inputs= (and step=) to trace_activations."
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


def _has_training_step(model: nn.Module) -> bool:
    from lightning.pytorch import LightningModule

    return isinstance(model, LightningModule) and type(model).training_step is not LightningModule.training_step


# ---- the fake model ----


@contextmanager
def fake_parameters(model: nn.Module, mode: FakeTensorMode, precision: str) -> Iterator[set[int]]:
    """Inside: ``model``'s parameters and buffers are fake tensors on the CPU (tied parameters stay tied; floating
    ones in the compute dtype of ``precision``, buffers too under bf16-true and 64-true); yields the parameters'
    storage keys. The model's own tensors are put back on leaving."""
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


# ---- the counting ----


class _Ledgers:
    """The three counts one trace keeps: without checkpointing, with it, and each checkpointed module's recompute."""

    def __init__(self, model: nn.Module, choice: UnitChoice, checkpointed: list[str], params: set[int]) -> None:
        self.params = params
        self.plain = SavedBytes(params)
        self.kept = SavedBytes(params)  # with checkpointing
        self.recompute: dict[str, int] = {}  # unit -> its largest checkpointed module's recompute
        self.running: list[str] = []  # the units whose forward runs, innermost last
        self.inside: list[tuple[str, SavedBytes]] = []  # the outermost checkpointed module running, its count
        self.handles: list[Any] = []
        self.held: list[Tensor] = []  # every tensor packed, until the trace ends
        for path in choice.paths[1:]:
            for member in choice.modules_of(path):
                module = model.get_submodule(member)
                self.handles.append(module.register_forward_pre_hook(self._enter_unit(path)))
                self.handles.append(module.register_forward_hook(self._leave_unit))
        for name in checkpointed:
            module = model.get_submodule(name)
            self.handles.append(module.register_forward_pre_hook(self._enter_checkpointed, with_kwargs=True))
            self.handles.append(module.register_forward_hook(self._leave_checkpointed))

    @property
    def current(self) -> str:
        return self.running[-1] if self.running else ROOT

    def _enter_unit(self, path: str) -> Callable:
        def hook(module: nn.Module, args: Any) -> None:
            self.running.append(path)

        return hook

    def _leave_unit(self, module: nn.Module, args: Any, output: Any) -> None:
        self.running.pop()

    def _enter_checkpointed(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        inputs = [a for a in tree_leaves((args, kwargs)) if isinstance(a, Tensor)]
        depth = len(self.inside)
        if depth == 0 and torch.is_grad_enabled():
            for tensor in inputs:
                self.kept.add(self.current, tensor)
        own = SavedBytes(self.params | {storage_key(t) for t in inputs})
        self.inside.append((self.current, own) if depth == 0 else self.inside[-1])

    def _leave_checkpointed(self, module: nn.Module, args: Any, output: Any) -> None:
        unit, own = self.inside.pop()
        if not self.inside:
            self.recompute[unit] = max(self.recompute.get(unit, 0), own.total)

    def pack(self, tensor: Tensor) -> None:
        """Count ``tensor``, and hold it here until the trace ends (so no storage is freed and its identity reused
        while storages are being told apart), not in autograd's node: no backward follows a trace, and a tensor
        packed there would hold its own graph in a cycle through autograd's nodes that Python cannot collect."""
        self.held.append(tensor)
        self.plain.add(self.current, tensor)
        if self.inside:
            self.inside[-1][1].add(self.current, tensor)
        else:
            self.kept.add(self.current, tensor)
        return None

    def remove(self) -> None:
        self.held.clear()
        for handle in self.handles:
            handle.remove()


def _unpack(packed: None) -> Tensor:
    raise RuntimeError("a traced forward has no backward: fake tensors are counted, not kept")


def unit_members(choice: UnitChoice) -> dict[str, str]:
    """The name of each module of a non-root unit -> that unit's name (sharding/checkpointing.py's ``units``)."""
    return {member: path for path in choice.paths[1:] for member in choice.modules_of(path)}


def trace_activations(
    model: nn.Module,
    micro_batch_size: int,
    seq_len: int,
    precision: str = "32-true",
    *,
    config: ShardLabConfig | None = None,
    make_inputs: MakeInputs | None = None,
    step: Step | None = None,
) -> ActivationTrace:
    """Trace one micro-batch of ``model`` (built on the meta device, or anywhere: its tensors are not read) under
    fake tensors: the bytes autograd saves for backward, by unit of ``config``'s policy, without and with
    activation checkpointing (``config.activation_checkpointing`` when it chooses modules, else ``True``: every
    unit's modules). ``make_inputs(model, B, T)`` makes the batch inside the fake mode (default: token ids and
    targets, (B, T)); ``step(model, batch)`` returns the loss (default: the LightningModule's ``training_step``
    when it runs under fake tensors, else ``forward`` and a loss). ``ValueError`` when the model does not run."""
    config = config or ShardLabConfig()
    choice = choose_units(model, config)
    option = getattr(config, "activation_checkpointing", False) or True
    checkpointed = chosen_modules(model, option, unit_members(choice), warn=False)
    steps = (
        [step] if step is not None else [lightning_step, forward_step] if _has_training_step(model) else [forward_step]
    )
    began, modes = time.perf_counter(), {m: m.training for m in model.modules()}
    model.train()  # a training step: dropout keeps its masks
    try:
        ledgers, attempt = _first_step_that_runs(
            model, steps, make_inputs or token_batch, (micro_batch_size, seq_len, precision), choice, checkpointed
        )
    finally:
        for module, training in modes.items():
            module.training = training
    order = [ROOT, *choice.paths[1:]]
    return ActivationTrace(
        micro_batch_size=micro_batch_size,
        seq_len=seq_len,
        precision=precision,
        step=next((name for name, known in STEPS.items() if known is attempt), "step"),
        by_unit={name: ledgers.plain.by_unit.get(name, 0) for name in order},
        checkpointed_by_unit={name: ledgers.kept.by_unit.get(name, 0) for name in order},
        recompute_by_unit={name: v for name, v in ledgers.recompute.items()},
        checkpointed=checkpointed,
        seconds=time.perf_counter() - began,
    )


def _first_step_that_runs(
    model: nn.Module,
    steps: list[Step],
    make_inputs: MakeInputs,
    shape: tuple[int, int, str],
    choice: UnitChoice,
    checkpointed: list[str],
) -> tuple[_Ledgers, Step]:
    """One micro-batch through the first of ``steps`` that runs under fake tensors, counted; ``ValueError`` naming
    why each failed when none does."""
    micro_batch_size, seq_len, precision = shape
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    errors, first = [], None
    with fake_parameters(model, mode, precision) as params:
        for attempt in steps:
            ledgers = _Ledgers(model, choice, checkpointed, params)
            try:
                with mode, torch.enable_grad(), computing(precision):
                    batch = make_inputs(model, micro_batch_size, seq_len)
                    with torch.autograd.graph.saved_tensors_hooks(ledgers.pack, _unpack):
                        attempt(model, batch)
                return ledgers, attempt
            except Exception as err:  # noqa: BLE001 - the next way to run it, or the error below
                errors.append(f"{getattr(attempt, '__name__', attempt)}: {type(err).__name__}: {err}")
                first = first or err
            finally:
                ledgers.remove()
    raise Untraced(
        f"{type(model).__name__} did not run one micro-batch ({micro_batch_size} x {seq_len}) under fake"
        f" tensors: {'; '.join(errors)}. HINT: check --seq-len against the model's context; or give"
        " trace_activations a make_inputs= and step= for this model.",
        in_words(first) if first is not None else "nothing to run",
    )
