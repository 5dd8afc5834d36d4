"""Whether every forward runs every block of a container: the evidence the default unit policy asks for.

A unit is gathered by a collective, so in each step every rank must run it, or none may. The default
policy (sharding/policy.py) makes units of repeated blocks only where the code shows that they always run:

- an ``nn.Sequential``: its own forward runs every child, in order;
- an ``nn.ModuleList`` / ``nn.ModuleDict`` iterated by a ``for`` loop in a method of a module that holds
  it (``for block in self.blocks``, ``enumerate(self.h)``, ``zip(self.blocks, self.gates)``,
  ``self.layers[:n]``, ``self.layers.values()``), where the loop always runs (not under an ``if``, unless
  both branches have such a loop; inside ``with``, ``try`` or a ``for ... in range(n)`` repeat is fine), has
  no ``break`` or ``continue``, and calls the block, or hands it to a function (activation checkpointing),
  in a statement that is not under an ``if`` (or is in both of its branches).

Not evidence: indexing (``self.experts[i]``, ``self.branches[step % 2]``), a loop over anything else
(``for e in range(n)``), a call under a condition (``if rows.numel(): expert(x[rows])``: mixture-of-experts
routing, where an expert may get no tokens on one rank), source that cannot be read. The blocks of such
a container are not units: they join the enclosing unit, which every rank gathers whole.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap

from torch import nn

_FRAMEWORK = (nn.Module, object)  # their methods never iterate a user's container


def always_runs_every_block(root: nn.Module, container: str) -> bool:
    """Whether the code shows that each forward runs every block of the container at ``container``."""
    module = root.get_submodule(container)
    if isinstance(module, nn.Sequential):
        return True
    parts = container.split(".")
    for depth in range(len(parts) - 1, -1, -1):  # the nearest holder first, then its ancestors
        holder = root.get_submodule(".".join(parts[:depth]))
        if _iterates(type(holder), tuple(parts[depth:])):
            return True
    return False


@functools.cache
def _iterates(cls: type, attrs: tuple[str, ...]) -> bool:
    """Whether a method of ``cls`` runs every element of ``self.<attrs>`` unconditionally."""
    for method in _methods(cls):
        if method.args.args:
            this = method.args.args[0].arg  # the method's ``self``
            if _always(method.body, (this, *attrs)):
                return True
    return False


def _methods(cls: type) -> list[ast.FunctionDef]:
    """The methods in effect on ``cls``: for each name, the definition the MRO resolves to."""
    found: dict[str, ast.FunctionDef] = {}
    for klass in cls.__mro__:
        if klass in _FRAMEWORK:
            continue
        tree = _parse(klass)
        body = tree.body[0].body if tree is not None and tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.setdefault(node.name, node)
    return list(found.values())


def _parse(cls: type) -> ast.Module | None:
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return None


def _always(body: list[ast.stmt], chain: tuple[str, ...]) -> bool:
    """Whether running ``body`` always runs a loop that runs every block of ``self.<chain>``: at its top
    level, inside ``with`` / ``try``, in both branches of an ``if``, or inside a ``for ... in range(...)``
    (a repeat count, the same on every rank; e.g. blocks reused several times)."""
    for stmt in body:
        if isinstance(stmt, ast.For) and _runs_all(stmt, chain):
            return True
        if isinstance(stmt, ast.For) and _is_range(stmt.iter) and _always(stmt.body, chain):
            return True
        if isinstance(stmt, (ast.With, ast.AsyncWith, ast.Try)) and _always(stmt.body, chain):
            return True
        if isinstance(stmt, ast.If) and _always(stmt.body, chain) and _always(stmt.orelse, chain):
            return True
    return False


def _is_range(node: ast.expr) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "range"


def _runs_all(loop: ast.For, chain: tuple[str, ...]) -> bool:
    names = _element_names(loop.iter, loop.target, chain)
    if not names or any(isinstance(n, (ast.Break, ast.Continue)) for n in _walk_loop_body(loop.body)):
        return False
    return any(_surely_uses(stmt, names) for stmt in loop.body)


def _walk_loop_body(body: list[ast.stmt]):  # noqa: ANN202
    """Every node of ``body``, not descending into nested loops or functions (their break is their own)."""
    stack = list(body)
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, (ast.For, ast.While, ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            stack.extend(ast.iter_child_nodes(node))


def _is_self_attr(node: ast.expr, chain: tuple[str, ...]) -> bool:
    """``node`` is ``chain[0].chain[1].chain[2]...`` (``chain[0]``: the method's ``self``)."""
    for attr in reversed(chain[1:]):
        if not (isinstance(node, ast.Attribute) and node.attr == attr):
            return False
        node = node.value
    return isinstance(node, ast.Name) and node.id == chain[0]


def _element_names(it: ast.expr, target: ast.expr, chain: tuple[str, ...]) -> set[str]:
    """The loop variables bound to the container's blocks, following enumerate/zip/reversed/slices."""
    if _is_self_attr(it, chain):
        return {target.id} if isinstance(target, ast.Name) else set()
    if isinstance(it, ast.Subscript) and isinstance(it.slice, ast.Slice):
        return _element_names(it.value, target, chain)
    if not isinstance(it, ast.Call):
        return set()
    func = it.func
    if isinstance(func, ast.Attribute) and func.attr in ("values", "items") and not it.args:
        if func.attr == "values":
            return _element_names(func.value, target, chain)
        if isinstance(target, ast.Tuple) and len(target.elts) == 2:
            return _element_names(func.value, target.elts[1], chain)
        return set()
    name = func.id if isinstance(func, ast.Name) else None
    if name in ("reversed", "list", "tuple") and len(it.args) == 1:
        return _element_names(it.args[0], target, chain)
    if name == "enumerate" and it.args and isinstance(target, ast.Tuple) and len(target.elts) == 2:
        return _element_names(it.args[0], target.elts[1], chain)
    if name == "zip" and isinstance(target, ast.Tuple) and len(target.elts) == len(it.args):
        return set().union(*(_element_names(a, t, chain) for a, t in zip(it.args, target.elts)))
    return set()


def _surely_uses(stmt: ast.stmt, names: set[str]) -> bool:
    """``stmt`` always calls one of ``names`` (or passes it to a call) whenever it runs."""
    if isinstance(stmt, ast.If):
        return any(_surely_uses(s, names) for s in stmt.body) and any(_surely_uses(s, names) for s in stmt.orelse)
    if isinstance(stmt, (ast.With, ast.AsyncWith, ast.Try)):
        return any(_surely_uses(s, names) for s in stmt.body)
    if isinstance(stmt, (ast.For, ast.While, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return False
    return any(_calls(node, names) for node in _walk_unconditional(stmt))


def _walk_unconditional(node: ast.AST):  # noqa: ANN202
    """Nodes of an expression statement that are evaluated whenever it is (no ``a if c else b``, ``and``/``or``,
    comprehension or lambda bodies)."""
    stack = [node]
    while stack:
        current = stack.pop()
        yield current
        if isinstance(
            current, (ast.IfExp, ast.BoolOp, ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)
        ):
            continue
        stack.extend(ast.iter_child_nodes(current))


def _calls(node: ast.AST, names: set[str]) -> bool:
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    if isinstance(func, ast.Name) and func.id in names:
        return True
    if isinstance(func, ast.Attribute) and func.attr == "__call__" and isinstance(func.value, ast.Name):
        return func.value.id in names
    return any(isinstance(arg, ast.Name) and arg.id in names for arg in (*node.args, *(k.value for k in node.keywords)))
