"""``shardlab plan``: the budget of a run before buying the hardware.

From a parameter count (the ZeRO table) or from a real model (its real unit layout at the target
world size, computed on the meta device: no memory, no processes), with stage, world size,
precision, optimizer and an interconnect (a named preset, or ``local``: measured here with two gloo
ranks), it prints per-rank bytes by category, bytes moved per step, the lower-bound communication
time, and — given tokens per step and a device — whether that time can hide behind compute.

    shardlab plan --params 70e9 --world-size 64 --stage 3
    shardlab plan --model lightning_shardlab.examples.gpt.GPT --init-args '{"n_layer": 12}' --world-size 8
    shardlab plan --config configs/gpt_finetune_cpu.yaml --world-size 4 --json
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from rich.console import Console
from rich.table import Table

from lightning_shardlab.budget.measure import MEMORY_CATEGORIES
from lightning_shardlab.budget.predict import (
    DEVICES,
    INTERCONNECTS,
    Interconnect,
    OptimizerShape,
    Traffic,
    predict_gathered_peak,
    predict_memory,
    predict_traffic,
    zero_table_bytes,
)
from lightning_shardlab.config import DTYPES, PrecisionPolicy, ShardLabConfig, Stage, import_path
from lightning_shardlab.display import print_table, size
from lightning_shardlab.sharding.policy import plan_units

COMPUTE = {"32-true": None, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16, "bf16-true": None}


@dataclass
class Plan:
    source: str
    params: int
    world_size: int
    stage: int
    precision: str
    memory_per_rank: dict[str, float]  # the fullest rank's bytes by category
    per_rank: list[dict[str, float]]  # every rank's (up to 64), for comparing with a real run
    unsharded_bytes: float  # model state on one device (DDP)
    gathered_peak: int
    traffic: dict[str, int]  # per optimizer step, full-tensor bytes
    interconnect: str
    comm_seconds: float  # lower bound on that interconnect
    compute_seconds: float | None = None

    @property
    def model_state(self) -> float:
        return sum(v for k, v in self.memory_per_rank.items() if k != "padding")


def comm_seconds(traffic: Traffic, world_size: int, link: Interconnect) -> float:
    """Ring lower bound: (N-1)/N of every full tensor crosses the link, plus N-1 latencies per call."""
    if world_size == 1:
        return 0.0
    calls = traffic.all_gather_calls + traffic.reduce_scatter_calls
    return link.ring_seconds(traffic.bytes, world_size) + (calls - 1) * (world_size - 1) * link.latency


def plan_params(
    params: float, world_size: int, stage: Stage, precision: str, optimizer: str, link: Interconnect
) -> Plan:
    """From a parameter count: the ZeRO table (no layout, so no padding and one call per collective kind)."""
    mixed = COMPUTE[precision] is not None
    shape = OptimizerShape.named(optimizer)
    memory = zero_table_bytes(params, world_size, stage, mixed, shape)
    unsharded = sum(zero_table_bytes(params, 1, Stage.PARAMETERS, mixed, shape).values())
    w = 2 if mixed or precision == "bf16-true" else 4
    gathers = 2 if stage is Stage.PARAMETERS else 1  # stage 3: forward and backward; 1-2: after the step
    traffic = Traffic(gathers, int(gathers * w * params), 1, int((4 if mixed else w) * params))
    return Plan(
        "parameter count (ZeRO table)",
        int(params),
        world_size,
        int(stage),
        precision,
        {**memory, "padding": 0.0},
        [],
        unsharded,
        0,
        vars(traffic),
        link.name,
        comm_seconds(traffic, world_size, link),
    )


def plan_model(
    model: torch.nn.Module,
    config: ShardLabConfig,
    world_size: int,
    precision: str,
    optimizer: str,
    link: Interconnect,
    source: str,
) -> Plan:
    """From a real (meta-device) model: its unit layout at ``world_size``, the same arithmetic the ledger
    sets against what a run measures."""
    units = plan_units(model, config, world_size).layouts()
    layouts = [lay for lays in units.values() for lay in lays]
    policy = PrecisionPolicy(COMPUTE[precision], DTYPES[config.reduce_dtype] if config.reduce_dtype else None)
    shape = OptimizerShape.named(optimizer)
    per_rank = [predict_memory(layouts, config.stage, policy, r, shape) for r in range(min(world_size, 64))]
    fullest = max(per_rank, key=lambda m: sum(m.values()))
    single = [lay for lays in plan_units(model, config, 1).layouts().values() for lay in lays]
    unsharded = sum(v for k, v in predict_memory(single, Stage.PARAMETERS, policy, 0, shape).items() if k != "padding")
    traffic = predict_traffic(units, config.stage, policy, reshard_after_forward=config.reshard_after_forward)
    return Plan(
        source,
        sum(lay.numel for lay in layouts),
        world_size,
        int(config.stage),
        precision,
        fullest,
        per_rank,
        unsharded,
        predict_gathered_peak(units, config.stage, policy),
        vars(traffic),
        link.name,
        comm_seconds(traffic, world_size, link),
    )


# ---- inputs: a model from an import path or a LightningCLI YAML ----


def meta_model(class_path: str, init_args: dict[str, Any]) -> torch.nn.Module:
    """Build the model on the meta device (shapes only), running ``configure_model`` if it has one."""
    cls = import_path(class_path, "--model")
    with torch.device("meta"):
        model = cls(**init_args)
        if hasattr(model, "configure_model"):
            model.configure_model()
    return model


def from_yaml(path: str) -> tuple[str, dict, dict, str | None]:
    """(model class path, init args, strategy init args, precision) from a ``shardlab fit`` config."""
    cfg = yaml.safe_load(Path(path).read_text())
    model = cfg.get("model") or {}
    if "class_path" not in model:
        raise ValueError(f"{path}: no `model.class_path`. HINT: give a LightningCLI config with a model class_path.")
    trainer = cfg.get("trainer") or {}
    strategy = trainer.get("strategy")
    strategy_args = strategy.get("init_args", {}) if isinstance(strategy, dict) else {}
    if isinstance(strategy, str) and strategy.startswith("shardlab_stage_"):
        strategy_args = {"stage": int(strategy[-1])}
    return model["class_path"], model.get("init_args") or {}, strategy_args, trainer.get("precision")


def measure_local_link(nbytes: int = 16 * 2**20, repeats: int = 5) -> Interconnect:
    """Two gloo ranks on this machine: the latency of a tiny all-gather and the bandwidth of a 16 MiB one."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_calibrate, args=(port, nbytes, repeats, queue), nprocs=2, join=True)
    latency, seconds = queue.get()
    bandwidth = (1 / 2) * nbytes / max(seconds - latency, 1e-9)  # a ring of 2: half the full tensor crosses
    return Interconnect(f"local, measured: {bandwidth / 1e9:.2f} GB/s, {latency * 1e6:.0f} us", bandwidth, latency)


