"""``ShardLabBudget``: both sides of the ledger, per rank and per step, predicted and measured.

Each step it measures this rank's memory by category from the real tensors (ledger.measure_memory),
the peak of gathered units, and what the collectives recorded (calls, bytes, seconds waiting, and
their share of the step). Every ``log_every_n_steps`` the ranks' figures go to Lightning's logger
(``shardlab/rank{r}/...``). When ``fit`` ends it prints the tables, each measured figure beside what
budget/predicted/zero_table.py predicts from the layout (budget/report.py assembles a rank's figures, budget/tables.py
prints them), and writes ``shardlab_budget.json`` beside the logs; with each fewer-bytes option's error (where one is
on) and its time saved on the link the run probed (``option_savings``). Per-step
communication is the steady state: the first optimizer step is a warm-up and left out. A hybrid or
regrouped run (comm/mesh.py) also gets its communication by group: inside shard groups, across them,
inside reshard groups (``comm_per_step_by_scope``, set beside the prediction's ``by_scope``). Whole-tensor
optimizers (Muon, Adafactor) get a table of their own: per rank, what it owns, the state it keeps for it and
its all-to-alls per step (budget/predicted/whole_tensor.py), measured beside predicted. Around each training step it
also measures what autograd saves for backward, by unit (budget/measured/activations.py), and draws every rank's memory
as a stacked bar, activations on top (``shardlab_budget.png``, budget/bars.py).
"""

from __future__ import annotations

import json
import socket
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.pytorch.utilities.model_helpers import is_overridden
from rich.console import Console

from lightning_shardlab.budget.bars import write_bars
from lightning_shardlab.budget.measured.activations import ActivationMeter
from lightning_shardlab.budget.measured.local_link import measure_run_link
from lightning_shardlab.budget.measured.memory import MEMORY_CATEGORIES, live_storages, measure_memory
from lightning_shardlab.budget.measured.option_error import option_error
from lightning_shardlab.budget.measured.step_peak import StepPeak
from lightning_shardlab.budget.measured.step_time import TimeMeter, align_timelines
from lightning_shardlab.budget.measured.tiers import tier_counters
from lightning_shardlab.budget.predicted import first_batch
from lightning_shardlab.budget.predicted.compute_rate import ComputeRate, link_share, median_rate, sharing_cores
from lightning_shardlab.budget.predicted.optimizer_peak import optimizer_step_bytes
from lightning_shardlab.budget.predicted.option_savings import run_option_savings
from lightning_shardlab.budget.predicted.run_time import run_rate, time_predicted_for_run
from lightning_shardlab.budget.predicted.zero_table import Interconnect
from lightning_shardlab.budget.report import Measured, Run, rank_report
from lightning_shardlab.budget.tables import print_budget
from lightning_shardlab.comm import collectives
from lightning_shardlab.sharding.lookup import sharded_model_of
from lightning_shardlab.sharding.packing_error import as_lists, gather_error_sums
from lightning_shardlab.sharding.reduce_sample import ReduceSample

DATA_AS_MEASURED = "as measured (the run's own data loading: not predicted)"
STEP_KEYS = (*MEMORY_CATEGORIES, "gathered_peak", "comm_bytes", "comm_seconds", "step_seconds")


