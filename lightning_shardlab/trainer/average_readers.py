"""A weight-averaging subclass that reads the whole averaged module: found before fit, and caught where it reads.

Lightning's ``WeightAveraging`` and ``StochasticWeightAveraging`` keep the average as a whole module
(``self._average_model``: an ``AveragedModel`` around a deep copy, or the deep copy itself). Under shardlab each
rank keeps its share of the average instead (sharding/averages.py), and ``_average_model`` is a stand-in that
answers only what Lightning's own code asks of it. A subclass runs sharded as long as its own code leaves the
averaged module to those methods; one that reads it (its weights, ``.module``, its ``state_dict()``) has no whole
module to read on any rank, so it is refused, naming its method. Two checks:

    before fit     ``whole_average_reader(cls, ...)`` reads the bytecode of every function the user's classes
                   define (everything in the MRO above Lightning's own classes, nested functions included) and
                   finds the first place where the averaged module, ``<anything>._average_model`` or the argument
                   SWA hands its ``update_parameters`` / ``transfer_weights`` as the average, is followed by an
                   attribute read (other than the stand-in's own API), an iteration or an index. Passing it on
                   (to ``super()``, to another method) and testing it (``is None``) are not reads. The strategy
                   raises this on every rank at setup, before any collective.
    while fit      what the bytecode cannot see (the average passed to a helper that reads it, ``getattr``) meets
                   ``StandIn.__getattr__``: the same error, naming the user's method on the stack.
"""

from __future__ import annotations

import dis
import functools
import inspect
import sys
import types
from collections.abc import Iterator
from typing import Any, NoReturn

# packages whose classes provide the machinery; a class from anywhere else is the user's
_MACHINERY = ("lightning", "lightning_shardlab", "pytorch_lightning", "torch", "builtins")
_ATTRIBUTE_READS = ("LOAD_ATTR", "LOAD_METHOD")
_WHOLE_READS = ("GET_ITER", "BINARY_SUBSCR", "FOR_ITER")


def whole_average_error(method: str, read: str, rank: int | None = None) -> ValueError:
    """``method``: ``Class.method``, the code that reads; ``read``: the expression."""
    where = "" if rank is None else f"[rank {rank}] "
    return ValueError(
        f"{where}{method} reads the whole averaged module ({read}); the shardlab strategy keeps the average"
        " as each rank's share of it, so no rank holds the module to read. HINT: leave the averaged module to the"
        " base class's own methods (override should_update, pass avg_fn or multi_avg_fn, override hooks, and SWA's"
        " update_parameters or transfer_weights, calling super() with it); read the average with"
        " trainer.strategy.full_state_dict(ema=True), called on every rank."
    )


def _is_user_class(cls: type) -> bool:
    return cls.__module__.split(".")[0] not in _MACHINERY


def _functions(value: Any) -> Iterator[types.FunctionType]:
    """The plain functions behind a class attribute (methods, static and class methods, properties, wrappers)."""
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    if isinstance(value, property):
        for accessor in (value.fget, value.fset, value.fdel):
            yield from _functions(accessor)
        return
    if isinstance(value, functools.partialmethod):
        value = value.func
    if callable(value):
        value = inspect.unwrap(value)
    if isinstance(value, types.FunctionType):
        yield value


def _average_arguments(name: str, function: types.FunctionType, arguments: dict[str, int]) -> set[str]:
    """The parameter names under which ``function`` (the attribute ``name``) receives the average."""
    if name not in arguments:
        return set()
    code = function.__code__
    names = code.co_varnames[: code.co_argcount]
    bound = 0 if names[:1] != ("self",) else 1  # a static method takes the average first
    index = bound + arguments[name]
    return {names[index]} if index < len(names) else set()


def _holds_average(instruction: dis.Instruction, names: set[str]) -> bool:
    if instruction.opname in _ATTRIBUTE_READS:
        return instruction.argval == "_average_model"
    if instruction.opname == "LOAD_FAST_LOAD_FAST":  # Python 3.13: two locals at once, the second is on top
        return instruction.argval[1] in names
    return instruction.opname in ("LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_DEREF") and instruction.argval in names


def _first_read(code: types.CodeType, names: set[str], allowed: frozenset[str]) -> str | None:
    """Where ``code`` (or a function nested in it) reads the averaged module: the expression, or None."""
    instructions = [i for i in dis.get_instructions(code) if i.opname not in ("CACHE", "EXTENDED_ARG")]
    for held, after in zip(instructions, instructions[1:]):
        if not _holds_average(held, names):
            continue
        what = "self._average_model" if held.opname in _ATTRIBUTE_READS else str(held.argval)
        if after.opname in _ATTRIBUTE_READS and after.argval not in allowed:
            return f"{what}.{after.argval}"
        if after.opname in _WHOLE_READS:
            return f"{what}[...]" if after.opname == "BINARY_SUBSCR" else f"iter({what})"
    for inner in code.co_consts:
        if isinstance(inner, types.CodeType):
            found = _first_read(inner, names, allowed)
            if found is not None:
                return found
    return None


def whole_average_reader(cls: type, allowed: frozenset[str], arguments: dict[str, int]) -> tuple[str, str] | None:
    """The first method of the user's classes in ``cls``'s MRO that reads the averaged module, with the read:
    ``(qualified method name, expression)``, or None. ``allowed``: attributes of the stand-in that mean what they
    mean under DDP; ``arguments``: method name -> index (after ``self``) of the parameter holding the average."""
    for owner in cls.__mro__:
        if not _is_user_class(owner):
            continue
        for name, value in vars(owner).items():
            for function in _functions(value):
                names = _average_arguments(name, function, arguments)
                read = _first_read(function.__code__, names, allowed)
                if read is not None:
                    return f"{owner.__name__}.{name}", read
    return None


def _calling_method() -> str:
    """The innermost user function on the stack (else the innermost outside this module), as ``Class.method``."""
    frame = sys._getframe(2)
    fallback = None
    while frame is not None:
        module = str(frame.f_globals.get("__name__", ""))
        code = frame.f_code
        qualname = getattr(code, "co_qualname", code.co_name)
        if module.split(".")[0] not in _MACHINERY:
            return qualname
        if fallback is None and module != __name__:
            fallback = qualname
        frame = frame.f_back
    return fallback or "?"


class StandIn:
    """Base of what a sharded averaging callback holds as ``_average_model``: any attribute it does not define is
    a read of the whole averaged module, refused naming the method that reads."""

    def __getattr__(self, name: str) -> NoReturn:
        if name.startswith("__"):
            raise AttributeError(name)
        raise whole_average_error(_calling_method(), f"self._average_model.{name}")
