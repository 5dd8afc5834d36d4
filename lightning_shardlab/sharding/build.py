"""``shard_model(module, config, comm)``: turn a module into units of flat parameters, in place.

Every rank calls it (it communicates). 1. choose the units and lay out their flat parameters at the shard
group's size (sharding/policy.py)  2. check every rank built the same layout  3. time the transports on the
biggest flat parameter  4. give every rank rank 0's initial values (meta modules are built unit by unit:
sharding/materialize.py)  5. give each parameter its stub (stage 3) or its view of the full buffer (stages 1-2),
install the hooks  6. run the modules ``activation_checkpointing`` chooses under checkpoint
(sharding/checkpointing.py). The runtime it returns, ``ShardedModel``, lives in sharding/sharded_model.py.
"""

from __future__ import annotations

import functools
import os
import weakref

from torch import Tensor, nn

from lightning_shardlab.comm import collectives
from lightning_shardlab.comm.collectives import Comm
from lightning_shardlab.comm.mesh import Mesh
from lightning_shardlab.comm.packing import packing_for
from lightning_shardlab.comm.transport_probe import PROBE_NUMEL, choose_transports
from lightning_shardlab.core.config import PrecisionPolicy, ShardLabConfig, Stage
from lightning_shardlab.sharding import checkpointing, hooks
from lightning_shardlab.sharding.flat_param import FlatParam, FlatParamLayout, stub
from lightning_shardlab.sharding.materialize import has_meta, materialize
from lightning_shardlab.sharding.placeholders import refuse_placeholders
from lightning_shardlab.sharding.policy import plan_units
from lightning_shardlab.sharding.same_layout import check_same_layout, warn_declined
from lightning_shardlab.sharding.sharded_model import ShardedModel, broadcast_buffers
from lightning_shardlab.sharding.unit import Unit

# module -> its ShardedModel, both held weakly: the module's hooks hold the ShardedModel, which holds the module, so
# a strong value here would keep every sharded model alive for good (a process that fits twice held both)
_SHARDED: weakref.WeakKeyDictionary[nn.Module, weakref.ref[ShardedModel]] = weakref.WeakKeyDictionary()


def shard_model(
    module: nn.Module, config: ShardLabConfig, comm: Comm | Mesh, policy: PrecisionPolicy | None = None
) -> ShardedModel:
    """Shard ``module`` in place and install its hooks. Every rank must call it (it communicates).

    ``comm``: the world's Comm (the groups of ``config.shard_group_size`` are opened here; 'node' is read from
    ``LOCAL_WORLD_SIZE``), or a ``Mesh`` the caller opened. Order: 1. choose units and lay out flat params at
    the shard group's size  2. check all ranks built the same layout  3. broadcast rank 0's initial values
    4. give each parameter its stub (stage 3) or its view of the full buffer (stages 1-2).
    """
    policy = policy or PrecisionPolicy()
    world = comm.world if isinstance(comm, Mesh) else comm
    existing = _already_sharded(module, config, policy, world)
    if existing is not None:
        return existing
    mesh = (
        comm if isinstance(comm, Mesh) else Mesh.build(world, *config.group_sizes(world.world_size, _per_node(world)))
    )
    plan = plan_units(module, config, mesh.shard.world_size)
    if plan.choice.declined and world.rank == 0:
        warn_declined(module, plan.choice.declined)
    # before any collective: a choice refused is refused on every rank (each computes the same)
    unit_paths, groups = plan.choice.paths, plan.groups
    members = {m: path for path in unit_paths if path and groups[path] for m in plan.choice.modules_of(path)}
    chosen = checkpointing.chosen_modules(module, config.activation_checkpointing, members, warn=world.rank == 0)
    check_same_layout(module, plan.uses, plan.owners, world)
    flat = _flat_params(groups, config, mesh, policy)
    _load_initial_values(
        module, [(fp, group) for path in unit_paths for fp, (_, group) in zip(flat[path], groups[path])], world
    )
    units = [
        Unit(
            path, [module.get_submodule(m) for m in plan.choice.modules_of(path)], flat[path], mesh,
            reshard_at_rest=config.stage is Stage.PARAMETERS, module_path=plan.choice.modules_of(path)[0],
        )
        for path in unit_paths
        if flat[path] or not path
    ]  # fmt: skip
    broadcast_buffers(module, world, label="setup buffers")
    sharded = ShardedModel(module, units, config, mesh, policy)
    for unit in units:
        hooks.install(sharded, unit)
    sharded.checkpointed = checkpointing.apply(module, chosen)
    module.register_state_dict_post_hook(refuse_placeholders)
    _SHARDED[module] = weakref.ref(sharded)
    return sharded