class ShardLabBudget(L.Callback):
    """Add to ``Trainer(callbacks=[...])`` with the shardlab strategy (YAML: ``lightning_shardlab.ShardLabBudget``).

    In a Fabric loop: ``budget.watch(fabric, model, optimizer)`` once, ``budget.step_start()`` and
    ``budget.step_end()`` around each optimizer step (its micro-batches included), ``budget.report()`` at the
    end (every rank; rank 0 prints the tables)."""

    def __init__(
        self,
        console: Console | None = None,
        json_name: str = "shardlab_budget.json",
        step_peak: bool = False,
        timeline: bool = False,
        error_every: int = 50,
    ) -> None:
        """``step_peak``: profile the first step after the warm-up (optimizer state made, prefetch order known) to
        measure its peak of tensor memory by phase (budget/measured/step_peak.py; on CPU through torch's memory
        profiler, which slows that step, so it is left out of the timings). ``timeline``: draw one steady step of
        every rank beside the JSON (``shardlab_timeline.png``, and ``shardlab_timeline.trace.json`` for Perfetto
        or chrome://tracing: budget/timeline_picture.py). ``error_every`` K: with a packed ``reduce_dtype``, one
        optimizer step in K (the first included) also reduces its gradients exactly, to set the packed result
        against (one extra reduce-scatter per flat parameter: sharding/reduce_sample.py); nothing without one."""
        if isinstance(error_every, bool) or not isinstance(error_every, int) or error_every < 1:
            raise ValueError(
                f"[rank {rank_zero_only.rank}] ShardLabBudget(error_every={error_every!r}): it is the optimizer steps"
                " between two samples of a packed reduction's error, an integer >= 1. HINT: error_every=50 samples"
                " one step in 50; a large value samples rarely."
            )
        self.error_every = error_every
        self.reduce_samples: list[tuple[int, dict[str, list[float]]]] = []  # (optimizer step, sums by unit)
        self._sample: ReduceSample | None = None  # the sampled step's comparisons, while it runs
        self._sample_step = 0  # the optimizer steps done when it began
        self._links: tuple[Interconnect, Interconnect] | None = None  # the run's own, probed for its time prediction
        self.console = console or Console()
        self.json_name = json_name
        self.measure_step_peak = step_peak
        self.draw_timeline = timeline
        self.time: TimeMeter | None = None  # where each rank's time goes (budget/measured/step_time.py)
        self._optimizer_steps = 0
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
        self.fabric_run: Run | None = None  # set by watch()
        self._io_before: tuple[int, int] | None = None
        # in the steps measured: bytes this process read from / wrote to storage, seconds in offloaded steps
        self.storage_io = [0.0, 0.0, 0.0]
        self.reports: list[dict[str, Any]] | None = None  # every rank's figures, once fit (or report()) ends
        self.activations: ActivationMeter | None = None  # what each training step saves for backward, by unit
        self.step_peak: StepPeak | None = None  # the profiled step's peak by phase, while it runs
        self._clone: torch.nn.Module | None = None  # the module on the meta device, taken before sharding
        self.predicted_activations: dict[str, Any] = {}  # its first batch traced (predicted/first_batch.py)
        self.predicted_timeline: Any = None  # ... and run on the engine's schedule (predicted/step_timeline.py)
        self.predicted_optimizer: Any = None  # the optimizers' step under fake tensors (predicted/optimizer_peak.py)
        self.predicted_work: Any = None  # the first batch's work by unit (predicted/forward_trace.py)
        self.peaks: dict[str, dict[str, Any]] = {}

    # ---- a Fabric loop ----

    def watch(
        self, fabric: Any, model: Any, *optimizers: Any, micro_batches: int = 1, directory: str | Path = "."
    ) -> None:
        """Start measuring a Fabric run of ``model`` (set up by the shardlab Fabric strategy)."""
        logger = fabric.loggers[0] if fabric.loggers else None
        self.fabric_run = Run(
            fabric.strategy.sharded_model(model), [getattr(o, "optimizer", o) for o in optimizers], 0, 1, logger,
            fabric.global_rank, str(fabric.strategy.precision.precision), micro_batches, lambda: Path(directory),
        )  # fmt: skip
        self._start(self.fabric_run)

    def step_start(self) -> None:
        assert self.fabric_run is not None, "budget.watch(fabric, model, optimizer) first"
        self._batch_start(self.fabric_run)

    def step_end(self) -> None:
        assert self.fabric_run is not None, "budget.watch(fabric, model, optimizer) first"
        self.fabric_run.step += 1
        self._batch_end(self.fabric_run)

    def report(self) -> dict[str, Any] | None:
        """Collective: every rank's figures (rank 0 prints the tables and writes the JSON); None before a step."""
        assert self.fabric_run is not None, "budget.watch(fabric, model, optimizer) first"
        return self._finish(self.fabric_run)

    # ---- every step ----

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Before the strategy shards the module: a meta-device copy of it, to predict activations from."""
        if stage != "fit":
            return
        if is_overridden("configure_model", pl_module):
            self.predicted_activations = {"error": "the model is built in configure_model, after this hook"}
            return
        self._clone = first_batch.meta_clone(pl_module)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        run = Run.of_trainer(trainer)
        if run is not None:
            self._start(run)

    def _start(self, run: Run) -> None:
        run.sharded.comm.ledger.reset()  # training traffic only, not setup
        if self.activations is not None:
            self.activations.remove()
        self.activations = ActivationMeter(run.sharded)
        if self.time is not None:
            self.time.stop()
        self.time = TimeMeter(run.sharded.comm)
        self._optimizer_steps = run.step
        self._first_step = run.step
        self._warmed_up = False
        self._links = None

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        sharded = sharded_model_of(trainer)
        if sharded is not None:
            self._val_start = sharded.comm.ledger.snapshot()

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Validation inside fit moves parameters too; keep it out of the per-step training figures."""
        sharded = sharded_model_of(trainer)
        if sharded is None:
            return
        if self.time is not None:
            self.time.clock.drop_step()  # the time side, too, is the training steps'
        for key, now in sharded.comm.ledger.snapshot().items():
            before = self._val_start.get(key, (0, 0, 0.0))
            for i in range(3):
                self.validation[key][i] += now[i] - before[i]

    def _training_traffic(self, ledger: Any) -> dict[tuple[str, str, str], tuple[float, float, float]]:
        out = {}
        for key, t in ledger.by_call.items():
            v = self.validation.get(key, (0, 0, 0.0))
            out[key] = (t.count - v[0], t.bytes - v[1], t.seconds - v[2])
        return out

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, *args: Any) -> None:
        run = Run.of_trainer(trainer)
        if run is None:
            return
        if self._clone is not None:  # the first batch: traced under fake tensors, before it runs
            self.predicted_activations, self.predicted_work = first_batch.predict_first_batch(
                self._clone, batch, run.sharded.config, run.precision
            )
            if "step" in self.predicted_activations:
                step = self.predicted_activations["step"]
                self.predicted_timeline = first_batch.timeline_for_batch(
                    self._clone, batch, run.sharded, run.precision, step
                )
                self.predicted_optimizer = optimizer_step_bytes(run.optimizers, run.sharded)
            self._clone = None
        self._batch_start(run, batch)

    def _batch_start(self, run: Run, batch: Any = None) -> None:
        self._start_sample(run.sharded, run.step)
        run.sharded.comm.ledger.reset_peak()
        self._comm_before = self._comm_totals(run.sharded.comm.ledger)
        self._io_before = tier_counters(run.sharded)
        if self.activations is not None:
            self.activations.start()
        if self.measure_step_peak and self._warmed_up and not self.peaks and self.step_peak is None:
            self.step_peak = StepPeak(run.sharded.comm.device)
            self.step_peak.start(
                live_storages(run.sharded.flat_params, run.optimizers, batch),
                "step" if run is self.fabric_run else "forward",
            )
        self._started = time.perf_counter()

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        if self.step_peak is not None:
            self.step_peak.phase("backward")

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if self.time is not None:
            self.time.clock.phase("optimizer")  # clipping and the step
        if self.step_peak is not None:
            self.step_peak.phase("optimizer")

    @staticmethod
    def _comm_totals(ledger: Any) -> tuple[float, float]:
        return sum(t.bytes for t in ledger.by_kind.values()), sum(t.seconds for t in ledger.by_kind.values())

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        run = Run.of_trainer(trainer)
        if run is not None:
            self._batch_end(run)

    def _start_sample(self, sharded: Any, step: int) -> None:
        """Every rank alike (the same step count): the packed reductions of this optimizer step set against exact
        ones, if it is one in ``error_every`` and some flat parameter's reduction is packed."""
        packed = any(fp.reduce_packing is not None for fp in sharded.flat_params)
        if self._sample is None and not step % self.error_every and packed:  # the vitals may sample it too: joined
            self._sample, self._sample_step = ReduceSample.join(sharded.units), step

    def _end_sample(self, sharded: Any, step: int) -> None:
        """The optimizer stepped: keep the sampled step's sums, and reduce exactly no more."""
        if self._sample is None or step == self._sample_step:  # a micro-batch: the step goes on
            return
        self.reduce_samples.append((step, self._sample.sums))
        self._sample.leave(sharded.units)
        self._sample = None

    def _batch_end(self, run: Run) -> None:
        sharded = run.sharded
        self._end_sample(sharded, run.step)
        seconds = time.perf_counter() - self._started
        if self.activations is not None:
            self.activations.stop()
        profiled = self.step_peak is not None
        if profiled:
            self.peaks = self.step_peak.stop()
            self.step_peak = None
        self.step_seconds += seconds
        self._time_step(run)
        io = tier_counters(sharded)
        if io is not None and self._io_before is not None:
            self.storage_io = [total + now - before for total, now, before in zip(self.storage_io, io, self._io_before)]
        ledger = sharded.comm.ledger
        memory = measure_memory(sharded.flat_params, run.optimizers)
        nbytes, comm_seconds = self._comm_totals(ledger)
        self.last = {
            **memory,
            "gathered_peak": ledger.gathered_peak,
            "step_seconds": seconds,
            "comm_bytes": nbytes - self._comm_before[0],
            "comm_seconds": comm_seconds - self._comm_before[1],
        }
        if run.step % run.log_every == 0:
            self._log(run)
        if (run.step == self._first_step + 1 and not self._warmed_up) or profiled:
            self._warm_up_done(run, ledger)  # the profiled step ran slower: left out of the timing too

    def _time_step(self, run: Run) -> None:
        """A batch ended: the step clock closes the step if the optimizer stepped (else the next micro-batch's
        loading begins)."""
        if self.time is None:
            return
        if run.step == self._optimizer_steps:
            self.time.clock.phase("data")
            return
        self._optimizer_steps = run.step
        self.time.end_step()

    def _warm_up_done(self, run: Run, ledger: Any) -> None:
        """The per-step figures describe the steady state: the first optimizer step (no forward order yet
        to prefetch by) is left out."""
        self._warmed_up = True
        self._warm_up = (self._training_traffic(ledger), self.step_seconds)  # reported if no step follows
        ledger.reset()
        self.validation.clear()
        self.step_seconds = 0.0
        self.storage_io = [0.0, 0.0, 0.0]
        self._first_step = run.step
        if self.time is not None:
            self.time.reset(run.step)

    def _log(self, run: Run) -> None:
        """One small all-gather: every rank's figures, logged by rank 0 as shardlab/rank{r}/..."""
        sharded = run.sharded
        comm = sharded.comm.host_side  # host figures: no device copy (comm/host_side.py)
        mine = torch.tensor([float(self.last[k]) for k in STEP_KEYS], dtype=torch.float64)
        everyone = torch.empty(len(STEP_KEYS) * comm.world_size, dtype=mine.dtype)
        collectives.all_gather(everyone, mine, comm, label="per-rank figures", kind="budget")
        if run.logger is None or run.rank != 0:
            return
        rows = everyone.view(sharded.comm.world_size, len(STEP_KEYS)).tolist()
        metrics = {f"shardlab/rank{r}/{k}": v for r, row in enumerate(rows) for k, v in zip(STEP_KEYS, row)}
        run.logger.log_metrics(metrics, step=run.step)

    # ---- when fit ends ----

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (a trainer sent to ranks started by spawn): the console stays here (it holds a lock; each rank
        prints through a new one), and the tallies travel as plain dicts (their defaults are lambdas)."""
        plain = {"totals": {k: dict(v) for k, v in self.totals.items()}, "validation": dict(self.validation)}
        return {**self.__dict__, "console": None, **plain}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.console = Console()
        totals, validation = state["totals"], state["validation"]
        self.totals = defaultdict(lambda: defaultdict(float), {k: defaultdict(float, v) for k, v in totals.items()})
        self.validation = defaultdict(lambda: [0, 0, 0.0], validation)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        run = Run.of_trainer(trainer)
        if run is not None:
            self._finish(run)

    def _finish(self, run: Run) -> list[dict[str, Any]] | None:
        if not self.last:
            return None
        sharded = run.sharded
        everyone = collectives.all_gather_object(self._report(run), sharded.comm, label="budget report")
        self.reports = everyone
        directory = run.directory()  # every rank (a Trainer's log_dir is a broadcast)
        if run.rank != 0:
            return everyone
        align_timelines(everyone)
        error = option_error(everyone)
        if error:  # only where a fewer-bytes option is on
            everyone[0]["option_error"] = error
        if self._links is not None:  # each option's bytes and time per step on the links the run probed
            everyone[0]["option_savings"] = run_option_savings(run.sharded, run.micro_batches, *self._links)
        print_budget(self.console, everyone)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / self.json_name).write_text(json.dumps(everyone, indent=1))
        bars = write_bars(everyone, directory / Path(self.json_name).with_suffix(".png").name)
        drawn = [str(p) for p in (bars, *self._pictures(everyone, directory)) if p is not None]
        also = f" and {', '.join(drawn)}" if drawn else ""
        self.console.print(f"[rank 0] budget written to {directory / self.json_name}{also}")
        return everyone

    def _pictures(self, everyone: list[dict[str, Any]], directory: Path) -> list[Path | None]:
        if not self.draw_timeline:
            return []
        from lightning_shardlab.budget.timeline_picture import write_chrome_trace, write_timeline_png

        png = write_timeline_png(everyone, directory / "shardlab_timeline.png")
        return [png, write_chrome_trace(everyone, directory / "shardlab_timeline.trace.json")]

    def _report(self, run: Run) -> dict[str, Any]:
        training, step_seconds = self._training_traffic(run.sharded.comm.ledger), self.step_seconds
        if self._warmed_up and run.step == self._first_step:  # the warm-up was the only step
            training, step_seconds = self._warm_up
        steps = max(run.step - self._first_step, 1)
        activations = self.activations.report() if self.activations is not None else {}
        if self.activations is not None:
            self.activations.remove()
            self.activations = None
        measured = Measured(self.last, training, step_seconds, steps, self.storage_io, activations, self.peaks)
        report = {**rank_report(run, measured), "activations_predicted": self.predicted_activations}
        gathers = as_lists(gather_error_sums(run.sharded), "gather error")
        if gathers or self.reduce_samples:
            report["option_error_sums"] = {
                "gather": gathers,
                "reduce": self.reduce_samples,
                "reduce_every": self.error_every,
            }
        report["step_peak_predicted"] = first_batch.predict_step_peak(
            report, self.predicted_timeline, self.predicted_optimizer
        )
        if self.time is not None:  # collective: the last exchange of the step clock
            report.update(self.time.report())
            self.time.stop()
            self.time = None
            report["time_predicted"] = self._time_predicted(run, report["time_measured"].get("data", 0.0))
        return report

    def _time_predicted(self, run: Run, data_seconds: float) -> dict[str, Any]:
        """Collective (the links timed): the step played on the engine's schedule (budget/predicted/step_time.py)
        from the first batch's work, on the run's own links measured now with its own collectives. The user's data
        loading (``data_seconds``) is not the engine's to predict: it enters as measured, and says so."""
        if self.predicted_work is None:
            return {"error": "no batch was traced (a Fabric loop, or a model built in configure_model)"}
        mesh, here = run.sharded.mesh, socket.gethostname()
        hosts = collectives.all_gather_object(here, mesh.world, label="hosts", kind="budget")
        link = measure_run_link(mesh.shard) if mesh.shard.world_size > 1 else None
        inter = measure_run_link(mesh.replica) if mesh.replica.world_size > 1 else None
        rate = self._rate_in_turns(run, hosts)
        self._links = (link or inter, inter or link) if link or inter else None
        out = time_predicted_for_run(
            run.sharded, self.predicted_work, run.micro_batches, run.precision,
            link=link, inter=inter or link, optimizers=run.optimizers, ranks_here=hosts.count(here), rate=rate,
            link_share=link_share(run.sharded.comm.device.type, hosts.count(here)), data_seconds=data_seconds,
        )  # fmt: skip
        if "basis" in out:
            out["basis"]["data"] = DATA_AS_MEASURED
        return out

    def _rate_in_turns(self, run: Run, hosts: list[str]) -> ComputeRate | None:
        """Collective (barriers): the compute rate measured by each rank while the other ranks of its machine wait
        (one turn per rank of the most crowded machine), so that no probe shares the cores with another; the
        rate is then this rank's share of them (``sharing_cores``)."""
        here, rate = socket.gethostname(), None
        turns, mine = max(hosts.count(h) for h in hosts), hosts[: run.sharded.mesh.world.rank].count(here)
        for turn in range(turns if turns > 1 else 0):
            if turn == mine and not self.predicted_work.error:
                rate = run_rate(run.sharded, self.predicted_work)
            collectives.barrier(run.sharded.mesh.world, label=f"rate probe {turn}")
        if turns > 1:  # ranks doing the same work on one machine are predicted alike: its probes' median
            rates = collectives.all_gather_object(rate, run.sharded.mesh.world, label="rates", kind="budget")
            rate = median_rate([r for r, host in zip(rates, hosts) if host == here and r is not None])
        return sharing_cores(rate, hosts.count(here)) if rate is not None else None
