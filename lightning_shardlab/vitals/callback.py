"""Vital signs per rank, as a Lightning callback: loss, gradient norm, activations per unit, update ratio.

The four vital signs of training (loss, gradient norm, activation distribution, update ratio) behave a
little differently on each rank when distributed training goes wrong, while rank 0's curves can look
fine. ``ShardLabVitals`` measures them every ``every_n_steps`` steps, so that healthy ranks' curves lie
on top of each other and an odd rank stands out. Two kinds of sign:

per replica (each rank's own data: one curve per rank, overlaid)
    loss                      this rank's loss, as ``training_step`` returned it
    grad_norm_local/<unit>    the 2-norm of this rank's own gradient of the unit, read from the flat
                              gradient just before its reduce-scatter (with accumulation='reduce', the
                              root-sum-square over the step's micro-batches); ``grad_norm_local``: all units
    act_mean/std/absmax/<unit>  statistics of each unit's output on this rank's data
    step_seconds              this rank's wall time since the previous batch ended (the loader included)
    comm_blocked_seconds      of it, the seconds this rank was blocked on collectives (comm/ledger.py): the
                              rank the others wait for blocks least (the budget names such stragglers)

global (the same on every rank by construction: drawn once, in black, never an outlier)
    grad_norm                 the norm of the averaged gradient the optimizer steps with (before clipping)
    update_ratio/<unit>       |Δw| / |w| of the unit's weights in this optimizer step
    option_error/gather|reduce/<unit>  only where a fewer-bytes option is on (``gather_dtype``, ``reduce_dtype``):
                              the relative error it brings, against the masters and an exact reduction
                              (vitals/option_curves.py)

Shards are not compared with each other: rank r's shard is a different slice from rank s's, so shard
norms differ by construction. Global signs are summed from every rank's shard instead. Every sign is summed
where it is computed (on a GPU, on the device: the host reads nothing per unit or per gradient); one all-gather
per logged step (a few floats per unit and rank), read by the host once, brings every rank's signs to rank 0,
which logs them to the Trainer's loggers as ``vitals/<signal>/rank<r>`` (global ones as ``vitals/<signal>``) and, when
training ends, writes the dashboard (vitals/dashboard.py): vitals.png and vitals.html overlaying the ranks with
outliers marked, and vitals.json with the numbers; panels without data say why.

Units are shardlab's units under ``ShardLabStrategy``; under another strategy, the LightningModule's
children that hold parameters (there gradients are reduced before a callback sees them, so the
per-rank gradient norms are not measured).
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils import _pytree as pytree

from lightning_shardlab.comm import collectives
from lightning_shardlab.comm.host_reads import to_device, to_host
from lightning_shardlab.core.config import check_int, check_positive
from lightning_shardlab.sharding.lookup import sharded_model_of
from lightning_shardlab.vitals.dashboard import VitalsHistory, write_dashboard
from lightning_shardlab.vitals.option_curves import OptionCurves


@dataclass
class VitalUnit:
    name: str
    module: nn.Module
    masters: list[Tensor]  # what its optimizer updates on this rank (1-D master shards, or whole parameters)


def vital_units(trainer: L.Trainer, pl_module: L.LightningModule) -> tuple[list[VitalUnit], Any]:
    """The units to watch, and the sharded model (None under another strategy)."""
    sharded = sharded_model_of(trainer)
    if sharded is not None:
        return [
            VitalUnit(u.name, u.module, [fp.master for fp in u.flat_params if fp.layout.requires_grad])
            for u in sharded.units
        ], sharded
    return [
        VitalUnit(name, child, [p for p in child.parameters() if p.requires_grad])
        for name, child in pl_module.named_children()
        if any(True for _ in child.parameters())
    ], None


class ActivationStats:
    """Forward hooks that record (mean, std, max |x|) of each unit's output while ``active``."""

    def __init__(self, units: list[VitalUnit], device: torch.device) -> None:
        self.active, self.device = False, device
        self.sums: dict[str, Tensor] = {}  # unit -> [calls, mean, std, absmax] summed over calls, where it ran
        self.handles = [u.module.register_forward_hook(self._hook(u.name)) for u in units]

    def _hook(self, name: str):  # noqa: ANN202
        def record(module: nn.Module, args: Any, output: Any) -> None:
            if not self.active:
                return
            x = next((t for t in pytree.tree_leaves(output) if isinstance(t, Tensor) and t.is_floating_point()), None)
            if x is None or x.numel() == 0:
                return
            with torch.no_grad():
                x = x.detach().double()
                stats = torch.stack([torch.ones_like(x[(0,) * x.dim()]), x.mean(), x.std(correction=0), x.abs().max()])
                acc = self.sums.get(name)
                if acc is None:
                    self.sums[name] = stats
                else:  # summed where it lives: no read by the host
                    acc[:3] += stats[:3]
                    acc[3] = torch.maximum(acc[3], stats[3])

        return record

    def take(self, name: str) -> Tensor:
        """(mean, std, max |x|) averaged over this step's calls (NaN if the unit did not run): 1-D, 3, float64."""
        acc = self.sums.get(name)
        if acc is None:
            return torch.full((3,), math.nan, dtype=torch.float64, device=self.device)
        return torch.cat([acc[1:3] / acc[0], acc[3:]]).to(self.device)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


