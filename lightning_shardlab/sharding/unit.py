"""One unit's state machines: where its parameters are, and where its gradients are (``Unit``).

A unit owns one flat parameter per (dtype, requires_grad at setup) group of its parameters. ``unshard``
all-gathers each (inside the shard group) and gives the original params their unsharded views as data;
``reshard`` gives them their stubs (sharding/placeholders.py) and frees the full buffers (keeping a 1/k slice
for backward with ``reshard_after_forward=k``). ``reduce_grads`` turns the original params' gradients into this rank's
averaged grad shard: a reduce-scatter inside the shard group, then, when shard groups are replicas (hybrid
sharding, comm/mesh.py), an all-reduce of that shard across them. Tensor names: [Note: shardlab tensors] in
sharding/flat_param.py.
"""

from __future__ import annotations

from enum import Enum

import torch
from torch import Tensor, nn

from lightning_shardlab.comm import collectives, packed_collectives
from lightning_shardlab.comm.collectives import Pending
from lightning_shardlab.comm.mesh import Mesh
from lightning_shardlab.sharding import gradients
from lightning_shardlab.sharding.flat_param import FlatParam, storage_is_allocated
from lightning_shardlab.sharding.reduce_sample import ReduceSample


class UnitState(Enum):
    """Where a unit's parameters are: what its module holds, and whether the full buffers hold values."""

    SHARDED = "sharded"  # the params hold stubs (stage 3 at rest); full buffers freed or in flight
    REGROUPED = "regrouped"  # stubs, full buffers freed, group shards kept for backward (reshard_after_forward=k)
    PREFETCHED = "prefetched"  # still stubs, but the full buffers hold gathered values, ready to use
    UNSHARDED = "unsharded"  # the params hold their unsharded views of the full buffers
    SUMMONED = "summoned"  # the params hold full master-precision copies for the user (gathered.py)


class TrainingState(Enum):
    """Where a unit is in backward and in the reduction of its gradients."""

    IDLE = "idle"  # no gradients since the last reduction
    BACKWARD = "backward"  # between this unit's pre-backward and post-backward
    GRADS_PENDING = "grads pending"  # gradients collected (accumulating across micro-batches), not reduced yet
    REDUCING = "reducing"  # reduce-scatters launched in this backward; shown to the optimizer at its end


