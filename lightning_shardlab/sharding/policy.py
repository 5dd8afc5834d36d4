"""Which modules become units, and which unit owns each parameter.

A unit is gathered, computed and freed as one piece, so every rank must run it in each step or none
may. The default gives transformer-style models one unit per repeated block: every child of the
outermost ``nn.ModuleList`` / ``nn.Sequential`` / ``nn.ModuleDict`` whose children (two or more) share
one class and own parameters, when the code shows that every forward runs all of them (sharding/always_runs.py).
Blocks whose execution may depend on the data (mixture-of-experts experts, a list indexed by the
step) stay inside the enclosing unit. ``unit_classes`` replaces all that with "every module of these
classes", the user's word. The root module is always a unit and owns whatever no other unit owns.

Buckets: each unit costs a few collectives per step, each paying a fixed latency, so a model of many small
blocks is latency-bound (a 123k-parameter GPT at stage 3 ran 1.24x DDP's step with a unit per block). The
default policy therefore merges consecutive blocks of one container into a *bucket* of at least
``unit_bucket_params`` parameters (a last bucket that falls short joins the one before): one unit of several
modules, gathered, freed and reduced as one (sharding/unit.py, sharding/hooks.py count its members' hooks). A
container whose blocks altogether hold fewer makes no units: its blocks stay in the enclosing unit (a tiny
model is then one unit, one message each way per step). Blocks of at least that size stay one unit each;
``unit_bucket_params=0`` keeps a unit per block.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from lightning_shardlab.core.config import ShardLabConfig
from lightning_shardlab.sharding.always_runs import always_runs_every_block
from lightning_shardlab.sharding.flat_param import FlatParamLayout


@dataclass
class ParamUse:
    """One parameter object and every place it is registered (tied parameters have several)."""

    param: nn.Parameter
    fqns: list[str]

    @property
    def module_paths(self) -> list[str]:
        return [fqn.rpartition(".")[0] for fqn in self.fqns]


def param_uses(root: nn.Module) -> list[ParamUse]:
    """Every distinct parameter of ``root`` with all its names, in ``named_parameters()`` order."""
    uses: dict[int, ParamUse] = {}
    for fqn, param in root.named_parameters(remove_duplicate=False):
        uses.setdefault(id(param), ParamUse(param, [])).fqns.append(fqn)
    return list(uses.values())


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


@dataclass
class UnitChoice:
    """The units' module paths (the root "" first, then in ``named_modules()`` order), and the containers
    of repeated blocks the default policy left whole because nothing shows every forward runs them all.
    ``members``: unit path -> its modules' paths, for buckets of several blocks (named ``blocks.0-3``)."""

    paths: list[str]
    declined: list[str] = field(default_factory=list)
    members: dict[str, list[str]] = field(default_factory=dict)

    def modules_of(self, path: str) -> list[str]:
        return self.members.get(path, [path])


def _repeated_blocks(root: nn.Module) -> UnitChoice:
    """The children of the outermost containers of two or more same-class blocks that every forward runs
    (sharding/always_runs.py); containers without that evidence are declined, and nothing inside them is a unit."""
    choice = UnitChoice([])

    def visit(module: nn.Module, path: str) -> None:
        children = list(module.named_children())
        if isinstance(module, CONTAINERS) and len(children) >= 2:
            kinds = {type(child) for _, child in children}
            if len(kinds) == 1 and all(_numel(child) > 0 for _, child in children):
                if always_runs_every_block(root, path):
                    choice.paths.extend(f"{path}.{name}" if path else name for name, _ in children)
                else:
                    choice.declined.append(path)
                return
        for name, child in children:
            visit(child, f"{path}.{name}" if path else name)

    visit(root, "")
    return choice


def choose_units(root: nn.Module, config: ShardLabConfig) -> UnitChoice:
    """The units: every module of ``config.unit_classes`` (the user's word), else the default policy."""
    if config.unit_classes:
        choice = UnitChoice([path for path, m in root.named_modules() if path and isinstance(m, config.unit_classes)])
    else:
        choice = _repeated_blocks(root)
    big_enough = [p for p in choice.paths if _numel(root.get_submodule(p)) >= max(config.min_unit_params, 1)]
    if config.unit_classes or not config.unit_bucket_params:
        return UnitChoice([""] + big_enough, choice.declined)
    members = bucket_blocks(root, big_enough, config.unit_bucket_params)
    return UnitChoice([""] + list(members), choice.declined, {k: v for k, v in members.items() if len(v) > 1})


