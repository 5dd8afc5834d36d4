"""Hugging Face ``transformers``, optional and offline: the import and the local-only loading the examples share.

``transformers`` is an optional extra (``pip install 'lightning-shardlab[hf]'``), so it is imported only
when a module that needs it is built; the package imports without it. Weights, configs and tokenizers
are always loaded with ``local_files_only=True``: a directory written by ``save_pretrained`` or a model
already in the local Hugging Face cache. Nothing is ever downloaded.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any, TypeVar

T = TypeVar("T")

INSTALL_HINT = "HINT: pip install 'lightning-shardlab[hf]' (or pip install transformers)."
FETCH_HINT = (
    "HINT: give a directory written by save_pretrained(), or fetch the model once on a machine with network and"
    " point the option at that directory, e.g. `hf download openai-community/gpt2 --local-dir gpt2`."
)


def require_transformers(option: str) -> ModuleType:
    """The ``transformers`` module; if it is missing, an ImportError naming ``option`` (what needs it)."""
    try:
        import transformers
    except ImportError as err:
        raise ImportError(
            f"`{option}` needs the optional package `transformers`, which is not installed. {INSTALL_HINT}"
        ) from err
    return transformers


def from_local(load: Callable[..., T], name: str, option: str, **kwargs: Any) -> T:
    """``load(name, local_files_only=True, **kwargs)`` for a ``from_pretrained``; a ValueError naming ``option``
    when ``name`` is neither a local directory with the files nor a model in the local cache."""
    try:
        return load(name, local_files_only=True, **kwargs)
    except OSError as err:  # transformers raises OSError for a missing directory, file or cache entry
        raise ValueError(
            f"`{option}={name!r}` is neither a local directory with the files nor a model in the local Hugging Face"
            f" cache (nothing is downloaded: local_files_only=True). {FETCH_HINT}"
        ) from err
