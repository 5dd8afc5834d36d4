"""When a hook's reads are served, and which tensors stand for gradients (``ShardReads``, one per sharded model).

sharding/shard_reads.py says how one read is served; this is the window around them: reads are served while the
strategy holds them open (during fit; for Fabric, after setup), each gradient shown to the optimizer is the
parameter's ``.grad`` as a stand-in until the next backward, what the user did to it (set to None, replaced, changed
in place) reaches the master views, and a read some ranks made alone is named when the ranks part (``explain``).
"""

from __future__ import annotations

import warnings
import weakref

import torch
from torch import Tensor, nn

from lightning_shardlab.comm import collectives
from lightning_shardlab.comm.collectives import Comm
from lightning_shardlab.comm.mismatch import Fingerprint, by_call
from lightning_shardlab.sharding.flat_param import FlatParam
from lightning_shardlab.sharding.placeholders import ShardedAtRest, at_rest_error
from lightning_shardlab.sharding.shard_reads import (
    LABEL,
    WEIGHTS,
    ShardRead,
    Source,
    gather_whole,
    parts_of,
    source_of,
)

ACCUMULATING = (
    "a gradient was read before the last micro-batch of a gradient accumulation: shardlab reduces each micro-batch"
    " into the ranks' shards as it goes (accumulation='reduce'), so `.grad` there is the ranks' average summed so"
    " far, where DDP shows each rank its own unsynchronised sum; from the last micro-batch on (on_before_optimizer_step"
    " included) both are the same average. HINT: ShardLabStrategy(accumulation='defer') keeps each rank's own"
    " gradients until the last micro-batch, as DDP does."
)


