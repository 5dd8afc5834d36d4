"""``ShardLabBudget``: both sides of the ledger, per rank and per step, predicted and measured.

Each step it measures this rank's memory by category from the real tensors (ledger.measure_memory),
the peak of gathered units, and what the collectives recorded (calls, bytes, seconds waiting, and
their share of the step). Every ``log_every_n_steps`` the ranks' figures go to Lightning's logger
(``shardlab/rank{r}/...``). When ``fit`` ends it prints the tables, each measured figure beside what
budget/predict.py predicts from the layout, and writes ``shardlab_budget.json`` beside the logs. Per-step
communication is the steady state: the first optimizer step is a warm-up and left out.
"""

from __future__ import annotations

import json
import resource
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import lightning as L
import torch
from rich.console import Console
from rich.table import Table

from lightning_shardlab.budget.measure import MEMORY_CATEGORIES, measure_memory
from lightning_shardlab.budget.predict import OptimizerShape, predict_gathered_peak, predict_memory, predict_traffic
from lightning_shardlab.comm import collectives
from lightning_shardlab.config import Accumulation
from lightning_shardlab.display import mib, print_table
from lightning_shardlab.sharding.sharded_model import sharded_model_of

STEP_KEYS = (*MEMORY_CATEGORIES, "gathered_peak", "comm_bytes", "comm_seconds", "step_seconds")


