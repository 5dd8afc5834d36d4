"""Error feedback in checkpoints: each rank's int8 reduction residuals (``reduce_dtype='int8'``), saved and restored.

A residual is what this rank's packing of its gradients lost so far (sharding/flat_param.py ``residual``), added to
its next gradient; it differs between ranks and is not part of any parameter. It rides in the checkpoint dict under
``ERROR_FEEDBACK`` (flat parameter name -> 1-D fp32 tensor), so the per-rank side state (checkpoint/rank_state.py)
keeps every rank's own in either format, and a resume on as many ranks continues bit for bit. On another number of
ranks the layout of the residuals changes with the shards: they restart at zero (rank_state.py), as error feedback
does at the first step, and a warning says so.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch

from lightning_shardlab.checkpoint.rank_state import ERROR_FEEDBACK
from lightning_shardlab.sharding.sharded_model import ShardedModel


def stow(checkpoint: dict[str, Any], sharded: ShardedModel) -> None:
    """Every rank: its residuals into ``checkpoint`` (nothing when no flat parameter keeps one)."""
    kept = {fp.layout.name: fp.residual.clone() for fp in sharded.flat_params if fp.residual is not None}
    if kept:
        checkpoint[ERROR_FEEDBACK] = kept


def restore(sharded: ShardedModel, checkpoint: Mapping[str, Any]) -> None:
    """Every rank: its saved residuals back into the flat parameters that keep one (zeros where none was saved)."""
    saved = checkpoint.get(ERROR_FEEDBACK) or {}
    restarted = []
    for fp in sharded.flat_params:
        value = saved.get(fp.layout.name)
        if not fp.error_feedback:
            fp.residual = None
        elif isinstance(value, torch.Tensor) and value.numel() == fp.layout.padded_numel:
            fp.residual_buffer().copy_(value)
        else:
            fp.residual = None
            restarted.append(fp.layout.name)
    if restarted and saved and sharded.comm.rank == 0:
        warnings.warn(
            f"the checkpoint holds no int8 error-feedback residual for {', '.join(restarted)} on this layout (saved on"
            " another number of ranks, or without reduce_dtype='int8'): it restarts at zero.",
            stacklevel=3,
        )