class Unit:
    """One unit: a module whose parameters are gathered, freed and reduced together.

    Two explicit states drive it. ``state`` (``UnitState``) says where the parameters are: SHARDED ->
    (prefetch, wait) PREFETCHED -> UNSHARDED -> (reshard) SHARDED at stage 3, or -> (reshard after a forward
    that backward follows, with ``reshard_after_forward=k``) REGROUPED -> (gather in the reshard group)
    PREFETCHED -> UNSHARDED; UNSHARDED for good at stages 1-2; SUMMONED while the user holds full copies.
    ``training`` (``TrainingState``) says where its gradients are:
    IDLE -> BACKWARD (pre-backward) -> GRADS_PENDING (post-backward) -> REDUCING (reduce-scatters launched) ->
    IDLE (the reduced gradients are shown to the optimizer). The sharded model moves both; every collective
    the unit launches goes through its mesh: ``shard_group`` (``mesh.shard``), ``mesh.replica``, ``mesh.reshard``.
    """

    def __init__(
        self,
        name: str,
        modules: list[nn.Module],
        flat_params: list[FlatParam],
        mesh: Mesh,
        reshard_at_rest: bool,
        module_path: str | None = None,
    ) -> None:
        self.name = name or "root"
        self.module_path = name if module_path is None else module_path  # "" for the root; a bucket's first block
        self.is_root = not name
        self.modules = modules  # one, or the blocks of a bucket (sharding/policy.py) in order
        self.module = modules[-1]  # the module whose output is the unit's output
        # a bucket's hooks fire once per block: how many blocks ran forward, and post-backwards still to come
        self.forwarded = 0
        self.awaiting_post_backward = 0
        self.flat_params = flat_params
        self.mesh = mesh
        self.shard_group = mesh.shard  # the all-gathers and reduce-scatters of the flat parameters
        self.rank = mesh.world.rank  # for messages: the rank as the user knows it
        # Stage 3 shards parameters at rest; stages 1-2 keep every unit UNSHARDED for good.
        self.reshard_at_rest = reshard_at_rest
        self.state = UnitState.SHARDED if reshard_at_rest else UnitState.UNSHARDED
        for fp in flat_params:
            fp.world_rank = self.rank
            fp.show_stubs() if reshard_at_rest else fp.show_views()  # stage 3: stubs at rest, even on one rank
        self.training = TrainingState.IDLE
        # [flat param] -> 1-D bool, numel = number of slots: got a gradient since the last reduction
        self.used = [torch.zeros(len(fp.layout.slots), dtype=torch.bool) for fp in self.flat_params]
        self._pending: list[tuple[FlatParam, Tensor, Tensor, Pending]] = []  # (fp, flat grad, new shard, work)
        self._crossing: list[tuple[FlatParam, Tensor, Pending]] = []  # hybrid: (fp, new shard, its all-reduce)
        self._gathering: list[Pending] = []  # all-gathers in flight into the full buffers
        self.reduce_sample: ReduceSample | None = None  # set by the budget for a sampled step (reduce_sample.py)

    def __repr__(self) -> str:
        return f"Unit({self.name}, {self.state.value}, {self.training.value}, {len(self.flat_params)} flat params)"

    # ---- SHARDED <-> UNSHARDED ----

    def _expect(self, state: UnitState, action: str) -> None:
        if self.state is not state:
            raise RuntimeError(
                f"[rank {self.rank}] cannot {action} unit {self.name!r}: it is {self.state.value}, "
                f"expected {state.value}."
            )

    def prefetch(self) -> None:
        """Stage 3: launch this unit's all-gathers now, so they travel while the unit before it computes: from
        the shards in the shard group, or (REGROUPED, before backward) from the group shards in the reshard group."""
        if self.state in (UnitState.SHARDED, UnitState.REGROUPED) and not self._gathering:
            for fp in self.flat_params:
                if fp.gathers:
                    fp.alloc_full()
                    self.shard_group.ledger.track_gathered(fp.full.untyped_storage().nbytes())
                    if fp.group_shard is None:
                        self._gathering.append(self._gather_shard(fp))
                    else:  # the group shard holds gathered values already (unpacked, if packed): exact among k
                        self._gathering.append(
                            collectives.all_gather(
                                fp.full, fp.group_shard, self.mesh.reshard, label=fp.layout.name, async_op=True
                            )
                        )

    def _gather_shard(self, fp: FlatParam) -> Pending:
        """Launch the all-gather of ``fp``'s compute shard into its full buffer in the shard group: packed where
        ``gather_dtype`` asks (comm/packing.py: every rank then holds the same unpacked values), else exact."""
        if fp.gather_packing is not None:
            return packed_collectives.all_gather_packed(
                fp.full, fp.shard, self.shard_group, fp.gather_packing, label=fp.layout.name, async_op=True
            )
        return collectives.all_gather(fp.full, fp.shard, self.shard_group, label=fp.layout.name, async_op=True)

    def wait_gathers(self) -> None:
        """Wait for this unit's all-gathers in flight (a prefetch, or the refresh after an optimizer step)."""
        if self._gathering and self.state in (UnitState.SHARDED, UnitState.REGROUPED):
            self.state = UnitState.PREFETCHED  # the full buffers hold the gathered values, not yet in use
        while self._gathering:
            self._gathering.pop(0).wait()
        if self.state is UnitState.PREFETCHED:
            self._drop_group_shards()  # gathered: the full buffers hold them now

    def unshard(self) -> None:
        """All-gather every flat parameter (unless prefetched) and give the params their unsharded views. First,
        values that user code gave a param as new ``.data`` since (``p.data = ...``, as the lottery-ticket reset
        of ``ModelPruning`` does) are taken into the shards (``FlatParam.adopt_replaced``)."""
        self.wait_gathers()
        if self.state not in (UnitState.SHARDED, UnitState.REGROUPED, UnitState.PREFETCHED):
            for fp in self.flat_params:  # gathered already (stages 1-2: for good), the views stay
                fp.adopt_replaced()
            return
        self.prefetch()
        self.wait_gathers()
        for fp in self.flat_params:
            fp.show_views()  # adopts replaced data first
        self.state = UnitState.UNSHARDED

    def reshard(self, regroup: bool = False) -> None:
        """Give the params their stubs and free the full buffers (stage 3 only); also drops a
        prefetch that was not used. ``regroup`` (after a forward that backward follows, with
        ``reshard_after_forward=k``): first keep each flat parameter's group shard, so backward gathers from
        the k ranks of the reshard group."""
        if not self.reshard_at_rest or self.state is UnitState.SUMMONED:
            return
        self.wait_gathers()
        regroup = regroup and self.mesh.regrouped and self.state is UnitState.UNSHARDED
        if self.state is UnitState.UNSHARDED:
            for fp in self.flat_params:
                fp.show_stubs()
        self.state = UnitState.REGROUPED if regroup else UnitState.SHARDED
        if not regroup:
            self._drop_group_shards()
        for fp in self.flat_params:
            if regroup and fp.gathers:
                fp.keep_group_shard(self.mesh.reshard.rank, self.mesh.reshard.world_size)
                self.shard_group.ledger.track_gathered(fp.group_shard.untyped_storage().nbytes())
            if fp.gathers and storage_is_allocated(fp.full):
                self.shard_group.ledger.track_gathered(-fp.full.untyped_storage().nbytes())
                fp.free_full()

    def _drop_group_shards(self) -> None:
        for fp in self.flat_params:
            if fp.group_shard is not None:
                self.shard_group.ledger.track_gathered(-fp.group_shard.untyped_storage().nbytes())
                fp.group_shard = None

    # ---- gradients ----

    @property
    def grad_flat_params(self) -> list[FlatParam]:
        """The flat parameters with a parameter that is trainable now (``requires_grad`` is read, never copied:
        a flag set in a hook or by a callback counts from the next backward on, as under DDP)."""
        return [fp for fp in self.flat_params if any(p.requires_grad for p in fp.params)]

    def collect_usage(self) -> None:
        """Note which parameters got a gradient in this backward (their grads stay where they are)."""
        for fp, used in zip(self.flat_params, self.used):
            for i, param in enumerate(fp.params):
                if param.grad is not None:
                    used[i] = True
        self.training = TrainingState.GRADS_PENDING

    def reduce_grads(self, async_op: bool = True) -> list[tuple[FlatParam, Tensor]]:
        """1. lay the unsharded grads out as the flat grad  2. launch its reduce-scatter  3. drop the grads.
        Returns each flat parameter with its flat grad: this rank's own gradient, before the reduction."""
        launched = []
        for fp in self.grad_flat_params:
            flat = gradients.flat_grad(fp)  # 1-D, padded_numel, reduce dtype
            new_shard = torch.empty(fp.layout.shard_numel, dtype=flat.dtype, device=flat.device)  # 1-D, S
            pending = self._reduce_flat(fp, new_shard, flat)
            self._pending.append((fp, flat, new_shard, pending))
            launched.append((fp, flat))
            for param in fp.params:
                param.grad = None
        self.training = TrainingState.REDUCING
        if not async_op:
            self.wait_reductions()
        return launched

    def _reduce_flat(self, fp: FlatParam, new_shard: Tensor, flat: Tensor) -> Pending:
        """Launch the reduce-scatter of ``flat`` into ``new_shard`` in the shard group: packed and summed in fp32
        where ``reduce_dtype`` asks (int8: with this flat parameter's error-feedback residual), else exact."""
        if fp.reduce_packing is None:
            return collectives.reduce_scatter(new_shard, flat, self.shard_group, label=fp.layout.name, async_op=True)
        if self.reduce_sample is not None and self.shard_group.world_size > 1:  # exact first, to set against
            self.reduce_sample.reduce_exactly(fp, flat, self.shard_group)
        residual = fp.residual_buffer() if fp.error_feedback and self.shard_group.world_size > 1 else None
        return packed_collectives.reduce_scatter_packed(
            new_shard, flat, self.shard_group, fp.reduce_packing, fp.layout.name, async_op=True, residual=residual
        )

    def wait_reductions(self, finish: bool = True) -> None:
        """Wait for launched reduce-scatters and add their results into the grad shards. Hybrid: each result
        is first all-reduced across the replica groups (launched here, in flight until ``finish``)."""
        replica = self.mesh.replica
        for fp, _flat_alive_until_done, new_shard, pending in self._pending:
            pending.wait()
            if self.reduce_sample is not None:
                self.reduce_sample.compare(self.name, fp, new_shard)
            if replica.world_size > 1:
                crossing = collectives.launch_all_reduce(new_shard, replica, label=fp.layout.name)
                self._crossing.append((fp, new_shard, crossing))
            else:
                gradients.accumulate(fp, new_shard)
        self._pending.clear()
        while finish and self._crossing:
            fp, new_shard, crossing = self._crossing.pop(0)
            crossing.wait()
            gradients.accumulate(fp, new_shard.div_(replica.world_size))  # the mean over every rank

    def show_grads(self, used_per_fp: list[Tensor]) -> None:
        """Let the optimizer see the reduced gradients of the parameters that count as used."""
        for fp, used in zip(self.flat_params, used_per_fp):
            if fp.grad_shard is not None:
                gradients.show(fp, used)
        self.end_reduction()

    def end_reduction(self) -> None:
        self.training = TrainingState.IDLE
        for used in self.used:
            used.zero_()

    def launch_refresh(self, stepped: set[FlatParam]) -> None:
        """Launch the all-gathers that refresh the full buffers from shards just updated (by an optimizer
        step or a load): always at stages 1-2 (resident), and at stage 3 for a unit gathered right now
        (the root within a manually optimised step). The caller waits for them (``wait_gathers``)."""
        if self.state is not UnitState.UNSHARDED:
            return
        for fp in self.flat_params:
            if fp in stepped and (fp.resident_full or fp.gathers):
                self._gathering.append(self._gather_shard(fp))

    # ---- full copies for the user (sharding/gathered.py) ----

    def summon(self, copies_per_fp: list[list[Tensor]]) -> UnitState:
        """Give the params the given full copies as data; returns the state to go back to (``unsummon``)."""
        busy = self.training is TrainingState.BACKWARD or self._gathering
        if self.state is UnitState.SUMMONED or busy:
            raise RuntimeError(
                f"[rank {self.rank}] cannot gather unit {self.name!r} for the user: it is"
                f" {self.state.value}, {self.training.value}."
            )
        if self.state in (UnitState.PREFETCHED, UnitState.REGROUPED):
            self.reshard()  # a writeback would leave the prefetched values stale: gather again when needed
        previous, self.state = self.state, UnitState.SUMMONED
        for fp, copies in zip(self.flat_params, copies_per_fp):
            fp.show_copies(copies)
        return previous

    def unsummon(self, previous: UnitState) -> None:
        """Back from the user's copies (a ``.data`` they replaced inside is taken into the copies first)."""
        self._expect(UnitState.SUMMONED, "return the user's full copies of")
        self.state = previous
        for fp in self.flat_params:
            fp.show_views() if previous is UnitState.UNSHARDED else fp.show_stubs()
