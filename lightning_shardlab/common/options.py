"""The strategies' options, written once: the fields of ``ShardLabConfig`` and the guard's fields named here.

Each option is one dataclass field with its docstring (core/config.py, guard/sanity_guard.py). From those
fields come, with nothing written a second time:

- ``SIGNATURE``: the keyword arguments of both strategies' ``__init__`` (what Python, ``help()`` and
  LightningCLI's YAML see), each typed as the front door accepts it: an enum field takes its values (``stage=3``,
  ``accumulation="defer"``), a field of classes takes classes, import paths or a list mixing both;
- ``OPTIONS_DOC``: their ``Args:`` section, from the fields' docstrings;
- ``options_to_configs(options, who)``: the checked ``ShardLabConfig`` and ``SanityConfig`` of a set of options.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import functools
import inspect
import operator
import textwrap
import types
import typing
from typing import Any

from lightning_shardlab.core.config import ShardLabConfig
from lightning_shardlab.guard.sanity_guard import SanityConfig

# the guard's fields that are strategy options: option name -> SanityConfig field
SANITY_OPTIONS = {
    "sanity_every_n_steps": "every_n_steps",
    "strict_collectives": "strict_collectives",
    "verify_collectives": "verify_collectives",
    "collective_timeout_s": "collective_timeout_s",
    "handle_sigterm": "handle_sigterm",
}


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of the dataclass ``cls`` (read from its source, as Sphinx does)."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, after in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if (
                isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def _accepted(field: dataclasses.Field, hints: dict[str, Any]) -> tuple[Any, Any]:
    """The type and default a front door shows for ``field``: an enum as its values, a tuple of classes as
    ``None`` or classes / import paths / a list of them (also inside a union: ``activation_checkpointing``),
    anything else as declared."""
    kind, default = hints[field.name], field.default
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        values = tuple(member.value for member in kind)
        return typing.Literal[values], default.value  # type: ignore[valid-type]
    if typing.get_origin(kind) is tuple:
        return _classes_accepted(kind), None
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        members = [_classes_accepted(k) if typing.get_origin(k) is tuple else k for k in typing.get_args(kind)]
        return functools.reduce(operator.or_, members), default
    return kind, default


def _classes_accepted(kind: Any) -> Any:
    """``tuple[type[X], ...]`` as a front door takes it: a class, an import path, a list of them, or None."""
    (cls,) = typing.get_args(typing.get_args(kind)[0])  # tuple[type[X], ...] -> X
    one = type[cls] | str  # type: ignore[valid-type]
    return list[one] | one | None


def _options() -> list[tuple[str, type, str, dataclasses.Field]]:
    """(option name, config class, field name, field) for every option, in the order the strategies list them."""
    config = [(f.name, ShardLabConfig, f.name, f) for f in dataclasses.fields(ShardLabConfig)]
    sanity_fields = {f.name: f for f in dataclasses.fields(SanityConfig)}
    sanity = [(name, SanityConfig, field, sanity_fields[field]) for name, field in SANITY_OPTIONS.items()]
    return config + sanity


OPTIONS = tuple(name for name, *_ in _options())


def _signature() -> inspect.Signature:
    hints = {cls: typing.get_type_hints(cls) for cls in (ShardLabConfig, SanityConfig)}
    params = []
    for name, cls, _, field in _options():
        annotation, default = _accepted(field, hints[cls])
        params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation))
    return inspect.Signature(params)


def _options_doc() -> str:
    docs = {cls: field_docs(cls) for cls in (ShardLabConfig, SanityConfig)}
    lines = []
    for name, cls, field, _ in _options():
        text = docs[cls].get(field, "").replace("\n", " ")
        wrapped = textwrap.wrap(f"{name}: {text}", 108, initial_indent=" " * 8, subsequent_indent=" " * 12)
        lines.extend(wrapped)
    return "\n" + "\n".join(lines) + "\n"


SIGNATURE = _signature()
OPTIONS_DOC = _options_doc()


def check_option_names(options: dict[str, Any], who: str) -> None:
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ValueError(f"{who} got unknown option(s) {', '.join(map(repr, unknown))}. Allowed: {', '.join(OPTIONS)}.")


def options_to_configs(options: dict[str, Any], who: str) -> tuple[ShardLabConfig, SanityConfig]:
    """The engine's config and the guard's, checked, from options named in ``OPTIONS`` (the rest default);
    an unknown name is refused naming ``who`` (the strategy) and the allowed ones."""
    check_option_names(options, who)
    config = {n: options[n] for n in options if n not in SANITY_OPTIONS}
    sanity = {SANITY_OPTIONS[n]: options[n] for n in options if n in SANITY_OPTIONS}
    return ShardLabConfig(**config), SanityConfig(**sanity)


def with_options(init: Any) -> Any:
    """``init`` (a strategy's ``__init__(self, <Lightning's arguments>, **options)``) shown with every option as a
    keyword argument of its own: LightningCLI and ``help()`` read this signature."""
    own = [p for p in inspect.signature(init).parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    init.__signature__ = inspect.Signature([*own, *SIGNATURE.parameters.values()])
    return init
