"""The options, validated once and frozen. Every option is a plain value so a LightningCLI YAML can hold it."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum, IntEnum

import torch
from torch import nn

OFFLOADS = ("none", "cpu", "disk", "auto")
START_METHODS = ("popen", "spawn", "fork", "forkserver")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
REDUCE_DTYPES = {**DTYPES, "int8": torch.int8}  # what gradients may travel in (int8: blocks, docs/slow_links.md)


class Stage(IntEnum):
    """What is sharded at rest (the ZeRO ladder, docs/design.md)."""

    OPTIMIZER = 1  # optimizer state and fp32 master
    GRADIENTS = 2  # + gradients (reduce-scattered per unit during backward)
    PARAMETERS = 3  # + parameters: fully sharded (FSDP)


class Accumulation(str, Enum):
    """How gradients of micro-batches that do not end an optimizer step are handled."""

    REDUCE = "reduce"  # reduce-scatter every micro-batch into the grad shard: memory-safe
    DEFER = "defer"  # keep full gradients, reduce once on the last micro-batch: less traffic


def import_path(path: str, option: str) -> type:
    """``"torch.nn.TransformerEncoderLayer"`` -> the class. Raises ``ValueError`` naming ``option``."""
    module_name, _, attr = path.rpartition(".")
    try:
        obj = getattr(importlib.import_module(module_name), attr) if module_name else None
    except (ImportError, AttributeError):
        obj = None
    if not isinstance(obj, type):
        raise ValueError(
            f"`{option}` entry {path!r} is not an importable class. HINT: give the full import path of a class,"
            " e.g. 'torch.nn.TransformerEncoderLayer'."
        )
    return obj


def class_list(option: str, value: object, base: type) -> tuple[type, ...]:
    """A class, an import path, or a list mixing both (a YAML list of strings; ``[Block]`` in Python, as
    Lightning's ``auto_wrap_policy={Block}``) -> a tuple of classes, each a subclass of ``base``. None: ().
    Raises ``ValueError`` naming ``option`` and the entry."""
    if value is None:
        return ()
    entries = [value] if isinstance(value, (str, type)) else value
    if not isinstance(entries, (list, tuple, set, frozenset)):
        raise ValueError(
            f"`{option}={value!r}` is invalid: expected a class, an import path, or a list of them"
            " (e.g. [Block] or ['torch.nn.TransformerEncoderLayer'])."
        )
    classes = []
    for entry in entries:
        cls = import_path(entry, option) if isinstance(entry, str) else entry
        if not (isinstance(cls, type) and issubclass(cls, base)):
            named = class_path(cls) if isinstance(entry, type) else repr(entry)
            raise ValueError(
                f"`{option}` entry {named} is not a {class_path(base)} subclass. HINT: give the class itself or its"
                " full import path."
            )
        classes.append(cls)
    return tuple(dict.fromkeys(classes))


def class_path(cls: type) -> str:
    """The shortest import path of ``cls`` (what a YAML config names it by): ``torch.optim.SGD``, not
    ``torch.optim.sgd.SGD``, where a package above its module exports it."""
    parts = cls.__module__.split(".")
    for i in range(1, len(parts) + 1):
        module = sys.modules.get(".".join(parts[:i]))
        if module is not None and getattr(module, cls.__qualname__, None) is cls:
            return f"{module.__name__}.{cls.__qualname__}"
    return f"{cls.__module__}.{cls.__qualname__}"


# ---- option checks: every option of every public class is checked by one of these, before anything runs ----


CHECKPOINTING_ALLOWED = (
    "Allowed values: False or None (off), True (every unit but the root), a module class, an import path or a list"
    " of them (e.g. [Block] or ['my_model.Block']), or a callable fn(module) -> bool."
)


def _checkpointing_choice(value: object) -> bool | tuple[type[nn.Module], ...] | Callable[[nn.Module], bool]:
    """``activation_checkpointing`` held as False, True, a tuple of module classes, or a callable."""
    if value is None or isinstance(value, bool):
        return bool(value)
    if isinstance(value, (str, type, list, tuple, set, frozenset)):
        try:
            return class_list("activation_checkpointing", value, nn.Module) or False
        except ValueError as error:
            raise ValueError(f"{error} {CHECKPOINTING_ALLOWED}") from None
    if callable(value):
        return value
    raise ValueError(f"`activation_checkpointing={value!r}` is invalid. {CHECKPOINTING_ALLOWED}")


def _choice(option: str, value: object, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"`{option}={value!r}` is invalid. Allowed values: {', '.join(map(repr, allowed))}.")


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_option(option: str, value: object, ok: bool, expected: str) -> None:
    if not ok:
        raise ValueError(f"`{option}={value!r}` is invalid: expected {expected}.")


def check_int(option: str, value: object, minimum: int, note: str = "") -> None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= minimum
    check_option(option, value, ok, f"an integer >= {minimum}{note}")


def check_bool(option: str, value: object) -> None:
    check_option(option, value, isinstance(value, bool), "True or False")


def check_positive(option: str, value: object, expected: str = "a positive number") -> None:
    check_option(option, value, _is_number(value) and value > 0, expected)


def check_in_range(option: str, value: object, low: float, high: float) -> None:
    check_option(option, value, _is_number(value) and low <= value <= high, f"a number in [{low:g}, {high:g}]")


@dataclass(frozen=True)
class ShardLabConfig:
    stage: Stage = Stage.PARAMETERS
    """What is sharded at rest: 1 optimizer state, 2 + gradients, 3 + parameters (FSDP)."""

    unit_classes: tuple[type[nn.Module], ...] = ()
    """Module classes that each become a unit: classes, import paths (YAML) or a mix, held as classes. Empty:
    one unit per repeated block."""

    min_unit_params: int = 0
    """A module with fewer parameters than this is not made a unit; its parameters join the enclosing unit."""

    unit_bucket_params: int = 1_000_000
    """Default policy: consecutive blocks of one container with fewer parameters than this are merged into one
    unit (a bucket) of at least this many, so their collectives travel as one message each instead of paying a
    latency per block (1M parameters: 2-4 MB messages, past where a collective's fixed latency dominates its
    transfer); a container whose blocks together hold fewer makes no units (the enclosing unit keeps them). 0:
    one unit per block. Not applied to ``unit_classes`` (the user's word)."""

    reshard_after_forward: bool | int = True
    """Stage 3: free gathered parameters after forward (False = torch's SHARD_GRAD_OP: keep them for backward);
    an int k: keep them sharded over k consecutive ranks (k divides the shard group size), so the backward
    all-gather stays inside those k ranks (torch FSDP2's int, ZeRO++'s hpZ)."""

    activation_checkpointing: bool | tuple[type[nn.Module], ...] | Callable[[nn.Module], bool] | None = False
    """Recompute chosen modules' forward in backward instead of keeping what autograd saves inside them
    (torch's non-reentrant checkpoint, applied to each module's forward in place: its class and names stay).
    False or None: off. True: every unit but the root. Module classes, import paths (YAML) or a mix, held as
    classes: every module of those classes (as Lightning's FSDP takes ``activation_checkpointing_policy={Block}``).
    A callable ``fn(module) -> bool``: every module it accepts. Modules a Hugging Face model already checkpoints
    (``gradient_checkpointing_enable()``) are left to it, with a warning."""

    shard_group_size: int | str | None = None
    """Hybrid sharding: ranks split into consecutive groups of this size, each sharding the model (stage 1, 2
    or 3 inside the group) while the groups are replicas whose gradient shards are averaged across groups.
    'node': the devices of one node. None: the whole world shards the model (the default)."""

    accumulation: Accumulation = Accumulation.REDUCE
    """Gradient accumulation: 'reduce' every micro-batch into shards, or 'defer' to the last one."""

    find_unused_parameters: bool = True
    """Agree across ranks (one small all-reduce per optimizer step, of one int32 per parameter) on which
    parameters got no gradient on any rank, and leave those gradients None, as a single device and DDP do
    (the optimizer then skips them: no weight decay, no momentum). False (an explicit choice): skip the
    all-reduce; a parameter that got no gradient inside a unit that ran backward then receives a zero
    gradient, which AdamW still decays and moves by momentum."""

    broadcast_buffers: bool = True
    """Before each training and validation step of fit, give every rank rank 0's buffers (e.g. BatchNorm
    statistics), as DDP does before each forward."""

    gradient_clip_norm_type: float | str = 2.0
    """The norm Lightning's ``gradient_clip_val`` clips by: 2, 1, or ``inf`` (any p > 0), over all ranks' shards."""

    reduce_dtype: str | None = None
    """The dtype gradients travel in when reduce-scattered: 'fp32', 'bf16', 'fp16' or 'int8'. None: fp32 under
    mixed precision, else the parameters' dtype. 'bf16' and 'fp16' halve the traffic: each rank's gradient is
    rounded once, and the sum is taken in fp32 (it never rounds between ranks). 'int8': blocks of
    ``quant_block_size`` elements with one scale each (a quarter of fp32's bytes), summed in fp32, with error
    feedback: what a rank's rounding lost is added to its next gradient (kept in its checkpoints; 4 bytes per
    element of each flat parameter). Opt-in: they trade exactness for bytes (docs/slow_links.md)."""

    gather_dtype: str | None = None
    """Stage 3: 'int8' sends the weights' all-gathers as int8 blocks of ``quant_block_size`` elements, one scale
    each (a quarter of fp32's bytes, half of bf16's); every rank computes with the same dequantized weights, and
    the masters and the optimizer stay exact. None: the compute dtype, exact (docs/slow_links.md)."""

    quant_block_size: int = 2048
    """Elements per scale of the int8 blocks of ``gather_dtype`` and ``reduce_dtype`` ('int8')."""

    transport: str = "auto"
    """How all-gathers and reduce-scatters travel on gloo: 'builtin' (torch's collectives), 'pairwise'
    (direct chunk exchange with batch_isend_irecv), or 'auto': time both at setup, keep the faster."""

    ranks_per_device: int = 1
    """Ranks per device: >1 runs a world of several ranks on one CPU or one GPU (the single-box proxy)."""

    process_group_backend: str | None = None
    """'gloo' or 'nccl'; None chooses (gloo on CPU and for ranks sharing a GPU, NCCL otherwise)."""

    timeout_s: float = 1800.0
    """Process group timeout in seconds."""

    start_method: str = "popen"
    """How the ranks of one machine start, as Lightning's DDP takes it: 'popen' runs the script again for each rank
    (the default); 'spawn', 'fork' or 'forkserver' start them from this process (a notebook's kernel: 'fork'), and
    what fit leaves comes back to it: the metrics, the checkpoint callbacks' best path and score, the trainer's
    state and the module's whole weights (docs/notebooks.md)."""

    elementwise_optimizers: tuple[type[torch.optim.Optimizer], ...] = ()
    """Extra optimizer classes (classes, import paths or a mix, held as classes) whose update is elementwise,
    so a shard-local step is exact. A class not known (and not listed) is stepped whole on owner ranks, as those
    of ``whole_tensor_optimizers`` are: exact for any update, at two all-to-alls per step; listing it here steps
    its shards instead, with no exchange."""

    whole_tensor_optimizers: tuple[type[torch.optim.Optimizer], ...] = ()
    """Extra optimizer classes (classes, import paths or a mix, held as classes) whose update of a parameter
    reads the whole parameter (Muon and Adafactor are known already): each parameter they step has one owner
    rank, which receives its whole averaged gradient and runs the optimizer's own update on it."""

    state_dict_type: str = "sharded"
    """Checkpoints: 'sharded' (a directory in which every rank writes its own slices) or 'full' (one plain
    Lightning file, gathered on rank 0, loadable without this package). Loading reads either, at any
    world size and stage. 'dcp': torch Distributed Checkpoint directories, written in the layout FSDP2's
    ``get_state_dict`` gives (``fully_shard`` and Lightning's FSDP load them); with it, loading also accepts DCP
    directories, whose ``.metadata`` is a pickle: only then is one read (docs/checkpoints.md)."""

    offload: str = "none"
    """Where master shards and optimizer state live between uses: 'none' (beside the compute copy), 'cpu'
    (pinned host memory on a GPU run; the optimizer steps on the CPU), 'disk' (memory-mapped files under
    ``offload_dir``, stepped one flat parameter at a time), or 'auto': the tier below the device ('cpu' on a
    GPU, 'disk' on a CPU run). See docs/design.md, offload."""

    offload_dir: str | None = None
    """``offload='disk'``: the directory that holds the files (None: the system's temporary directory)."""

    async_save: bool = False
    """Sharded checkpoints are written on a background thread from host copies; the save concludes (COMPLETE
    written, the directory moved into place) at the next save, load or the end of fit (checkpoint/async_save.py)."""

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "stage", Stage(self.stage))
        except ValueError:
            _choice("stage", self.stage, (1, 2, 3))
        try:
            object.__setattr__(self, "accumulation", Accumulation(self.accumulation))
        except ValueError:
            _choice("accumulation", self.accumulation, tuple(a.value for a in Accumulation))
        _choice("process_group_backend", self.process_group_backend, (None, "gloo", "nccl"))
        _choice("state_dict_type", self.state_dict_type, ("sharded", "full", "dcp"))
        _choice("reduce_dtype", self.reduce_dtype, (None, *REDUCE_DTYPES))
        _choice("gather_dtype", self.gather_dtype, (None, "int8"))
        check_int("quant_block_size", self.quant_block_size, 1)
        if self.gather_dtype is not None and self.stage is not Stage.PARAMETERS:
            raise ValueError(
                f"`gather_dtype={self.gather_dtype!r}` packs the all-gathers of stage 3, where the weights are"
                f" gathered for each use; at stage {int(self.stage)} they are resident and the gather after a step"
                " refreshes them for good. HINT: use stage=3, or leave gather_dtype at None."
            )
        _choice("transport", self.transport, ("auto", "builtin", "pairwise"))
        _choice("start_method", self.start_method, START_METHODS)
        _choice("offload", self.offload, OFFLOADS)
        if self.offload_dir is not None and not isinstance(self.offload_dir, str):
            check_option("offload_dir", self.offload_dir, False, "a directory path (a string) or None")
        check_int("min_unit_params", self.min_unit_params, 0)
        check_int("unit_bucket_params", self.unit_bucket_params, 0)
        check_int("ranks_per_device", self.ranks_per_device, 1)
        norm = self.gradient_clip_norm_type
        if isinstance(norm, str):
            try:
                norm = float(norm)
            except ValueError:
                pass
        if isinstance(norm, bool) or not isinstance(norm, (int, float)) or not norm > 0:
            raise ValueError(
                f"`gradient_clip_norm_type={self.gradient_clip_norm_type!r}` is invalid:"
                " expected 2, 1, 'inf' or any p > 0."
            )
        object.__setattr__(self, "gradient_clip_norm_type", float(norm))
        check_positive("timeout_s", self.timeout_s, "a positive number of seconds")
        for option in ("find_unused_parameters", "broadcast_buffers", "async_save"):
            check_bool(option, getattr(self, option))
        if self.async_save and self.state_dict_type == "dcp":
            raise ValueError(
                "`async_save=True` writes sharded checkpoints in the background, not state_dict_type='dcp' directories."
                " HINT: use state_dict_type='sharded' with async_save, or async_save=False with 'dcp'."
            )
        if self.async_save and self.state_dict_type == "full":
            raise ValueError(
                "`async_save=True` writes sharded checkpoints in the background, not state_dict_type='full' files."
                " HINT: use state_dict_type='sharded' (the default), and `shardlab consolidate` for one file later."
            )
        self._check_groups()
        object.__setattr__(self, "activation_checkpointing", _checkpointing_choice(self.activation_checkpointing))
        object.__setattr__(self, "unit_classes", class_list("unit_classes", self.unit_classes, nn.Module))
        optimizers = class_list("elementwise_optimizers", self.elementwise_optimizers, torch.optim.Optimizer)
        object.__setattr__(self, "elementwise_optimizers", optimizers)
        whole = class_list("whole_tensor_optimizers", self.whole_tensor_optimizers, torch.optim.Optimizer)
        object.__setattr__(self, "whole_tensor_optimizers", whole)
        both = [c.__name__ for c in optimizers if c in whole]
        if both:
            raise ValueError(
                f"{', '.join(both)} is listed in both elementwise_optimizers and whole_tensor_optimizers."
                " HINT: list each optimizer class in one of them."
            )

    def _check_groups(self) -> None:
        k, g = self.reshard_after_forward, self.shard_group_size
        if not isinstance(k, bool):
            check_int("reshard_after_forward", k, 2, " (a reshard group size), or True / False")
            if self.stage is not Stage.PARAMETERS:
                raise ValueError(
                    f"`reshard_after_forward={k}` applies to stage 3 (parameters sharded), not stage"
                    f" {int(self.stage)}. HINT: use stage=3, or leave reshard_after_forward at True."
                )
        if g is not None and g != "node":
            check_int("shard_group_size", g, 1, ", 'node' or None")

    def offload_tier(self, device: torch.device) -> str:
        """The offload tier this run uses on ``device``: 'none', 'cpu' or 'disk' ('auto' resolved). Raises
        ``ValueError`` naming the option and the fix for 'cpu' on a CPU run (every rank, before any collective)."""
        if self.offload == "auto":
            return "disk" if device.type == "cpu" else "cpu"
        if self.offload == "cpu" and device.type == "cpu":
            raise ValueError(
                "`offload='cpu'` moves state from the accelerator to host memory, but this run trains on the CPU:"
                " host memory is the device. HINT: use offload='disk' (files under offload_dir) to free host"
                " memory, or train on a GPU."
            )
        return self.offload

    def group_sizes(self, world_size: int, per_node: int) -> tuple[int, int | None]:
        """(shard group size, reshard group size or None) for this world; ``per_node``: ranks on one node.
        Raises ``ValueError`` naming the option and the fix unless the sizes tile the world (before any
        collective: every rank computes the same)."""
        g = per_node if self.shard_group_size == "node" else (self.shard_group_size or world_size)
        if g < 1 or world_size % g:
            raise ValueError(
                f"`shard_group_size={self.shard_group_size!r}` ({g} ranks) must divide the world size {world_size}."
                f" HINT: choose a divisor of {world_size} (e.g. the devices per node), or None to shard over every"
                " rank."
            )
        k = self.reshard_after_forward
        if isinstance(k, bool) or k == g:
            return g, None
        if k > g or g % k:
            raise ValueError(
                f"`reshard_after_forward={k}` must divide the shard group size {g}. HINT: use a divisor of {g}"
                " (e.g. the GPUs of one node), or True."
            )
        return g, k


@dataclass(frozen=True)
class PrecisionPolicy:
    """How the flat parameters are typed; set from the Trainer's ``precision`` (see common/precision.py)."""

    compute_dtype: torch.dtype | None = None
    """What floating parameters are gathered and computed in; None: their own dtype (fp32 training)."""

    reduce_dtype: torch.dtype | None = None
    """What gradients are reduce-scattered in; None: the master dtype (fp32 under mixed precision)."""

    def compute_for(self, dtype: torch.dtype) -> torch.dtype:
        return self.compute_dtype if self.compute_dtype is not None and dtype.is_floating_point else dtype
