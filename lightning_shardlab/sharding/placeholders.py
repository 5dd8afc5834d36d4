"""Reading a stage-3 module between steps fails loudly: its ``state_dict()`` would hold meta placeholders.

``refuse_placeholders`` is the state-dict hook the sharded model installs; ``placeholders_allowed`` lets the
checkpoint code list the keys (``state_dict(keep_vars=True)``) without reading any value.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import Tensor, nn


def refuse_placeholders(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    if not _listing.active and any(isinstance(v, Tensor) and v.is_meta for v in state_dict.values()):
        raise RuntimeError(
            f"{type(module).__name__}.state_dict() was called while its parameters are sharded (stage 3): each"
            " rank holds only a slice. HINT: call trainer.strategy.full_state_dict() on every rank (rank 0 gets the"
            " whole model), or save a checkpoint with trainer.save_checkpoint()."
        )


class _Listing:
    active = False


_listing = _Listing()  # while True, placeholders may be listed (never read)


@contextmanager
def placeholders_allowed() -> Iterator[None]:
    """Let ``module.state_dict(keep_vars=True)`` list placeholders (to learn its keys)."""
    previous, _listing.active = _listing.active, True
    try:
        yield
    finally:
        _listing.active = previous
