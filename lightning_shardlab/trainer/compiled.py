"""``trainer.fit(torch.compile(model))``: a compiled LightningModule under ``ShardLabStrategy``.

Lightning takes a compiled module apart before any strategy sees it (``from_compiled``): the original
LightningModule, its ``forward`` and ``*_step`` methods wrapped by the compiler. Those wrappers compile lazily, at
their first call, so when the strategy has sharded the module in ``setup`` the compiler traces the sharded module:
the whole step, its graph broken where the engine's hooks gather, free or reduce. Nothing else is needed, and
``to_uncompiled`` gives the original methods back afterwards, as under DDP.

What stands in the way is Lightning's check before each loop (``_verify_strategy_supports_compile``), which allows
only its single-device, DDP and FSDP strategies. Its list is local to the function, so it cannot be extended: the
function the Trainer calls is replaced, once, by one that accepts the strategies named here and asks Lightning's own
check about every other strategy.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch.trainer.trainer as trainer_module

_ACCEPTED: set[type] = set()


def accept_compiled_modules(strategy_class: type) -> None:
    """Let ``strategy_class`` (and its subclasses) run a compiled module in ``fit``, ``validate``, ``test`` and
    ``predict``; called once at import, by the strategy's module."""
    _ACCEPTED.add(strategy_class)
    lightning_check = trainer_module._verify_strategy_supports_compile
    if getattr(lightning_check, "accepts", None) is _ACCEPTED:
        return

    def verify_strategy_supports_compile(model: Any, strategy: Any) -> None:
        if not isinstance(strategy, tuple(_ACCEPTED)):
            lightning_check(model, strategy)

    verify_strategy_supports_compile.accepts = _ACCEPTED  # type: ignore[attr-defined]
    trainer_module._verify_strategy_supports_compile = verify_strategy_supports_compile