def bucket_blocks(root: nn.Module, paths: list[str], min_params: int) -> dict[str, list[str]]:
    """Consecutive blocks of one container, merged until each bucket holds ``min_params`` parameters (a last
    bucket that falls short joins the one before it); the blocks of a container that altogether hold fewer
    are no units at all (their parameters stay in the enclosing unit: one message for the whole lot).
    Returns bucket name (``blocks.0-3``, or the block's own path when alone) -> its blocks' paths, in order."""
    containers: dict[str, list[str]] = {}
    for path in paths:
        containers.setdefault(path.rpartition(".")[0], []).append(path)
    out: dict[str, list[str]] = {}
    for blocks in containers.values():
        buckets, filled = [[]], 0
        for path in blocks:
            if filled >= min_params:
                buckets.append([])
                filled = 0
            buckets[-1].append(path)
            filled += _numel(root.get_submodule(path))
        if len(buckets) == 1 and filled < min_params:
            continue  # the whole container is smaller than one bucket
        if len(buckets) > 1 and filled < min_params:
            short = buckets.pop()
            buckets[-1] += short
        out.update({_bucket_name(b): b for b in buckets})
    return out


def _bucket_name(paths: list[str]) -> str:
    if len(paths) == 1:
        return paths[0]
    parent, _, first = paths[0].rpartition(".")
    return f"{parent + '.' if parent else ''}{first}-{paths[-1].rpartition('.')[2]}"


def _is_within(path: str, unit_path: str) -> bool:
    return unit_path == "" or path == unit_path or path.startswith(unit_path + ".")


def owning_unit(use: ParamUse, unit_paths: list[str], choice: UnitChoice | None = None) -> str:
    """The deepest unit that contains every module using the parameter (their lowest common unit); a bucket
    contains what any of its blocks contains."""
    members = choice.modules_of if choice is not None else (lambda u: [u])

    def within(path: str, unit: str) -> bool:
        return any(_is_within(path, m) for m in members(unit))

    candidates = [u for u in unit_paths if all(within(m, u) for m in use.module_paths)]
    return max(candidates, key=lambda u: (u.count(".") + 1) if u else 0)


def group_flat_params(unit: str, uses: list[ParamUse], world_size: int) -> list[tuple[FlatParamLayout, list[ParamUse]]]:
    """One flat parameter per (dtype, requires_grad) group of a unit's parameters, in first-appearance order."""
    groups: dict[tuple[torch.dtype, bool], list[ParamUse]] = {}
    for use in uses:
        groups.setdefault((use.param.dtype, use.param.requires_grad), []).append(use)
    return [
        (
            FlatParamLayout.build(
                unit or "root", dtype, rg, [(tuple(u.fqns), u.param.shape) for u in group], world_size
            ),
            group,
        )
        for (dtype, rg), group in groups.items()
    ]


@dataclass
class UnitPlan:
    """Everything sharding decides before any tensor moves: pure, so it works on a meta-device model and for a
    world that does not exist (``shardlab plan``)."""

    choice: UnitChoice
    uses: list[ParamUse]
    owners: dict[int, str]  # id(parameter) -> the path of the unit that owns it
    groups: dict[str, list[tuple[FlatParamLayout, list[ParamUse]]]]  # unit path -> its flat parameters

    def layouts(self) -> dict[str, list[FlatParamLayout]]:
        """The flat-parameter layouts of every unit that has parameters (and the root)."""
        return {path or "root": [lay for lay, _ in g] for path, g in self.groups.items() if g or not path}


def plan_units(root: nn.Module, config: ShardLabConfig, world_size: int) -> UnitPlan:
    """The units, which unit owns each parameter, and each unit's flat parameters at ``world_size``."""
    uses = param_uses(root)
    choice = choose_units(root, config)
    owners = {id(use.param): owning_unit(use, choice.paths, choice) for use in uses}
    groups = {
        path: group_flat_params(path, [u for u in uses if owners[id(u.param)] == path], world_size)
        for path in choice.paths
    }
    return UnitPlan(choice, uses, owners, groups)
