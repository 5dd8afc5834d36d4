"""Vital signs per rank, as a Lightning callback: loss, gradient norm, activations per unit, update ratio.

The four vital signs of training (loss, gradient norm, activation distribution, update ratio) behave a
little differently on each rank when distributed training goes wrong, while rank 0's curves can look
fine. ``ShardLabVitals`` measures them on every rank every ``every_n_steps`` steps:

    loss              this rank's loss (its own micro-batch), as ``training_step`` returned it
    grad_norm_local   the 2-norm of this rank's part of the gradient (its grad shards, before clipping);
                      parts partition the gradient, so grad_norm (global) = sqrt(sum over ranks of local^2)
    act_mean/std/absmax/<unit>   statistics of each unit's output on this rank's data
    update_ratio/<unit>          |Δw| / |w| of this rank's master shard of the unit in this optimizer step

One all-gather per logged step (a few floats per unit and rank) brings every rank's signs to rank 0,
which logs them to the Trainer's loggers as ``vitals/<signal>/rank<r>`` (and ``vitals/grad_norm``) and,
when training ends, writes the dashboard (dashboard.py): vitals.png and vitals.html overlaying the
ranks with outliers marked, and vitals.json with the numbers.

Units are shardlab's units under ``ShardLabStrategy``; under another strategy, the LightningModule's
children that hold parameters (then every rank holds whole gradients: the local norm is the global one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils import _pytree as pytree

from lightning_shardlab import collectives
from lightning_shardlab.dashboard import GLOBAL, VitalsHistory, write_dashboard


@dataclass
class VitalUnit:
    name: str
    module: nn.Module
    masters: list[Tensor]  # what its optimizer updates on this rank (1-D master shards, or whole parameters)


def vital_units(trainer: L.Trainer, pl_module: L.LightningModule) -> tuple[list[VitalUnit], bool]:
    """The units to watch, and whether the gradient is sharded (local parts partition it)."""
    sharded = getattr(trainer.strategy, "sharded", None)
    if sharded is not None:
        return [VitalUnit(u.name, u.module, [fp.master for fp in u.flat_params if fp.layout.requires_grad])
                for u in sharded.units], True
    return [VitalUnit(name, child, [p for p in child.parameters() if p.requires_grad])
            for name, child in pl_module.named_children() if any(True for _ in child.parameters())], False


class ActivationStats:
    """Forward hooks that record (mean, std, max |x|) of each unit's output while ``active``."""

    def __init__(self, units: list[VitalUnit]) -> None:
        self.active = False
        self.sums: dict[str, list[float]] = {}  # unit -> [calls, mean, std, absmax] summed over calls
        self.handles = [u.module.register_forward_hook(self._hook(u.name)) for u in units]

    def _hook(self, name: str):  # noqa: ANN202
        def record(module: nn.Module, args: Any, output: Any) -> None:
            if not self.active:
                return
            x = next((t for t in pytree.tree_leaves(output) if isinstance(t, Tensor) and t.is_floating_point()), None)
            if x is None or x.numel() == 0:
                return
            with torch.no_grad():
                x = x.detach().float()
                stats = torch.stack([x.mean(), x.std(correction=0), x.abs().max()]).tolist()
            acc = self.sums.setdefault(name, [0.0, 0.0, 0.0, 0.0])
            acc[0] += 1
            acc[1] += stats[0]
            acc[2] += stats[1]
            acc[3] = max(acc[3], stats[2])

        return record

    def take(self, name: str) -> list[float]:
        """(mean, std, max |x|) averaged over this step's calls (NaN if the unit did not run)."""
        calls, mean, std, absmax = self.sums.get(name, [0.0, 0.0, 0.0, 0.0])
        return [mean / calls, std / calls, absmax] if calls else [math.nan] * 3

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