def sharded_model_of_module(module: nn.Module) -> ShardedModel | None:
    """The ShardedModel that ``module`` was sharded into (by any Trainer or Fabric), if it is alive."""
    ref = _SHARDED.get(module)
    return ref() if ref is not None else None


def _already_sharded(
    module: nn.Module, config: ShardLabConfig, policy: PrecisionPolicy, world: Comm
) -> ShardedModel | None:
    """The module's sharded model when it was sharded with the same options (Lightning sets a module up again
    for a second ``fit``); a module sharded otherwise is refused."""
    existing = _SHARDED[module]() if module in _SHARDED else None
    if existing is None:
        return None
    if existing.config == config and existing.policy == policy and existing.comm.world_size == world.world_size:
        existing.wait_gathers()
        return existing
    raise ValueError(
        f"{type(module).__name__} is already sharded (stage {int(existing.config.stage)}, world size"
        f" {existing.comm.world_size}). HINT: create a fresh module, or reuse the same strategy options."
    )


def _flat_params(
    groups: dict, config: ShardLabConfig, mesh: Mesh, policy: PrecisionPolicy
) -> dict[str, list[FlatParam]]:
    """Each unit's flat parameters on the shard group, and the transport each collective takes on gloo (timed on
    the largest)."""
    shard = mesh.shard
    flat = {
        path: [
            _new_flat_param(layout, config, shard, policy, [_identity(u.param, shard) for u in group])
            for layout, group in g
        ]
        for path, g in groups.items()
    }
    biggest = max((fp for fps in flat.values() for fp in fps), key=lambda fp: fp.layout.padded_numel, default=None)
    if biggest is not None:
        numel = min(biggest.layout.padded_numel, PROBE_NUMEL)
        shard.transport_times = choose_transports(shard, numel, biggest.compute_dtype, config.transport)
        mesh.reshard.transports = dict(shard.transports)
    return flat


def _load_initial_values(module: nn.Module, pairs: list[tuple[FlatParam, list]], world: Comm) -> None:
    """Rank 0's initial values into every flat parameter (a meta-device module is materialized first); a
    parameter made on the meta device is replaced in its module by its identity for the run."""
    load = functools.partial(_load_from_rank_0, comm=world)
    if has_meta(module):
        materialize(module, pairs, world.device, load)
    else:
        for fp, group in pairs:
            load(fp, [u.param for u in group])
    for fp, group in pairs:
        for param, use in zip(fp.params, group):
            if param is not use.param:
                for fqn in use.fqns:
                    owner, attr = _place(module, fqn)
                    owner._parameters[attr] = param


def _per_node(world: Comm) -> int:
    """Ranks per node, as launchers (torchrun, Lightning's) tell each process; the world if none says."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world.world_size))


def _new_flat_param(
    layout: FlatParamLayout, config: ShardLabConfig, comm: Comm, policy: PrecisionPolicy, params: list[nn.Parameter]
) -> FlatParam:
    stage_3 = config.stage is Stage.PARAMETERS
    return FlatParam(
        layout,
        comm.rank,
        comm.device,
        resident_full=not stage_3,
        compute_dtype=policy.compute_for(layout.dtype),
        reduce_dtype=policy.reduce_dtype,
        params=params,
        gather_packing=packing_for(config.gather_dtype, config.quant_block_size) if stage_3 else None,
        reduce_packing=packing_for(config.reduce_dtype, config.quant_block_size),
    )


def _identity(param: nn.Parameter, comm: Comm) -> nn.Parameter:
    """The object that stands for ``param`` for the whole run: itself, or (made on the meta device, whose
    tensors cannot take device data) a new parameter of its shape and flag, holding no memory yet."""
    if not param.is_meta:
        return param
    return nn.Parameter(stub(param.shape, param.dtype, comm.device), param.requires_grad)


def _load_from_rank_0(fp: FlatParam, values: list[Tensor], comm: Comm) -> None:
    """Every rank takes rank 0's values: lay them out, broadcast, keep this rank's shard."""
    flat = fp.flatten(values)  # 1-D, padded_numel
    collectives.broadcast(flat, comm, src=0, label=f"setup {fp.layout.name}")
    fp.load(flat)


def _place(root: nn.Module, fqn: str) -> tuple[nn.Module, str]:
    path, _, attr = fqn.rpartition(".")
    return root.get_submodule(path), attr
