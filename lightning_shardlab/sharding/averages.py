"""Averaged weights, kept sharded: each rank averages its own master shards (no communication per update).

``Averages`` is the state; ``ShardLabEMA`` (trainer/ema.py), ``ShardLabSWA`` (trainer/swa.py) and
``ShardLabWeightAveraging`` (trainer/weight_averaging.py) decide when to update it: ShardLabSWA by its own rule
(``update_with``), Lightning's ``WeightAveraging`` by torch's ``AveragedModel`` code itself (``update_like_torch``),
ShardLabEMA by torch's ``AveragedModel`` with ``get_ema_avg_fn(decay)`` (``update``), applied to this rank's slice:
the first update copies the weights, later ones compute ``decay * average + (1 - decay) * weights``. Every rule is
elementwise, so the slices of the unsharded average and the averages of the slices are the same numbers, bit for bit.

    shards[i]    1-D, S, master dtype: the average of flat parameter i's master shard (a frozen one too: it may
                 be unfrozen later, as BaseFinetuning does)
    buffers      name -> tensor: the buffers averaged the same way (``use_buffers``), else their values at
                 the last update (AveragedModel keeps its buffers in sync with the model's then)
    n_averaged   updates so far (0: the average still holds the weights it was made from)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim.swa_utils import AveragedModel

from lightning_shardlab.sharding.flat_param import FlatParam
from lightning_shardlab.sharding.sharded_model import ShardedModel


class Averages:
    def __init__(self, sharded: ShardedModel, use_buffers: bool = True) -> None:
        self.use_buffers = use_buffers
        self.shards: list[Tensor | None] = [fp.master.detach().clone() for fp in sharded.flat_params]
        self.buffers: dict[str, Tensor] = {n: b.detach().clone() for n, b in sharded.module.named_buffers()}
        self.n_averaged = 0

    def shard_of(self, sharded: ShardedModel, fp: FlatParam) -> Tensor:
        """The averaged values of ``fp``'s shard (1-D, S): its own master when it is frozen."""
        avg = self.shards[sharded.flat_params.index(fp)]
        return fp.master if avg is None else avg

    @torch.no_grad()
    def update(self, sharded: ShardedModel, decay: float) -> None:
        """One EMA update from the current master shards and buffers (AveragedModel.update_parameters)."""
        for fp, avg in zip(sharded.flat_params, self.shards):
            if avg is not None:
                avg.copy_(fp.master if self.n_averaged == 0 else decay * avg + (1 - decay) * fp.master)
        for name, buf in sharded.module.named_buffers():
            avg = self.buffers[name]
            average = self.use_buffers and self.n_averaged > 0
            avg.copy_(decay * avg + (1 - decay) * buf.to(avg.device) if average else buf)
        self.n_averaged += 1

    @torch.no_grad()
    def update_with(self, sharded: ShardedModel, avg_fn: Callable[[Tensor, Tensor, Tensor], Tensor], n: Tensor) -> None:
        """One update by ``avg_fn(average, weights, n)`` (StochasticWeightAveraging's rule: by default the
        running mean), on this rank's slices; the first update copies the weights. The buffers keep the
        model's values (SWA averages parameters only). ``avg_fn`` must be elementwise, as the default is."""
        for fp, avg in zip(sharded.flat_params, self.shards):
            if avg is not None:
                avg.copy_(fp.master if self.n_averaged == 0 else avg_fn(avg, fp.master, n.to(avg.device)))
        for name, buf in sharded.module.named_buffers():
            self.buffers[name].copy_(buf)
        self.n_averaged += 1

    @torch.no_grad()
    def update_like_torch(self, sharded: ShardedModel, avg_fn: Callable | None, multi_avg_fn: Callable | None) -> None:
        """One update by torch's own ``AveragedModel.update_parameters``, run on this rank's slices (Lightning's
        ``WeightAveraging``: ``avg_fn`` or ``multi_avg_fn`` as its user passed them). Torch's code, not a copy of
        it: the first update's copy, the choice between a foreach and a per-tensor rule (by device), and the
        buffers (averaged with ``use_buffers``, else kept in step with the model's) are torch's. Any rule that
        treats each element on its own (every rule torch provides) gives the slices of the unsharded average."""
        average = AveragedModel.__new__(AveragedModel)
        nn.Module.__init__(average)
        average.module = _AsModule([a for a in self.shards if a is not None], list(self.buffers.values()))
        device = next(iter(average.module.parameters())).device
        average.register_buffer("n_averaged", torch.tensor(self.n_averaged, dtype=torch.long, device=device))
        average.avg_fn, average.multi_avg_fn, average.use_buffers = avg_fn, multi_avg_fn, self.use_buffers
        masters = [fp.master for fp, a in zip(sharded.flat_params, self.shards) if a is not None]
        buffers = dict(sharded.module.named_buffers())
        average.update_parameters(_AsModule(masters, [buffers[name] for name in self.buffers]))
        self.n_averaged += 1

    @torch.no_grad()
    def swap(self, sharded: ShardedModel) -> None:
        """Exchange the weights and buffers with the average (collective at stages 1-2: the resident full
        buffers are re-gathered). Swapping twice restores both, bit for bit."""
        changed = set()
        for fp, avg in zip(sharded.flat_params, self.shards):
            if avg is not None:
                current = fp.master.detach().clone()
                fp.master.copy_(avg)
                avg.copy_(current)
                changed.add(fp)
        for name, buf in sharded.module.named_buffers():
            current = buf.detach().clone()
            buf.copy_(self.buffers[name])
            self.buffers[name].copy_(current)
        sharded.refresh(changed)

    @torch.no_grad()
    def apply(self, sharded: ShardedModel, buffers: bool = True) -> None:
        """The weights (and ``buffers``) take the average's values (collective at stages 1-2)."""
        changed = set()
        for fp, avg in zip(sharded.flat_params, self.shards):
            if avg is not None:
                fp.master.copy_(avg)
                changed.add(fp)
        for name, buf in sharded.module.named_buffers() if buffers else ():
            buf.copy_(self.buffers[name])
        sharded.refresh(changed)

    # ---- checkpoints: the shards travel with the masters; the rest is this record (checkpoint_format.EMA_RECORD) ----

    def record(self) -> dict[str, Any]:
        return {
            "n_averaged": self.n_averaged,
            "use_buffers": self.use_buffers,
            "buffers": {n: b.detach().to("cpu", copy=True) for n, b in self.buffers.items()},
        }

    @torch.no_grad()
    def restart(self, sharded: ShardedModel) -> None:
        """Start again from the current weights (a checkpoint saved without an average was loaded: the
        average starts from its weights, as with Lightning's weight averaging)."""
        for fp, avg in zip(sharded.flat_params, self.shards):
            if avg is not None:
                avg.copy_(fp.master)
        for name, buf in sharded.module.named_buffers():
            self.buffers[name].copy_(buf)
        self.n_averaged = 0

    @torch.no_grad()
    def load_record(self, record: dict[str, Any]) -> None:
        """Take a checkpoint's record (its shards were loaded with the masters)."""
        self.n_averaged = int(record["n_averaged"])
        for name, value in record["buffers"].items():
            if name in self.buffers:
                self.buffers[name].copy_(value)


class _AsModule(nn.Module):
    """Tensors presented as a module's parameters and buffers, sharing their storage: what torch's
    ``AveragedModel.update_parameters`` reads and writes in place (``parameters()``, ``buffers()``, in order)."""

    def __init__(self, params: list[Tensor], buffers: list[Tensor]) -> None:
        super().__init__()
        self.params = nn.ParameterList(nn.Parameter(t.detach(), requires_grad=False) for t in params)
        for i, buf in enumerate(buffers):
            self.register_buffer(f"buffer{i}", buf)