def process_peak_bytes(device: torch.device) -> int:
    """The allocator's peak on a GPU; the process's peak resident memory on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class ShardLabBudget(L.Callback):
    """Add to ``Trainer(callbacks=[...])`` with the shardlab strategy (YAML: ``lightning_shardlab.ShardLabBudget``)."""

    def __init__(self, console: Console | None = None, json_name: str = "shardlab_budget.json") -> None:
        self.console = console or Console()
        self.json_name = json_name
        self.last: dict[str, float] = {}
        self.totals: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))  # by (kind, label)
        self.step_seconds = 0.0
        self._started = 0.0
        self._comm_before = (0.0, 0.0)
        self._first_step = 0
        self._warmed_up = False
        self._warm_up: tuple[dict, float] = ({}, 0.0)
        self._val_start: dict = {}
        self.validation: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0, 0.0])  # not training

    # ---- every step ----

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        sharded = sharded_model_of(trainer)
        if sharded is not None:
            sharded.comm.ledger.reset()  # training traffic only, not setup
        self._first_step = trainer.global_step
        self._warmed_up = False

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        sharded = sharded_model_of(trainer)
        if sharded is not None:
            self._val_start = sharded.comm.ledger.snapshot()

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Validation inside fit moves parameters too; keep it out of the per-step training figures."""
        sharded = sharded_model_of(trainer)
        if sharded is None:
            return
        for key, now in sharded.comm.ledger.snapshot().items():
            before = self._val_start.get(key, (0, 0, 0.0))
            for i in range(3):
                self.validation[key][i] += now[i] - before[i]

    def _training_traffic(self, ledger: Any) -> dict[tuple[str, str], tuple[float, float, float]]:
        out = {}
        for key, t in ledger.by_label.items():
            v = self.validation.get(key, (0, 0, 0.0))
            out[key] = (t.count - v[0], t.bytes - v[1], t.seconds - v[2])
        return out

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        sharded = sharded_model_of(trainer)
        if sharded is not None:
            sharded.comm.ledger.reset_peak()
            self._comm_before = self._comm_totals(sharded.comm.ledger)
        self._started = time.perf_counter()

    @staticmethod
    def _comm_totals(ledger: Any) -> tuple[float, float]:
        return sum(t.bytes for t in ledger.by_kind.values()), sum(t.seconds for t in ledger.by_kind.values())

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        sharded = sharded_model_of(trainer)
        if sharded is None:
            return
        seconds = time.perf_counter() - self._started
        self.step_seconds += seconds
        ledger = sharded.comm.ledger
        memory = measure_memory(sharded.flat_params, trainer.optimizers)
        nbytes, comm_seconds = self._comm_totals(ledger)
        self.last = {
            **memory,
            "gathered_peak": ledger.gathered_peak,
            "step_seconds": seconds,
            "comm_bytes": nbytes - self._comm_before[0],
            "comm_seconds": comm_seconds - self._comm_before[1],
        }
        if trainer.global_step % max(trainer.log_every_n_steps, 1) == 0:
            self._log(trainer, sharded)
        if trainer.global_step == self._first_step + 1 and not self._warmed_up:
            self._warm_up_done(trainer, ledger)

    def _warm_up_done(self, trainer: L.Trainer, ledger: Any) -> None:
        """The per-step figures describe the steady state: the first optimizer step (no forward order yet
        to prefetch by) is left out."""
        self._warmed_up = True
        self._warm_up = (self._training_traffic(ledger), self.step_seconds)  # reported if no step follows
        ledger.reset()
        self.validation.clear()
        self.step_seconds = 0.0
        self._first_step = trainer.global_step

    def _log(self, trainer: L.Trainer, sharded: Any) -> None:
        """One small all-gather: every rank's figures, logged by rank 0 as shardlab/rank{r}/..."""
        mine = torch.tensor([float(self.last[k]) for k in STEP_KEYS], dtype=torch.float64, device=sharded.comm.device)
        everyone = torch.empty(len(STEP_KEYS) * sharded.comm.world_size, dtype=mine.dtype, device=mine.device)
        collectives.all_gather(everyone, mine, sharded.comm, label="per-rank figures", kind="budget")
        if trainer.logger is None or trainer.global_rank != 0:
            return
        rows = everyone.view(sharded.comm.world_size, len(STEP_KEYS)).tolist()
        metrics = {f"shardlab/rank{r}/{k}": v for r, row in enumerate(rows) for k, v in zip(STEP_KEYS, row)}
        trainer.logger.log_metrics(metrics, step=trainer.global_step)

    # ---- when fit ends ----

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        sharded = sharded_model_of(trainer)
        if sharded is None or not self.last:
            return
        report = self._report(trainer, sharded)
        everyone = collectives.all_gather_object(report, sharded.comm, label="budget report")
        directory = Path(trainer.log_dir or trainer.default_root_dir)  # every rank: log_dir is a broadcast
        if trainer.global_rank != 0:
            return
        self._print(everyone, sharded)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / self.json_name).write_text(json.dumps(everyone, indent=1))
        self.console.print(f"[rank 0] budget written to {directory / self.json_name}")

    def _report(self, trainer: L.Trainer, sharded: Any) -> dict[str, Any]:
        steps = max(trainer.global_step - self._first_step, 1)
        training, step_seconds = self._training_traffic(sharded.comm.ledger), self.step_seconds
        if self._warmed_up and trainer.global_step == self._first_step:  # the warm-up was the only step
            training, step_seconds = self._warm_up
        layouts = [fp.layout for fp in sharded.flat_params]
        units = {u.name: [fp.layout for fp in u.flat_params] for u in sharded.units}
        optimizer = OptimizerShape.of(trainer.optimizers[0]) if trainer.optimizers else None
        micro = trainer.accumulate_grad_batches
        traffic = predict_traffic(
            units,
            sharded.config.stage,
            sharded.policy,
            micro,
            sharded.config.accumulation is Accumulation.REDUCE,
            sharded.config.reshard_after_forward,
        )
        comm: dict[str, dict[str, float]] = defaultdict(lambda: {"calls": 0.0, "bytes": 0.0, "seconds": 0.0})
        by_unit = {}
        for (kind, label), (count, nbytes, seconds) in training.items():
            if count == 0:
                continue
            per_step = {"calls": count / steps, "bytes": nbytes / steps, "seconds": seconds / steps}
            by_unit[f"{kind} {label}"] = per_step
            for k, v in per_step.items():
                comm[kind][k] += v
        comm = dict(comm)
        return {
            "rank": sharded.comm.rank,
            "world_size": sharded.comm.world_size,
            "stage": int(sharded.config.stage),
            "precision": trainer.precision,
            "optimizer_steps": steps,
            "memory_measured": {k: self.last[k] for k in (*MEMORY_CATEGORIES, "gathered_peak")},
            "memory_predicted": {
                **predict_memory(layouts, sharded.config.stage, sharded.policy, sharded.comm.rank, optimizer),
                "gathered_peak": predict_gathered_peak(units, sharded.config.stage, sharded.policy),
            },
            "process_peak_bytes": process_peak_bytes(sharded.comm.device),
            "comm_per_step": comm,
            "comm_per_step_by_unit": by_unit,
            "comm_predicted_per_step": vars(traffic),
            "step_seconds": step_seconds / steps,
            "comm_share_of_step": sum(c["seconds"] for c in comm.values()) / max(step_seconds / steps, 1e-12),
        }

    def _print(self, everyone: list[dict[str, Any]], sharded: Any) -> None:
        first = everyone[0]
        title = (
            f"shardlab budget: memory per rank between steps, MiB measured (predicted), stage {first['stage']},"
            f" {first['world_size']} ranks, {first['precision']}"
        )
        memory = Table(title=title)
        cats = (*MEMORY_CATEGORIES, "gathered_peak")
        for col in ("rank", *cats, "model state", "process peak"):
            memory.add_column(col, justify="right")
        for r in everyone:
            m, p = r["memory_measured"], r["memory_predicted"]
            cells = [f"{mib(m[c])} ({mib(p[c])})" for c in cats]
            state = sum(m[c] for c in MEMORY_CATEGORIES if c != "padding")
            predicted = sum(p[c] for c in MEMORY_CATEGORIES if c != "padding")
            memory.add_row(str(r["rank"]), *cells, f"{mib(state)} ({mib(predicted)})", mib(r["process_peak_bytes"]))
        print_table(self.console, memory)
        comm = Table(
            title=f"shardlab budget: communication per optimizer step ({first['optimizer_steps']} steps),"
            " full-tensor MiB, measured (predicted)"
        )
        for col in ("rank", "collective", "calls", "MiB", "seconds waiting", "share of step"):
            comm.add_column(col, justify="right")
        for r in everyone:
            pred = r["comm_predicted_per_step"]
            for kind, c in sorted(r["comm_per_step"].items()):
                p_calls, p_bytes = pred.get(f"{kind}_calls"), pred.get(f"{kind}_bytes")
                calls = f"{c['calls']:.1f}" + (f" ({p_calls})" if p_calls is not None else "")
                moved = mib(c["bytes"]) + (f" ({mib(p_bytes)})" if p_bytes is not None else "")
                share = c["seconds"] / max(r["step_seconds"], 1e-12)
                comm.add_row(str(r["rank"]), kind, calls, moved, f"{c['seconds']:.4f}", f"{share:.1%}")
        print_table(self.console, comm)