class ShardLabVitals(L.Callback):
    """Per-rank vital signs, logged per rank, and a dashboard (PNG + HTML) when training ends.

    Args:
        every_n_steps: measure every K-th training batch (activation statistics, gradient norms before the
            reduction, a copy of the master shards for the update ratio, and one small all-gather cost time
            on those steps only).
        dashboard_dir: where vitals.png/html/json go; default ``<trainer.log_dir or default_root_dir>/vitals``.
        outlier_z: how many robust scales from the median of the ranks make an outlier (vitals/dashboard.py).
    """

    def __init__(self, every_n_steps: int = 1, dashboard_dir: str | None = None, outlier_z: float = 6.0) -> None:
        check_int("every_n_steps", every_n_steps, 1)
        check_positive("outlier_z", outlier_z)
        try:
            import matplotlib  # noqa: F401
        except ImportError as error:
            raise ImportError(
                "ShardLabVitals draws its dashboard with matplotlib. HINT: pip install"
                " 'lightning-shardlab[plot]' (or matplotlib)."
            ) from error
        self.every_n_steps, self.dashboard_dir, self.outlier_z = every_n_steps, dashboard_dir, outlier_z
        self.units: list[VitalUnit] = []
        self.sharded: Any = None
        self.activations: ActivationStats | None = None
        self.options = OptionCurves(None)  # the fewer-bytes options' error curves (none with the defaults)
        self.batches = 0
        self.steps: list[int] = []
        self.rows: list[np.ndarray] = []  # rank 0: (world, per-rank signals + global signals) per logged step
        self.paths: dict[str, Path] = {}
        self.device: Any = None
        # summed on the device, read once per logged step with the row's all-gather:
        self._local_sq: dict[str, Tensor] = {}  # unit -> this rank's pre-reduction gradient norm^2, this step
        self._shard_grad_sq: Tensor | None = None  # this rank's part of the reduced gradient, norm^2
        self._before: list[list[Tensor]] | None = None

    @property
    def signals(self) -> list[str]:
        """The per-rank signals, in row order."""
        kinds = ("act_mean", "act_std", "act_absmax", "grad_norm_local")
        timing = ("step_seconds", "comm_blocked_seconds")
        return ["loss", "grad_norm_local", *timing, *(f"{kind}/{u.name}" for u in self.units for kind in kinds)]

    @property
    def global_signals(self) -> list[str]:
        return ["grad_norm", *(f"update_ratio/{u.name}" for u in self.units), *self.options.signals]

    # ---- hooks ----

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        units, sharded = vital_units(trainer, pl_module)
        gather = functools.partial(self._gather, trainer)
        title, device = type(pl_module).__name__, trainer.strategy.root_device
        self._start(units, sharded, trainer.is_global_zero, list(trainer.loggers), gather, title, device)

    def _start(
        self, units: list[VitalUnit], sharded: Any, zero: bool, loggers: list, gather: Any, title: str, device: Any
    ) -> None:
        self.units, self.sharded, self.device = units, sharded, device
        self._zero, self._loggers, self._gather_row, self._title = zero, loggers, gather, title
        self.activations = ActivationStats(self.units, device)
        self.options = OptionCurves(sharded)
        if self.sharded is not None:
            self.sharded.grad_observers.append(self._observe_flat_grad)
        self.batches, self.steps, self.rows = 0, [], []
        self._clock = (time.perf_counter(), self._blocked())  # at the end of the previous batch

    def _blocked(self) -> float:
        return self.sharded.comm.ledger.blocked_seconds if self.sharded is not None else math.nan

    def _timing(self) -> list[float]:
        """This batch's wall time and seconds blocked on collectives, since the previous batch ended."""
        now, blocked = time.perf_counter(), self._blocked()
        (then, before), self._clock = self._clock, (now, blocked)
        return [now - then, blocked - before]

    # ---- a Fabric loop: the same hooks, called by hand ----

    def watch(self, fabric: Any, model: Any) -> None:
        """Start watching ``model`` (set up by the shardlab Fabric strategy): then ``step_start()`` before each
        optimizer step's first forward, ``before_optimizer_step(optimizer)``, ``step_end(loss)`` after the step,
        and ``finish()`` (every rank; rank 0 writes the dashboard) at the end."""
        sharded = fabric.strategy.sharded_model(model)
        units = [VitalUnit(u.name, u.module, [fp.master for fp in u.flat_params if fp.layout.requires_grad])
                 for u in sharded.units]  # fmt: skip
        name = type(getattr(model, "module", model)).__name__
        self._start(
            units, sharded, fabric.global_rank == 0, list(fabric.loggers), self._gather_comm, name, sharded.comm.device
        )

    def step_start(self) -> None:
        self.on_train_batch_start(None, None, None, 0)  # type: ignore[arg-type]

    def before_optimizer_step(self, optimizer: Optimizer) -> None:
        self.on_before_optimizer_step(None, None, getattr(optimizer, "optimizer", optimizer))  # type: ignore[arg-type]

    def step_end(self, loss: Tensor) -> None:
        self.on_train_batch_end(None, None, loss, None, 0)  # type: ignore[arg-type]

    def finish(self, directory: str | Path | None = None) -> dict[str, Path]:
        assert self.sharded is not None, "vitals.watch(fabric, model) first"
        path = Path(self.dashboard_dir or directory or "vitals")
        self._write(path, self.sharded.comm.world_size)
        self.teardown(None, None, "fit")  # type: ignore[arg-type]
        return self.paths

    # ---- hooks ----

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        assert self.activations is not None
        self.activations.active = self.batches % self.every_n_steps == 0
        if self.activations.active:
            self.options.start()
        self.activations.sums.clear()
        self._local_sq.clear()
        self._shard_grad_sq, self._before = None, None

    def _observe_flat_grad(self, unit: Any, fp: Any, flat: Tensor) -> None:
        """This rank's own gradient of ``unit`` (a flat grad about to be reduce-scattered); summed on the device."""
        if self.activations is not None and self.activations.active:
            sq = torch.linalg.vector_norm(flat.detach().double()) ** 2
            before = self._local_sq.get(unit.name)
            self._local_sq[unit.name] = sq if before is None else before + sq

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Optimizer) -> None:
        if not (self.activations and self.activations.active):
            return
        originals = [p for group in optimizer.param_groups for p in group["params"]]
        shards = self.sharded.masters(originals) if self.sharded is not None else originals
        grads = [m.grad for m in shards if m.grad is not None]  # this rank's gradient shards
        sq = sum((self._here(torch.linalg.vector_norm(g.double()) ** 2) for g in grads), self._scalar(0.0))
        self._shard_grad_sq = sq if self._shard_grad_sq is None else self._shard_grad_sq + sq
        if self._before is None:  # several optimizers: the first one's call sees the weights before any step
            self._before = [[m.detach().clone() for m in u.masters] for u in self.units]

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        assert self.activations is not None
        timing = self._timing()
        if self.activations.active:
            self._record(self._measure(outputs, timing))
        self.options.end()
        self.activations.active = False
        self.batches += 1

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # trainer.log_dir is a collective (it broadcasts rank 0's), so every rank asks
        directory = (
            Path(self.dashboard_dir)
            if self.dashboard_dir
            else Path(trainer.log_dir or trainer.default_root_dir) / "vitals"
        )
        self._write(directory, trainer.world_size)

    def _write(self, directory: Path, world_size: int) -> None:
        if self._zero and self.rows:
            values = np.stack(self.rows)
            signals = [*self.signals, *self.global_signals]
            history = VitalsHistory(
                self.steps,
                signals,
                values,
                f"shardlab vital signs: {self._title}, {world_size} ranks",
                global_signals=self.global_signals,
                reasons=self._reasons(signals, values),
            )
            self.paths = write_dashboard(history, directory, self.outlier_z)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.activations is not None:
            self.activations.remove()
            self.activations = None
        self.options.end()
        if self.sharded is not None and self._observe_flat_grad in self.sharded.grad_observers:
            self.sharded.grad_observers.remove(self._observe_flat_grad)

    # ---- measuring, gathering, logging ----

    def _measure(self, outputs: Any, timing: list[float]) -> Tensor:
        """This rank's row: its signals, then the sums the global signs are made of. 1-D float64, made on the
        device from what was summed there (no read by the host: the row's all-gather brings it over once)."""
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        loss = (
            self._here(loss.detach().double().reshape(())) if isinstance(loss, Tensor) and loss.numel() == 1 else None
        )
        local = torch.stack([self._local_norm(u) for u in self.units]) if self.units else self._nan(0)
        seen = ~torch.isnan(local)
        overall = torch.where(seen.any(), torch.sqrt(torch.nansum(local**2)), math.nan)
        assert self.activations is not None
        parts = [
            (self._scalar(math.nan) if loss is None else loss).reshape(1),
            overall.reshape(1),
            to_device(torch.tensor(timing, dtype=torch.float64), self.device),  # host clocks: up without a wait
        ]
        for unit, norm in zip(self.units, local):
            parts += [self.activations.take(unit.name), norm.reshape(1)]
        parts.append((self._scalar(math.nan) if self._shard_grad_sq is None else self._shard_grad_sq).reshape(1))
        parts += [self._update_sums(i, unit) for i, unit in enumerate(self.units)]
        parts.append(self.options.sums(self.device))  # empty with the defaults
        return torch.cat(parts)

    def _scalar(self, value: float) -> Tensor:
        return torch.full((), value, dtype=torch.float64, device=self.device)

    def _nan(self, n: int) -> Tensor:
        return torch.full((n,), math.nan, dtype=torch.float64, device=self.device)

    def _here(self, t: Tensor) -> Tensor:
        """``t`` on this rank's device (an offloaded master's sums come up from the host without a wait)."""
        return to_device(t, self.device)

    def _local_norm(self, unit: VitalUnit) -> Tensor:
        sq = self._local_sq.get(unit.name)
        return self._scalar(math.nan) if sq is None else self._here(torch.sqrt(sq))

    def _update_sums(self, i: int, unit: VitalUnit) -> Tensor:
        """(|Δw|^2, |w|^2) of this rank's masters of ``unit`` in this step; NaN without a step. 1-D, 2."""
        if self._before is None or not unit.masters:
            return self._nan(2)
        pairs = list(zip(unit.masters, self._before[i]))
        delta = sum(self._here(torch.linalg.vector_norm((m.detach() - b).double()) ** 2) for m, b in pairs)
        weight = sum(self._here(torch.linalg.vector_norm(b.double()) ** 2) for _, b in pairs)
        return torch.stack([delta, weight])

    def _globals(self, everyone: np.ndarray) -> list[float]:
        """grad_norm and each unit's update ratio from every rank's sums: shards partition the weights (sum those
        of one shard group: ranks 0..G-1; hybrid sharding's other groups are replicas); whole copies are the same
        everywhere (take rank 0's). The options' error: over every rank, as the budget combines it."""
        n = len(self.signals)
        group = self.sharded.mesh.shard.world_size if self.sharded is not None else 1
        parts = everyone[:group, n:]
        with np.errstate(invalid="ignore", divide="ignore"):
            grad = parts[:, 0]
            out = [math.nan if np.isnan(grad).all() else float(math.sqrt(np.nansum(grad)))]
            for i in range(len(self.units)):
                delta, weight = parts[:, 1 + 2 * i], parts[:, 2 + 2 * i]
                ok = not np.isnan(delta).all() and np.nansum(weight) > 0
                out.append(float(math.sqrt(np.nansum(delta) / np.nansum(weight))) if ok else math.nan)
        return out + self.options.values(everyone[:, n + 1 + 2 * len(self.units) :])  # over every rank

    def _record(self, row: Tensor) -> None:
        everyone = self._gather_row(row).numpy()  # (world, row)
        if not self._zero:
            return
        world, n = everyone.shape[0], len(self.signals)
        glob = self._globals(everyone)
        metrics = {
            f"vitals/{s}/rank{r}": float(everyone[r, k])
            for k, s in enumerate(self.signals)
            for r in range(world)
            if not math.isnan(everyone[r, k])
        }
        metrics.update({f"vitals/{s}": v for s, v in zip(self.global_signals, glob) if not math.isnan(v)})
        self.steps.append(self.batches)
        self.rows.append(np.concatenate([everyone[:, :n], np.tile(glob, (world, 1))], axis=1))
        for logger in self._loggers:
            logger.log_metrics(metrics, step=self.batches)

    def _reasons(self, signals: list[str], values: np.ndarray) -> dict[str, str]:
        """Why a signal has no value at any step (the dashboard prints it in the empty panel)."""
        frozen = {u.name for u in self.units if not u.masters}
        reasons = {}
        for k, signal in enumerate(signals):
            if not np.isnan(values[:, :, k]).all():
                continue
            kind, _, unit = signal.partition("/")
            if signal in self.options.signals:
                reasons[signal] = self.options.reason(signal)
            elif unit in frozen and kind in ("grad_norm_local", "update_ratio"):
                reasons[signal] = "frozen: no gradient, no update"
            elif kind.startswith("act_"):
                reasons[signal] = "its own forward never ran (training_step calls its children)"
            elif kind == "grad_norm_local" and self.sharded is None:
                reasons[signal] = "not measured: this strategy reduces gradients before callbacks see them"
            else:
                reasons[signal] = "no optimizer step was logged"
        return reasons

    def _gather_comm(self, row: Tensor) -> Tensor:
        """Every rank's row on every rank: (world, row), CPU, through the sharded model's collectives."""
        comm = self.sharded.comm
        out = torch.empty(comm.world_size * row.numel(), dtype=row.dtype, device=comm.device)
        collectives.all_gather(out, row.to(comm.device), comm, label="vital signs", kind="vitals")
        return to_host(out, "vitals").view(comm.world_size, -1)

    def _gather(self, trainer: L.Trainer, row: Tensor) -> Tensor:
        """Every rank's row on every rank: (world, row), CPU."""
        if self.sharded is not None:
            return self._gather_comm(row)
        gathered = trainer.strategy.all_gather(row.to(trainer.strategy.root_device))
        return to_host(gathered, "vitals").reshape(trainer.world_size, -1)