class ShardReads:
    """The stand-ins of one sharded model: the gradients shown after backward, the weights at rest (stage 3), and
    whether reads are served now (the window: ``open``, ``close``)."""

    def __init__(self, comm: Comm) -> None:
        self.comm = comm  # the shard group: every piece of a flat parameter is on one of its ranks
        self.serving = False
        self.shown: dict[int, tuple[nn.Parameter, ShardRead, FlatParam, int]] = {}  # id(param) -> its gradient
        self.accumulating: list[tuple[nn.Parameter, ShardRead]] = []  # before an accumulation's last micro-batch
        self._said: set[str] = set()
        self._me = weakref.ref(self)

    def say_once(self, note: str) -> None:
        if note not in self._said:
            self._said.add(note)
            if self.comm.rank == 0:
                warnings.warn(note, stacklevel=4)

    def register_weights(self, flat_params: list[FlatParam]) -> None:
        """Let the stage-3 parameters of ``flat_params`` be read at rest (their values: this rank's master slice)."""
        for fp in flat_params:
            if not fp.resident_full:  # stage 3 (stubs at rest, on one rank too)
                for i, param in enumerate(fp.params):
                    WEIGHTS[id(param)] = (weakref.ref(param), self._me, weakref.ref(fp), i)
                    weakref.finalize(param, WEIGHTS.pop, id(param), None)

    def open(self) -> None:
        self.serving = True

    def close(self, last_call: bool) -> None:
        """Stop serving reads. ``last_call`` (a clean end, every rank here): first one verified collective, which a
        read issued on some ranks only meets (and both raise), so no rank leaves a peer waiting in a read. The
        gradients' stand-ins leave ``.grad`` (None after fit): whatever reads them next (``module.cpu()``, a
        strategy the module is handed to) reads without its peers. Their values stay in the master views."""
        if last_call and self.serving:
            collectives.barrier(self.comm, label="end of hook reads")
        self.serving = False
        for param, grad in [*((p, g) for p, g, _, _ in self.shown.values()), *self.accumulating]:
            if param.grad is grad:
                param.grad = None
        self.shown.clear()
        self.accumulating.clear()

    def check_open(self, tensor: Tensor, source: Source, op: str) -> None:
        if self.serving:
            return
        if isinstance(tensor, ShardedAtRest):
            raise at_rest_error(tensor, op)
        raise RuntimeError(
            f"[rank {source.world_rank}] the {source.what} of {source.name!r} was read ({op}) outside training: its"
            " values are spread over the ranks' shards, and a read there is a collective every rank must join, which"
            " is only served during fit (for Fabric: after setup). HINT: read it inside a hook that every rank runs"
            " (on_before_optimizer_step, on_train_batch_end, ...), or call optimizer.zero_grad() before reading."
        )

    # ---- gradients (sharding/gradients.py shows them, these stand for them) ----

    def show_grads(self, fp: FlatParam) -> None:
        """After ``gradients.show``: each parameter whose master view holds a gradient gets a stand-in as ``.grad``,
        while reads are served (a loop of one's own on the engine opens them with ``sharded.reads.open()``; a module
        handed to another strategy after fit keeps running its hooks, and keeps ``.grad`` None)."""
        if not self.serving:
            return
        for i, (param, master) in enumerate(zip(fp.params, fp.master_params)):
            if master.grad is None or not param.requires_grad:
                continue
            with torch._C.DisableTorchFunctionSubclass():
                shape, dtype, device = param.shape, param.dtype, param.device
            grad = ShardRead.make(self._grad_source(fp, i), shape, dtype, device)
            param.grad = grad
            self.shown[id(param)] = (param, grad, fp, i)

    def _grad_source(self, fp: FlatParam, i: int) -> Source:
        slot = fp.layout.slots[i]
        master = fp.master_params[i]
        lo, hi = fp.layout.slot_in_shard(slot, fp.rank)

        def piece() -> Tensor:
            if master.grad is not None:
                return master.grad
            if fp.grad_shard is not None:  # mixed precision, after the step let go of the fp32 copy
                return fp.grad_shard[lo:hi]
            raise RuntimeError(
                f"[rank {fp.world_rank}] the gradient of {slot.name!r} was read after it was released. HINT: read"
                " gradients between backward and the optimizer's zero_grad()."
            )

        return Source(slot.name, "gradient", piece, parts_of(fp, i), fp.rank, fp.world_rank, self.comm, self)

    def show_accumulating_grads(self, fp: FlatParam) -> None:
        """Before the last micro-batch of an accumulation (``accumulation='reduce'``): each micro-batch was reduced
        into the grad shard as it went, so what a hook can read is the ranks' average summed so far, not the rank's
        own sum that DDP shows there (its all-reduce waits for the last micro-batch). Shown as ``.grad``, with a
        note said once when it is read; never a silent ``None``."""
        if not self.serving or fp.grad_shard is None:
            return
        for i, param in enumerate(fp.params):
            if not param.requires_grad or param.grad is not None:
                continue
            slot = fp.layout.slots[i]
            lo, hi = fp.layout.slot_in_shard(slot, fp.rank)
            shard = fp.grad_shard

            def piece(shard: Tensor = shard, lo: int = lo, hi: int = hi) -> Tensor:
                return shard[lo:hi]

            source = Source(
                slot.name,
                "gradient",
                piece,
                parts_of(fp, i),
                fp.rank,
                fp.world_rank,
                self.comm,
                self,
                note=ACCUMULATING,
            )
            with torch._C.DisableTorchFunctionSubclass():
                shape, dtype, device = param.shape, param.dtype, param.device
            grad = ShardRead.make(source, shape, dtype, device)
            param.grad = grad
            self.accumulating.append((param, grad))

    def settle(self) -> None:
        """Before a backward or an optimizer step: what the user did to a shown ``.grad`` reaches the master views.
        Set to None (``module.zero_grad()``): the master view lets go of it too, as DDP's optimizer then skips the
        parameter. Replaced by a tensor of the whole's shape (``p.grad = p.grad.clamp(-1, 1)``, or a plain tensor):
        its values are taken into the master view, and the stand-in, which reads them, is ``.grad`` again."""
        for key, (param, grad, fp, i) in list(self.shown.items()):
            current = param.grad
            if current is grad:
                continue
            master = fp.master_params[i]
            if current is None or master.grad is None:
                master.grad = None
                del self.shown[key]
                continue
            replaced = source_of(current)
            with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
                start, n = grad._source.span
                if replaced is not None and replaced.parts == grad._source.parts:
                    master.grad.copy_(replaced.piece())
                else:
                    whole = current if replaced is None else gather_whole(replaced, tuple(grad.shape), "assigned")
                    master.grad.copy_(whole.detach().reshape(-1)[start : start + n])
            param.grad = grad

    def clear_grads(self) -> None:
        """Before backward: autograd accumulates into ``.grad`` and the reduction reads it, so no stand-in may stay
        there (the values stay in the master views, where ``gradients.accumulate`` takes them from)."""
        self.settle()
        for param, grad in [*((p, g) for p, g, _, _ in self.shown.values()), *self.accumulating]:
            if param.grad is grad:
                param.grad = None
        self.shown.clear()
        self.accumulating.clear()


def explain(each: dict[int, Fingerprint | None]) -> str | None:
    """The hint for a mismatch where some ranks issued a read: it ran on some ranks only."""
    readers = [(fp, ranks) for fp, ranks in by_call(each) if fp is not None and str(fp[2]).startswith(f"{LABEL} ")]
    if not readers:
        return None
    fp, ranks = readers[0]
    return (
        f"rank {', '.join(map(str, ranks))} issued {fp[2]!r}, a read on some ranks only: a gradient or stage-3 weight"
        " read in a hook is a collective (its values are spread over the ranks' shards), so every rank must make it."
        " Read it on every rank and print or log on one (`v = w.norm()` then `if self.global_rank == 0: print(v)`),"
        " or log with self.log(..., rank_zero_only=True) after computing the value on every rank"
    )