def _calibrate(rank: int, port: int, nbytes: int, repeats: int, queue: Any) -> None:
    import statistics
    import time

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    timings = []
    for numel in (1, nbytes // 4):
        shard, full = torch.ones(numel), torch.empty(2 * numel)
        dist.all_gather_single(full, shard)  # warm up
        samples = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            dist.all_gather_single(full, shard)
            samples.append(time.perf_counter() - start)
        timings.append(statistics.median(samples))
    if rank == 0:
        queue.put(tuple(timings))
    dist.destroy_process_group()


# ---- output ----


def _gb(n: float) -> str:
    return size(n, decimal=True)  # as hardware is sold


def print_plan(plan: Plan, console: Console) -> None:
    table = Table(title=f"shardlab plan: {plan.source}")
    table.add_column("")
    table.add_column("per rank", justify="right")
    for cat in MEMORY_CATEGORIES:
        table.add_row(cat, _gb(plan.memory_per_rank.get(cat, 0.0)))
    table.add_row("model state per rank", _gb(plan.model_state))
    table.add_row("unsharded (one device)", _gb(plan.unsharded_bytes))
    if plan.gathered_peak:
        table.add_row("gathered units at peak", _gb(plan.gathered_peak))
    table.add_row(
        "moved per step (full tensors)", _gb(plan.traffic["all_gather_bytes"] + plan.traffic["reduce_scatter_bytes"])
    )
    table.add_row(f"communication >= ({plan.interconnect})", f"{plan.comm_seconds * 1e3:,.1f} ms")
    if plan.compute_seconds is not None:
        verdict = "hides behind compute" if plan.comm_seconds <= plan.compute_seconds else "exceeds compute"
        table.add_row("compute per step (estimate)", f"{plan.compute_seconds * 1e3:,.1f} ms")
        table.add_row("communication", verdict)
    print_table(console, table)
    console.print(f"{plan.params:,} parameters, stage {plan.stage}, {plan.world_size} ranks, {plan.precision}")


# ---- the command ----


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shardlab plan", description=__doc__.split("\n\n")[0])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--params", type=float, help="a parameter count, e.g. 70e9 (the ZeRO table)")
    source.add_argument("--model", help="import path of a model class, built on the meta device")
    source.add_argument("--config", help="a `shardlab fit` YAML: its model, strategy and precision")
    p.add_argument("--init-args", default="{}", help="JSON init arguments for --model")
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--stage", type=int, choices=(1, 2, 3), help="default: the config's, else 3")
    p.add_argument("--precision", choices=tuple(COMPUTE), help="default: the config's, else bf16-mixed")
    p.add_argument("--optimizer", default="adamw", help="adamw, adam, sgd, rmsprop, adagrad, ... (default adamw)")
    p.add_argument("--interconnect", default="nvlink", choices=(*INTERCONNECTS, "local"))
    p.add_argument("--tokens-per-step", type=float, help="global tokens per optimizer step, for the compute estimate")
    p.add_argument("--device", choices=tuple(DEVICES), help="for the compute estimate")
    p.add_argument("--mfu", type=float, default=0.4, help="model FLOP utilisation assumed for compute (default 0.4)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    return p


def make_plan(args: argparse.Namespace) -> Plan:
    link = measure_local_link() if args.interconnect == "local" else INTERCONNECTS[args.interconnect]
    if args.params is not None:
        plan = plan_params(
            args.params, args.world_size, Stage(args.stage or 3), args.precision or "bf16-mixed", args.optimizer, link
        )
    else:
        class_path, init_args, strategy, precision = (
            from_yaml(args.config) if args.config else (args.model, json.loads(args.init_args), {}, None)
        )
        if args.stage:
            strategy = {**strategy, "stage": args.stage}
        config = ShardLabConfig(
            **{k: v for k, v in strategy.items() if k in ShardLabConfig.__dataclass_fields__ and k != "unit_types"}
        )
        plan = plan_model(
            meta_model(class_path, init_args),
            config,
            args.world_size,
            args.precision or precision or "bf16-mixed",
            args.optimizer,
            link,
            class_path,
        )
    if args.tokens_per_step and args.device:
        per_rank_tokens = args.tokens_per_step / args.world_size
        plan.compute_seconds = 6 * plan.params * per_rank_tokens / (DEVICES[args.device] * args.mfu)
    return plan


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    plan = make_plan(args)
    if args.json:
        print(json.dumps(asdict(plan), indent=1))
    else:
        print_plan(plan, Console())
