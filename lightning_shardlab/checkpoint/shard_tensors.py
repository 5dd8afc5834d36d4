"""What one rank's shard file of a sharded checkpoint holds: its slice of every master shard (and of
ShardLabEMA's averages) and of every per-element optimizer state tensor, unpadded, by flat parameter.

Written from where the tensors lie when it can (a shard that is its storage's only content, an offload
file); with ``copy`` (an asynchronous save: training goes on while the file is written) every tensor is a
copy taken now.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_shardlab.checkpoint.format import EMA, dtype_name, master_key, optim_key, saved_range
from lightning_shardlab.checkpoint.full import optimizer_index
from lightning_shardlab.sharding.flat_param import FlatParam
from lightning_shardlab.sharding.sharded_model import ShardedModel


def shard_tensors(
    sharded: ShardedModel,
    optimizers: list[Optimizer],
    states: list[Mapping[str, Any]],
    agreed: list[dict[str, Any]],
    copy: bool = False,
) -> tuple[dict[str, Tensor], list[dict[str, str]]]:
    """This rank's shard file content, and per flat parameter the tensor kinds every shard file holds."""
    tensors: dict[str, Tensor] = {}
    kinds: list[dict[str, str]] = []
    fps = sharded.flat_params
    averaged = sharded.averages.shards if sharded.averages is not None else [None] * len(fps)
    for fp, avg in zip(fps, averaged):
        lo, hi = saved_range(fp.layout, fp.rank)
        tensors[master_key(fp.layout.name)] = _saved(fp.master, hi - lo, copy)
        kinds.append({"master": dtype_name(fp.master.dtype)})
        if avg is not None:  # ShardLabEMA's average of this shard
            tensors[f"{EMA}/{fp.layout.name}"] = _saved(avg, hi - lo, copy)
            kinds[-1][EMA] = dtype_name(avg.dtype)
    for o, (optimizer, state, plan) in enumerate(zip(optimizers, states, agreed)):
        index = optimizer_index(optimizer, sharded)
        keys_per_fp: dict[int, dict[str, str]] = {}
        members: dict[int, list[int]] = {}  # id(flat param) -> its parameter indices in this optimizer
        for j, (_, owner, _) in enumerate(index):
            members.setdefault(id(owner), []).append(j)
        for j, keys in plan["per_element"].items():
            keys_per_fp.setdefault(id(index[j][1]), {}).update(keys)
        for f, fp in enumerate(fps):
            lo, hi = saved_range(fp.layout, fp.rank)
            for key, dtype in sorted(keys_per_fp.get(id(fp), {}).items()):
                values = [(j, state["state"].get(j, {}).get(key)) for j in members[id(fp)]]
                flat = _state_from_file(sharded, optimizer, fp, key, [v for _, v in values], hi - lo)
                flat = flat.clone() if flat is not None and copy else flat
                if flat is None:
                    flat = torch.zeros(hi - lo, dtype=getattr(torch, dtype))  # 1-D, this rank's unpadded elements
                    for j, value in values:
                        if value is not None:
                            a, b = fp.layout.slot_in_shard(fp.layout.slots[index[j][2]], fp.rank)
                            flat[a:b] = value.detach().reshape(-1).to("cpu")
                tensors[optim_key(o, key, fp.layout.name)] = flat
                kinds[f][f"optim{o}/{key}"] = dtype
    return tensors, kinds


def _saved(tensor: Tensor, n: int, copy: bool) -> Tensor:
    """What a shard file holds of ``tensor`` (1-D): its first ``n`` elements. A CPU tensor that is its storage's
    only content (a stage 3 shard, a master of its own, an offload file) is written from where it lies, not
    copied first (``torch.save`` writes a view's whole storage: the padding's few elements come along);
    anything else (a view of a resident full buffer, a device tensor) is copied out."""
    alone = tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    if tensor.device.type == "cpu" and alone and not copy:
        return tensor[:n].detach()
    return tensor[:n].detach().to("cpu", copy=True)


def _state_from_file(
    sharded: ShardedModel, optimizer: Optimizer, fp: FlatParam, key: str, values: list[Tensor | None], n: int
) -> Tensor | None:
    """The offload file of ``optimizer``'s state ``key`` for ``fp`` when every parameter's value is a view of it
    (or empty: a parameter outside this shard), written from the file's pages; else None (copied out)."""
    offload = sharded.offload
    file = offload.state_file(optimizer, fp, key) if offload is not None and offload.tier == "disk" else None
    if file is None:
        return None
    ptr = file.untyped_storage().data_ptr()
    inside = all(v is not None and (v.numel() == 0 or v.untyped_storage().data_ptr() == ptr) for v in values)
    return file[:n] if inside else None
