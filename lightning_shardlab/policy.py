"""Which modules become units, and which unit owns each parameter.

A unit is gathered, computed and freed as one piece. The default gives transformer-style models one
unit per repeated block: every child of an ``nn.ModuleList`` / ``nn.Sequential`` whose children (two
or more) share one class and own parameters. ``unit_classes`` replaces that with "every module of
these classes". The root module is always a unit and owns whatever no other unit owns.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from lightning_shardlab.config import ShardLabConfig


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


def _repeated_blocks(root: nn.Module) -> list[str]:
    """Paths of the children of the outermost containers of two or more same-class blocks."""
    found: list[str] = []

    def visit(module: nn.Module, path: str) -> None:
        children = list(module.named_children())
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and len(children) >= 2:
            kinds = {type(child) for _, child in children}
            if len(kinds) == 1 and all(_numel(child) > 0 for _, child in children):
                found.extend(f"{path}.{name}" if path else name for name, _ in children)
                return
        for name, child in children:
            visit(child, f"{path}.{name}" if path else name)

    visit(root, "")
    return found


def choose_unit_paths(root: nn.Module, config: ShardLabConfig) -> list[str]:
    """Module paths of the units, the root ("") first, then in ``named_modules()`` order."""
    if config.unit_types:
        paths = [path for path, m in root.named_modules() if path and isinstance(m, config.unit_types)]
    else:
        paths = _repeated_blocks(root)
    paths = [p for p in paths if _numel(root.get_submodule(p)) >= max(config.min_unit_params, 1)]
    return [""] + paths


def _is_within(path: str, unit_path: str) -> bool:
    return unit_path == "" or path == unit_path or path.startswith(unit_path + ".")


def owning_unit(use: ParamUse, unit_paths: list[str]) -> str:
    """The deepest unit that contains every module using the parameter (their lowest common unit)."""
    candidates = [u for u in unit_paths if all(_is_within(m, u) for m in use.module_paths)]
    return max(candidates, key=lambda u: (u.count(".") + 1) if u else 0)