class ShardLabVitals(L.Callback):
    """Per-rank vital signs, logged per rank, and a dashboard (PNG + HTML) when training ends.

    Args:
        every_n_steps: measure every K-th training batch (activation statistics, a copy of the master
            shards for the update ratio and one small all-gather cost time on those steps only).
        dashboard_dir: where vitals.png/html/json go; default ``<trainer.log_dir or default_root_dir>/vitals``.
        outlier_z: how many robust scales from the median of the ranks make an outlier (dashboard.py).
    """

    def __init__(self, every_n_steps: int = 1, dashboard_dir: str | None = None, outlier_z: float = 6.0) -> None:
        if not isinstance(every_n_steps, int) or isinstance(every_n_steps, bool) or every_n_steps < 1:
            raise ValueError(f"`every_n_steps={every_n_steps!r}` is invalid: expected an integer >= 1.")
        if not (isinstance(outlier_z, (int, float)) and outlier_z > 0):
            raise ValueError(f"`outlier_z={outlier_z!r}` is invalid: expected a positive number.")
        try:
            import matplotlib  # noqa: F401
        except ImportError as error:
            raise ImportError("ShardLabVitals draws its dashboard with matplotlib. HINT: pip install"
                              " 'lightning-shardlab[plot]' (or matplotlib).") from error
        self.every_n_steps, self.dashboard_dir, self.outlier_z = every_n_steps, dashboard_dir, outlier_z
        self.units: list[VitalUnit] = []
        self.sharded_grads = False
        self.activations: ActivationStats | None = None
        self.batches = 0
        self.steps: list[int] = []
        self.rows: list[np.ndarray] = []  # rank 0: (world, signals) per logged step
        self.paths: dict[str, Path] = {}
        self._grad_sq = math.nan
        self._before: list[list[Tensor]] | None = None

    @property
    def signals(self) -> list[str]:
        per_unit = [f"{kind}/{u.name}" for u in self.units for kind in ("act_mean", "act_std", "act_absmax", "update_ratio")]
        return ["loss", "grad_norm_local", *per_unit]

    # ---- hooks ----

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.units, self.sharded_grads = vital_units(trainer, pl_module)
        self.activations = ActivationStats(self.units)
        self.batches, self.steps, self.rows = 0, [], []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        assert self.activations is not None
        self.activations.active = self.batches % self.every_n_steps == 0
        self.activations.sums.clear()
        self._grad_sq, self._before = math.nan, None

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Optimizer) -> None:
        if not (self.activations and self.activations.active):
            return
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        sq = sum(float(torch.linalg.vector_norm(g.float()) ** 2) for g in grads)
        self._grad_sq = sq if math.isnan(self._grad_sq) else self._grad_sq + sq
        if self._before is None:  # several optimizers: the first one's call sees the weights before any step
            self._before = [[m.detach().clone() for m in u.masters] for u in self.units]

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        assert self.activations is not None
        if self.activations.active:
            self._record(trainer, self._measure(outputs))
        self.activations.active = False
        self.batches += 1

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # trainer.log_dir is a collective (it broadcasts rank 0's), so every rank asks
        directory = Path(self.dashboard_dir) if self.dashboard_dir else Path(trainer.log_dir or trainer.default_root_dir) / "vitals"
        if trainer.is_global_zero and self.rows:
            history = VitalsHistory(self.steps, [*self.signals, GLOBAL], np.stack(self.rows),
                                    f"shardlab vital signs: {type(pl_module).__name__}, {trainer.world_size} ranks")
            self.paths = write_dashboard(history, directory, self.outlier_z)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.activations is not None:
            self.activations.remove()
            self.activations = None

    # ---- measuring, gathering, logging ----

    def _measure(self, outputs: Any) -> Tensor:
        """This rank's row of signs. 1-D float64, numel len(self.signals)."""
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        row = [float(loss) if isinstance(loss, Tensor) and loss.numel() == 1 else math.nan, math.sqrt(self._grad_sq)]
        assert self.activations is not None
        for i, unit in enumerate(self.units):
            row += self.activations.take(unit.name)
            row.append(self._update_ratio(i, unit))
        return torch.tensor(row, dtype=torch.float64)

    def _update_ratio(self, i: int, unit: VitalUnit) -> float:
        if self._before is None or sum(m.numel() for m in unit.masters) == 0:
            return math.nan
        delta = sum(float(torch.linalg.vector_norm((m.detach() - b).double()) ** 2) for m, b in zip(unit.masters, self._before[i]))
        weight = sum(float(torch.linalg.vector_norm(b.double()) ** 2) for b in self._before[i])
        return math.sqrt(delta / weight) if weight > 0 else math.nan

    def _record(self, trainer: L.Trainer, row: Tensor) -> None:
        everyone = self._gather(trainer, row).numpy()  # (world, signals)
        if not trainer.is_global_zero:
            return
        world = everyone.shape[0]
        metrics = {f"vitals/{s}/rank{r}": float(everyone[r, k]) for k, s in enumerate(self.signals)
                   for r in range(world) if not math.isnan(everyone[r, k])}
        metrics[f"vitals/{GLOBAL}"] = self._global_norm(everyone[:, 1])
        self.steps.append(self.batches)
        self.rows.append(np.concatenate([everyone, np.full((world, 1), metrics[f"vitals/{GLOBAL}"])], axis=1))
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=self.batches)

    def _global_norm(self, local: np.ndarray) -> float:
        if np.isnan(local).all():
            return math.nan  # no optimizer step in this batch (gradient accumulation)
        return float(math.sqrt(np.nansum(local**2))) if self.sharded_grads else float(np.nanmax(local))

    @staticmethod
    def _gather(trainer: L.Trainer, row: Tensor) -> Tensor:
        """Every rank's row on every rank: (world, signals), CPU."""
        comm = getattr(trainer.strategy, "comm", None)
        if comm is not None:
            out = torch.empty(comm.world_size * row.numel(), dtype=row.dtype, device=comm.device)
            collectives.all_gather(out, row.to(comm.device), comm, label="vital signs", kind="vitals")
            return out.view(comm.world_size, -1).cpu()
        gathered = trainer.strategy.all_gather(row.to(trainer.strategy.root_device))
        return gathered.reshape(trainer.world_size, -1).cpu()
