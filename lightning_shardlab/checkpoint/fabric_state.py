"""Fabric's ``state`` dicts in the checkpoint layout, and back.

``fabric.save(path, {"model": model, "optimizer": optimizer, "step": 5})`` holds modules, optimizers and plain
objects under the user's keys. The checkpoint code stores one sharded module's ``state_dict`` and its
optimizers' ``optimizer_states`` (what a Trainer checkpoint holds), so a Fabric checkpoint is laid out the same
way, with the user's keys recorded under ``FABRIC_KEYS``: the sharded format, its verification, resharding at
load and ``shardlab inspect`` are the same code for both front doors. Files for people (a full save,
``shardlab consolidate``) are written in the user's shape instead: ``{"model": full state dict, "optimizer":
unsharded optimizer state, "step": 5}``, as Fabric's own full save writes them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch import Tensor, nn
from torch.optim import Optimizer

FABRIC_KEYS = "shardlab_fabric"  # {"module": key, "optimizers": [keys, in saved order]}
LAYOUT_KEYS = ("state_dict", "optimizer_states")


def split_state(state: Mapping[str, Any], who: str) -> tuple[str, list[str], dict[str, Any]]:
    """The key of the one module, the keys of the optimizers (in ``state``'s order) and the other entries."""
    modules = [k for k, v in state.items() if isinstance(v, nn.Module)]
    if len(modules) != 1:
        raise ValueError(
            f"{who}: a shardlab checkpoint holds exactly one sharded module, got {len(modules)} ({modules}). HINT:"
            " save each model (with its optimizers) under a path of its own."
        )
    clashes = [k for k in LAYOUT_KEYS + (FABRIC_KEYS,) if k in state]
    if clashes:
        raise ValueError(f"{who}: the state keys {clashes} are reserved by shardlab checkpoints. HINT: rename them.")
    optimizers = [k for k, v in state.items() if isinstance(v, Optimizer)]
    rest = {k: v for k, v in state.items() if k not in modules and k not in optimizers}
    return modules[0], optimizers, rest


def plain(value: Any) -> Any:
    """A stateful object (LR scheduler, sampler, ...) as its ``state_dict()``; anything else as it is."""
    return value.state_dict() if callable(getattr(value, "state_dict", None)) else value


def to_user_shape(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """A full checkpoint in the layout, back in the user's keys (a Trainer checkpoint is returned as it is)."""
    keys = checkpoint.get(FABRIC_KEYS)
    if keys is None:
        return checkpoint
    out = {k: v for k, v in checkpoint.items() if k not in LAYOUT_KEYS and k != FABRIC_KEYS}
    out[keys["module"]] = checkpoint["state_dict"]
    for key, saved in zip(keys["optimizers"], checkpoint.get("optimizer_states", [])):
        out[key] = saved
    return out


def to_layout(checkpoint: dict[str, Any], state: Mapping[str, Any]) -> dict[str, Any]:
    """A loaded checkpoint in the layout: a Fabric full file (user keys, found through ``state``'s objects) is
    rearranged; a checkpoint already in the layout is returned as it is."""
    if FABRIC_KEYS in checkpoint or "state_dict" in checkpoint:
        return checkpoint
    module, optimizers, _ = split_state(state, "fabric.load")
    out = {k: v for k, v in checkpoint.items() if k != module and k not in optimizers}
    out["state_dict"] = checkpoint.get(module, {})
    out["optimizer_states"] = [checkpoint[k] for k in optimizers if k in checkpoint]
    out[FABRIC_KEYS] = {"module": module, "optimizers": [k for k in optimizers if k in checkpoint]}
    return out


def saved_optimizer_keys(checkpoint: Mapping[str, Any], optimizer_keys: list[str]) -> list[str]:
    """The keys of the saved optimizer states, in saved order; they must be the optimizers given to load."""
    saved = checkpoint.get(FABRIC_KEYS, {}).get("optimizers", optimizer_keys)
    if sorted(saved) != sorted(optimizer_keys):
        raise ValueError(
            f"the checkpoint holds optimizer states under {saved}, but fabric.load was given optimizers under"
            f" {optimizer_keys}. HINT: pass the same optimizers, under the same keys, as when it was saved."
        )
    return list(saved)


def restore_plain(
    state: dict[str, Any], checkpoint: Mapping[str, Any], keys: list[str], strict: bool, check: Callable
) -> dict[str, Any]:
    """Put the saved plain entries back into ``state`` (stateful objects load theirs); return the rest."""
    saved = {k: v for k, v in checkpoint.items() if not k.startswith("shardlab") and k not in LAYOUT_KEYS}
    check(keys, saved.keys(), strict=strict)
    for key in keys:
        if key not in saved:
            continue
        value = saved.pop(key)
        if callable(getattr(state[key], "load_state_dict", None)):
            state[key].load_state_dict(value)
        else:
            state[key] = value
    return saved


def full_parts(checkpoint: Mapping[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The module state dict and the optimizer states of a full checkpoint in either shape: a Trainer's
    (``state_dict``, ``optimizer_states``) or a Fabric's (the user's keys: one module state dict, and each
    optimizer's ``{"state", "param_groups"}``, in saved order)."""
    if "state_dict" in checkpoint:
        return checkpoint["state_dict"], list(checkpoint.get("optimizer_states", []))
    optimizers = [v for v in checkpoint.values() if isinstance(v, Mapping) and {"state", "param_groups"} <= set(v)]
    return weights_of(dict(checkpoint), "state_dict")["state_dict"], optimizers


def weights_of(checkpoint: dict[str, Any], source_key: str) -> dict[str, Any]:
    """A loaded checkpoint as ``load_model`` reads it, whichever front door wrote it: a sharded directory or a
    Trainer file as it is; a plain state dict file, or a Fabric full file with one state dict in it, wrapped."""
    if source_key in checkpoint or "state_dict" in checkpoint:
        return checkpoint
    if all(isinstance(v, Tensor) for v in checkpoint.values()):
        return {"state_dict": checkpoint}
    dicts = [
        k for k, v in checkpoint.items() if isinstance(v, dict) and v and all(isinstance(t, Tensor) for t in v.values())
    ]
    if len(dicts) != 1:
        raise ValueError(
            f"the checkpoint holds no single module state dict (entries: {sorted(checkpoint)[:8]}). HINT: load it"
            " with torch.load and pass the module's state dict, or load the whole state with fabric.load."
        )
    return {"state_dict": checkpoint[dicts[0]]}
