"""``ShardedModel``: the units of one sharded module and the rules that drive them through a step (``shard_model``
in sharding/build.py makes one).

The module keeps its class, its parameter names and its parameter objects (one identity per parameter, for
the whole run: the module's, the optimizer's and every callback's); only each parameter's ``.data`` changes,
between a stub (stage 3 at rest: the real shape, no values) and a view of the gathered full buffer (computing,
or stages 1-2). The returned ``ShardedModel`` is the handle that holds the units and decides, on each hook
event, when to gather, reduce and free.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from lightning_shardlab.comm import collectives
from lightning_shardlab.comm.collectives import Comm
from lightning_shardlab.comm.labels import phase
from lightning_shardlab.comm.mesh import Mesh
from lightning_shardlab.core.config import PrecisionPolicy, ShardLabConfig, Stage
from lightning_shardlab.sharding import divergent_units, gradients, hooks, read_window
from lightning_shardlab.sharding.flat_param import FlatParam, FlatParamLayout
from lightning_shardlab.sharding.unit import TrainingState, Unit, UnitState
from lightning_shardlab.sharding.unused_params import UsageAgreement

if TYPE_CHECKING:
    from lightning_shardlab.sharding.averages import Averages
    from lightning_shardlab.sharding.offload_tier import OffloadTier

MAX_REDUCTIONS_IN_FLIGHT = 1  # more overlap more, but each holds its unit's whole flat gradient alive


class ShardedModel:
    """The units of one sharded module and the rules that drive them through a step."""

    def __init__(
        self, module: nn.Module, units: list[Unit], config: ShardLabConfig, mesh: Mesh, policy: PrecisionPolicy
    ) -> None:
        self.module = module
        self.units = units  # root first, then in named_modules() order
        self.config = config
        self.mesh = mesh
        self.comm = mesh.world  # agreements, buffers, checkpoints' plans; the flat parameters move in mesh.shard
        self.policy = policy
        self.averages: Averages | None = None  # the averaged weights, kept while ShardLabEMA runs
        self.offload: OffloadTier | None = None  # where masters and optimizer state live when offloaded (offload/)
        # called with (unit, flat param, flat grad) for each reduction, before the grads are averaged
        self.grad_observers: list[Callable[[Unit, FlatParam, Tensor], None]] = []
        # the modules (names in module.named_modules()) whose forward runs under activation checkpointing
        # (sharding/checkpointing.py; the ``activation_checkpointing`` option), in the model's order
        self.checkpointed: list[str] = []
        self._sync = True  # reduce gradients in this backward (False inside no_sync())
        self._show = True  # show reduced gradients to the optimizer (False inside accumulating())
        self._root_held = False  # the strategy keeps the root gathered for a whole step
        self._end_of_backward = hooks.EndOfBackward(self._finish_backward)
        self._warned_unused: set[str] = set()
        self._in_flight: list[Unit] = []  # units whose reduce-scatters are launched, oldest first
        self._order: list[Unit] = []  # non-root units in the order their forward ran, this step
        self._last_order: list[Unit] = []  # ... and last step: what forward prefetching follows
        # benchmarks/ only: leave the refresh after an optimizer step in flight until each unit's next
        # forward (weights read between steps are then stale); measures what refresh()'s wait costs
        self._overlap_refresh = False
        self._by_id: dict[int, nn.Parameter] | None = None  # id(original param) -> master view
        # what hooks read of gradients and stage-3 weights, served from the shards (sharding/shard_reads.py)
        self.reads = read_window.ShardReads(mesh.shard)
        self.reads.register_weights(self.flat_params)

    @property
    def root(self) -> Unit:
        return self.units[0]

    @property
    def flat_params(self) -> list[FlatParam]:
        return [fp for unit in self.units for fp in unit.flat_params]

    @property
    def forward_order(self) -> list[Unit]:
        """The root, then the units in the order their forward ran in the latest pass (registration order
        before any; units that did not run last). What the budget's predictions follow."""
        ran = self._order or self._last_order
        return [self.root, *ran, *(u for u in self.units[1:] if u not in ran)]

    def master_params_by_id(self) -> dict[int, tuple[str, nn.Parameter, FlatParam]]:
        """id(original param) -> (name, master view, its flat param)."""
        out = {}
        for fp in self.flat_params:
            for slot, param, master in zip(fp.layout.slots, fp.params, fp.master_params):
                out[id(param)] = (slot.name, master, fp)
        return out

    def masters(self, params: Iterable[Tensor]) -> list[nn.Parameter]:
        """The master views of ``params`` (original params; a master view stands for itself)."""
        by_id = self.masters_by_id()
        return [by_id.get(id(p), p) for p in params]  # type: ignore[misc]

    def masters_by_id(self) -> dict[int, nn.Parameter]:
        """id(original param) -> its master view."""
        if self._by_id is None:
            self._by_id = {id(p): m for fp in self.flat_params for p, m in zip(fp.params, fp.master_params)}
        return self._by_id

    def flat_params_of(self, params: Iterable[Tensor]) -> set[FlatParam]:
        """The flat parameters holding ``params`` (original params): what a step over them changes."""
        owner = {id(p): fp for fp in self.flat_params for p in fp.params}
        return {owner[id(p)] for p in params if id(p) in owner}

    def trained_layouts(self) -> list[FlatParamLayout]:
        """Each flat parameter's layout, marked trainable when it trains now (a parameter requires grad) or did (it
        holds a gradient shard): what gradient and optimizer-state bytes follow once training code froze or
        unfroze parameters mid-run (the layouts themselves keep the flags at setup, which grouped them)."""
        out = []
        for fp in self.flat_params:
            trained = fp.grad_shard is not None or any(p.requires_grad for p in fp.params)
            out.append(
                fp.layout
                if trained == fp.layout.requires_grad
                else dataclasses.replace(fp.layout, requires_grad=trained)
            )
        return out

    def sync_names(self) -> None:
        """Name each parameter as the module registers it now (``torch.nn.utils.prune`` renames ``weight`` to
        ``weight_orig``; ``prune.remove`` names it back): what state dicts and checkpoints are keyed by. A
        parameter the module no longer registers (replaced by a parametrization) keeps its last names."""
        names: dict[int, tuple[str, ...]] = {}
        for name, param in self.module.named_parameters(remove_duplicate=False):
            names[id(param)] = (*names.get(id(param), ()), name)
        for fp in self.flat_params:
            slots = tuple(
                dataclasses.replace(slot, fqns=names[id(p)]) if names.get(id(p), slot.fqns) != slot.fqns else slot
                for slot, p in zip(fp.layout.slots, fp.params)
            )
            if slots != fp.layout.slots:
                fp.layout = dataclasses.replace(fp.layout, slots=slots)

    def adopt_replaced(self) -> None:
        """Take into the shards every parameter ``.data`` that user code replaced (sharding/flat_param.py)."""
        for fp in self.flat_params:
            fp.adopt_replaced()

    # ---- the events sharding/hooks.py routes here ----

    def post_forward(self, unit: Unit) -> None:
        """Stage 3: free the unit after forward, unless backward needs it next; with
        ``reshard_after_forward=k`` keep its group shards for backward (sharding/unit.py)."""
        if self.comm.clock is not None:
            self.comm.clock.leave(unit.name)
        if unit.is_root:
            if not torch.is_grad_enabled() and not self._root_held:
                unit.reshard()
            return
        if not torch.is_grad_enabled():
            unit.reshard()
            return
        # the unit that ran forward last (last step) is the first backward needs: keep it gathered
        last = self._last_order[-1] if self._last_order else None
        if self.config.reshard_after_forward and unit is not last:
            unit.reshard(regroup=True)

    def pre_forward(self, unit: Unit) -> None:
        """Gather ``unit`` (its prefetch may be in flight already) and prefetch the unit that ran after it
        last step; remember this step's order for backward."""
        if unit.state is UnitState.SUMMONED:
            if torch.is_grad_enabled():
                raise RuntimeError(
                    f"[rank {self.comm.rank}] unit {unit.name!r} ran forward with gradients enabled inside"
                    " gathered_params(); its full copies are not trained. HINT: run it under torch.no_grad(), or"
                    " after the `with` block."
                )
            return
        if unit.is_root and not self._root_held:
            self._begin_pass()  # a loop of the user's own (Fabric, plain torch): each root forward starts one
        unit.unshard()
        if not unit.is_root:
            self._order.append(unit)
            self._prefetch_after(unit, self._last_order)
        if self.comm.clock is not None:  # the unit computes from here to its post-forward
            self.comm.clock.enter("forward", unit.name)

    def pre_backward(self, unit: Unit) -> None:
        self._end_of_backward.queue()
        with phase("pre_backward", unit.name):
            unit.unshard()
            if not unit.is_root:
                self._prefetch_after(unit, self._order[::-1])  # backward runs the forward order backwards
        unit.training = TrainingState.BACKWARD
        if self.comm.clock is not None:  # the unit computes its backward (recomputation included) until post-backward
            self.comm.clock.enter("backward", unit.name)

    def _prefetch_after(self, unit: Unit, order: list[Unit]) -> None:
        if self.config.stage is not Stage.PARAMETERS or unit not in order:
            return
        i = order.index(unit)
        if i + 1 < len(order):
            order[i + 1].prefetch()

    def wait_gathers(self) -> None:
        """Wait for every all-gather in flight (before reading or overwriting full buffers or shards)."""
        for unit in self.units:
            unit.wait_gathers()

    def post_backward(self, unit: Unit) -> None:
        unit.awaiting_post_backward = 0
        if unit.training is not TrainingState.BACKWARD:
            return
        if self.comm.clock is not None:
            self.comm.clock.leave(unit.name)
        unit.training = TrainingState.IDLE  # post-backward moves it on: GRADS_PENDING, then REDUCING
        with phase("post_backward", unit.name):
            if unit.grad_flat_params:
                unit.collect_usage()
                if self._sync and self.config.stage >= Stage.GRADIENTS:
                    self._reduce(unit)
            if not (unit.is_root and self._root_held):
                unit.reshard()

    def _reduce(self, unit: Unit) -> None:
        """Launch ``unit``'s reduce-scatters; to bound memory, first wait for all but the newest in flight:
        each keeps a flat gradient alive (backward goes on computing while the newest reduces). Stage 1
        holds every full gradient until the end of backward anyway, so there all may fly at once."""
        limit = len(self.units) if self.config.stage is Stage.OPTIMIZER else MAX_REDUCTIONS_IN_FLIGHT
        while len(self._in_flight) >= limit:
            self._in_flight.pop(0).wait_reductions(finish=False)  # hybrid: its all-reduces across groups fly on
        for fp, flat in unit.reduce_grads(async_op=True):
            for observe in self.grad_observers:  # e.g. the vital signs: this rank's own gradient norm
                observe(unit, fp, flat)
        self._in_flight.append(unit)

    def _finish_backward(self) -> None:
        """End of backward: 1. finish units with no post-backward  2. reduce the rest, and launch the agreement
        on which parameters were used (sharding/unused_params.py)  3. wait, attach grads."""
        for unit in reversed(self.units):
            if unit.training is TrainingState.BACKWARD:
                self.post_backward(unit)
        if self._sync:
            pending = [u for u in self.units if u.training in (TrainingState.GRADS_PENDING, TrainingState.REDUCING)]
            for unit in reversed(pending):
                if unit.training is TrainingState.GRADS_PENDING:
                    self._reduce(unit)
            usage = (
                UsageAgreement.launch(pending, self.comm, self.config.find_unused_parameters, self._warned_unused)
                if self._show
                else None
            )  # travels with the reductions
            self._in_flight.clear()
            for unit in pending:
                unit.wait_reductions()
            if usage is not None:
                for unit, used in zip(pending, usage.result()):
                    unit.show_grads(used)
                    for fp in unit.flat_params:  # each shown gradient is the parameter's .grad, as under DDP
                        self.reads.show_grads(fp)
            else:
                for unit in pending:
                    unit.end_reduction()
                    for fp in unit.flat_params:  # before the last micro-batch: the average so far, with a note
                        self.reads.show_accumulating_grads(fp)
        for unit in self.units:
            if not (unit.is_root and self._root_held):
                unit.reshard()

    # ---- what the strategy (or a plain training loop) calls ----

    @contextmanager
    def step(self, keep_root_gathered: bool) -> Iterator[None]:
        """Keep the root unit gathered for one step (its parameters are used anywhere in the step), and
        start gathering the unit that ran first last step."""
        self._begin_pass()
        self.root.unshard()
        self._root_held = True
        try:
            yield
        finally:
            self._root_held = False
            if not keep_root_gathered:
                self.root.reshard()

    def _begin_pass(self) -> None:
        """A new forward pass: last pass's unit order becomes the order prefetching follows; its first unit's
        gather starts now (stage 3)."""
        if self.comm.clock is not None:
            self.comm.clock.phase("forward")
        self._last_order, self._order = self._order or self._last_order, []
        for unit in self.units:  # a pass that raised half-way leaves no count behind
            unit.forwarded = 0
        if self._last_order and self.config.stage is Stage.PARAMETERS:
            self._last_order[0].prefetch()

    def verify_collectives(self) -> None:
        """From now on every collective of this model's Comms (each group of its mesh) is checked on every rank
        before its data is used (comm/verify.py); a mismatch at a unit's collective names the unit and the fix.
        Collective (every rank)."""
        k = self.mesh.reshard.world_size
        limit = max(
            (
                max(fp.layout.shard_numel, fp.layout.padded_numel // k)
                * max(d.itemsize for d in (fp.compute_dtype, fp.reduce_dtype, fp.master.dtype))
                for fp in self.flat_params
            ),
            default=0,
        )  # bytes: the largest shard (or group shard) any call may send
        limit = max(limit, collectives.MIN_LIMIT)
        names = [fp.layout.name for fp in self.flat_params]
        units = {fp.layout.name: unit.module_path for unit in self.units for fp in unit.flat_params}
        for comm in self.mesh.comms():
            headers = collectives.enable_verification(comm, limit, builtin=self.config.transport == "builtin")
            if headers is None:
                continue
            headers.know(*names, *(f"{what} {n}" for n in names for what in ("state_dict", "optimizer state")))
            headers.explain = functools.partial(
                _explain, functools.partial(divergent_units.explain, self.module, units, bool(self.config.unit_classes))
            )
        for comm in self.mesh.comms():  # NCCL's host sides (comm/host_side.py): small host tensors, on the wire
            if comm.host is not None:
                collectives.enable_verification(comm.host)

    def broadcast_buffers(self) -> None:
        """Give every rank rank 0's buffers: one broadcast per buffer dtype (DDP's broadcast_buffers)."""
        broadcast_buffers(self.module, self.comm, label="buffers")

    def prepare_backward(self, loss: Tensor) -> None:
        """Announce the root's pre-backward when backward starts from ``loss``. The gradients' stand-ins leave the
        parameters' ``.grad`` first: autograd accumulates into it, and the reduction reads it."""
        self.reads.clear_grads()
        if self.comm.clock is not None:
            self.comm.clock.phase("backward")
        hooks.hook_pre_backward(self, self.root, loss)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside keep full gradients instead of reducing them (deferred accumulation)."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    @contextmanager
    def accumulating(self) -> Iterator[None]:
        """Backward passes inside reduce into the grad shards but do not show them to the optimizer yet:
        no optimizer step follows (a micro-batch that does not end a step)."""
        previous, self._show = self._show, False
        try:
            yield
        finally:
            self._show = previous

    def skip_step(self) -> None:
        """The optimizer step is skipped (fp16 loss-scale overflow): drop this step's gradients, as a step would."""
        for fp in self.flat_params:
            gradients.release(fp)

    def after_optimizer_step(self, stepped: set[FlatParam], params: set[int] | None = None) -> None:
        """Bring the compute copies up to date with the master shards an optimizer just updated (``params``:
        the ids of the parameters it stepped, whose fp32 gradients are released; None: all of ``stepped``)."""
        self.wait_gathers()  # nothing may still be sending a shard the step changed
        for unit in self.units:
            if unit.state in (UnitState.PREFETCHED, UnitState.REGROUPED):  # gathered before the step: stale now
                unit.reshard()
        for fp in stepped:
            gradients.release(fp, params)
        self.refresh(stepped)
        if not self._root_held:
            self.root.reshard()

    def refresh(self, changed: set[FlatParam]) -> None:
        """After the master shards of ``changed`` changed (an optimizer step, a load, a writeback): refresh
        their compute shards, re-gather the full buffers that are resident (stages 1-2) or gathered now,
        and wait, so that weights are current on every rank whenever user code can run next (a callback
        in ``on_train_batch_end`` reads them). The all-gathers of all units travel together."""
        for fp in changed:
            fp.shard_from_master()
        for unit in self.units:
            unit.launch_refresh(changed)
        if self._overlap_refresh:  # benchmarks only: what waiting here costs
            self.root.wait_gathers()
        else:
            self.wait_gathers()
        for fp in changed:
            if fp.aliases:  # tensors user code gave a parameter as .data follow it (FlatParam.mirror_aliases)
                fp.mirror_aliases()

    def gather_full(self, fp: FlatParam, shard: Tensor | None = None) -> Tensor:
        """Collective: the full values of ``fp`` in master precision (1-D, padded_numel), on every rank;
        of ``shard`` (1-D, S, e.g. its average) in place of the master shard if given."""
        self.wait_gathers()
        shard = fp.master if shard is None else shard
        if shard is fp.shard and (fp.resident_full or fp.layout.world_size == 1):
            return fp.full
        shard = shard.to(self.mesh.shard.device)  # a master offloaded to host memory travels to the device first
        out = torch.empty(fp.layout.padded_numel, dtype=shard.dtype, device=shard.device)
        collectives.all_gather(out, shard, self.mesh.shard, label=f"state_dict {fp.layout.name}")
        return out


def _explain(units: Callable[[dict], str | None], each: dict) -> str | None:
    """A read made on some ranks only (sharding/shard_reads.py), else a unit that ran on some ranks only."""
    return read_window.explain(each) or units(each)


def broadcast_buffers(module: nn.Module, comm: Comm, label: str) -> None:
    """Coalesced: the buffers of each dtype travel as one flat tensor."""
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for buf in module.buffers():
        by_dtype.setdefault(buf.dtype, []).append(buf)
    with torch.no_grad():
        for dtype, bufs in by_dtype.items():
            flat = torch.cat([b.reshape(-1) for b in bufs]).to(comm.device)
            collectives.broadcast(flat, comm, src=0, label=f"{label} {str(dtype).removeprefix('torch.')}")
            for buf, value in zip(bufs, flat.split([b.numel() for b in bufs])):
                buf.copy_(value.view_as(buf))
