"""``shardlab plan``: the budget of a run before buying the hardware (the arithmetic: budget/predicted/plan.py).

From a parameter count (the ZeRO table) or from a real model (its real unit layout at the target
world size, computed on the meta device: no memory, no processes), with stage, world size,
precision, optimizer and an interconnect (a named preset, or ``local``: measured here with two gloo
ranks), it prints per-rank bytes by category, bytes moved per step, the lower-bound communication
time, and — given tokens per step and a device — whether that time can hide behind compute.

Hybrid sharding (``--shard-group-size G``): each shard group of G ranks shards the model as a world of G
would (per-rank bytes at N = G), and the R = W / G groups all-reduce their gradient shards across each
other; ``--intra`` and ``--inter`` name the link inside a group and the link across groups, and the time
on each is shown apart. ``--reshard-after-forward K`` (stage 3) keeps 1/K of each unit between forward and
backward, so backward gathers inside K ranks.

    shardlab plan --params 70e9 --world-size 64 --stage 3
    shardlab plan --params 70e9 --world-size 64 --shard-group-size 8 --intra nvlink --inter infiniband
    shardlab plan --model lightning_shardlab.examples.gpt.GPT --init-args '{"n_layer": 12}' --world-size 8
    shardlab plan --config configs/gpt_finetune_cpu.yaml --world-size 4 --json
    shardlab plan --params 13e9 --world-size 8 --offload cpu --device-memory 80GB

``--offload cpu|disk`` puts the masters and the optimizer state in host memory or on disk (budget/measured/tiers.py):
the plan then shows what lives in each tier, what moves to and from it per step and the time on
``--tier-link``; ``--device-memory`` says whether what stays on the device fits.

``--micro-batch-size B --seq-len T`` (with ``--model`` or ``--config``) traces one micro-batch of the model under
fake tensors (budget/predicted/activation_trace.py: nothing allocated, a 7B-shaped model in seconds) and adds what
autograd saves for backward, by unit, and the step peak per rank: model state + gathered units + activations (+ the
largest recomputation with ``--activation-checkpointing``). With ``--device-memory`` it says whether that peak fits and,
when not, the cheapest change that makes it fit (budget/predicted/fits.py: a higher stage, activation checkpointing, a
smaller micro-batch with gradient accumulation, offload, a larger shard group):

    shardlab plan --model transformers.LlamaForCausalLM --init-args '{"num_hidden_layers": 32}' --world-size 8 \\
        --micro-batch-size 4 --seq-len 4096 --device-memory 80GB

With a traced micro-batch it also prints the time per optimizer step (budget/predicted/step_time.py): forward,
backward, optimizer, communication exposed and hidden, by collective kind, on the engine's schedule over the plan's
links, compute at ``--device`` x ``--mfu`` (default h100 x 0.4), ``--flops`` FLOP/s given, or ``--flops here``
(measured on this machine); ``--accumulate-grad-batches M`` micro-batches per step. When communication is exposed,
the cheapest change that hides it (budget/predicted/plan_time.py: stage, shard group, resharding, micro-batch).
From ``--params`` alone it prints each collective's time on the wire, and says compute needs a model.

    shardlab plan --model lightning_shardlab.examples.gpt.GPT --init-args '{"block_size": 1024}' --world-size 8 \\
        --interconnect 10gbe --micro-batch-size 8 --seq-len 1024 --flops here

``--optimizer muon|adafactor`` plans a whole-tensor optimizer (budget/predicted/plan_whole.py): each parameter it steps
is owned by one rank, which keeps its state; the plan shows the fullest rank's share (about 1/W) and the
all-to-alls per step. With ``--model`` or ``--config``, Muon steps the parameters of 2+ dimensions inside
units other than the root (the blocks' matrices) and AdamW the rest, the usual recipe; from ``--params``,
the 1/W ideal.

    shardlab plan --model lightning_shardlab.examples.gpt.GPT --world-size 8 --optimizer muon
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import yaml
from rich.console import Console
from rich.table import Table

from lightning_shardlab.budget.measured.memory import MEMORY_CATEGORIES
from lightning_shardlab.budget.measured.tiers import (
    LINKS,
    plan_rows,
)
from lightning_shardlab.budget.predicted.compute_rate import measure_rate, preset_rate
from lightning_shardlab.budget.predicted.fits import Setting, add_activations
from lightning_shardlab.budget.predicted.plan import COMPUTE, Plan, plan_model, plan_params
from lightning_shardlab.budget.predicted.plan_time import (
    TimedSetting,
    basis_line,
    change_rows,
    choice_line,
    comm_only_time,
    plan_time,
    time_rows,
)
from lightning_shardlab.budget.predicted.run_time import local_link
from lightning_shardlab.budget.predicted.zero_table import (
    DEVICES,
    INTERCONNECTS,
    Interconnect,
    Traffic,
)
from lightning_shardlab.core.config import ShardLabConfig, import_path
from lightning_shardlab.core.display import gigabytes, print_table, size

# ---- inputs: a model from an import path or a LightningCLI YAML ----


def meta_model(class_path: str, init_args: dict[str, Any]) -> torch.nn.Module:
    """Build the model on the meta device (shapes only), running ``configure_model`` if it has one. A Hugging Face
    model class (one with a ``config_class``) is built from its config, the init args being the config's."""
    cls = import_path(class_path, "--model")
    config_class = getattr(cls, "config_class", None)
    with torch.device("meta"):
        model = cls(config_class(**init_args)) if isinstance(config_class, type) else cls(**init_args)
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


# ---- output ----


def _gb(n: float) -> str:
    return size(n, decimal=True)  # as hardware is sold


def _grouping(plan: Plan) -> str:
    """'64 ranks = 8 shard groups x 8 ranks' (hybrid), or '64 ranks'; with reshard groups of k."""
    text = f"{plan.world_size} ranks"
    if plan.replicas > 1:
        text += f" = {plan.replicas} shard groups x {plan.shard_group_size} ranks"
    if plan.reshard_size:
        text += f", backward gathers in reshard groups of {plan.reshard_size}"
    return text


def print_plan(plan: Plan, console: Console) -> None:
    """Per-rank bytes, bytes moved per step inside and across groups, and the time on each link."""
    traffic = Traffic(**plan.traffic)
    table = Table(title=f"shardlab plan: {plan.source}")
    table.add_column("")
    table.add_column("per rank", justify="right")
    for cat in MEMORY_CATEGORIES:
        table.add_row(cat, _gb(plan.memory_per_rank.get(cat, 0.0)))
    table.add_row("model state per rank", _gb(plan.model_state))
    table.add_row("unsharded (one device)", _gb(plan.unsharded_bytes))
    if plan.gathered_peak:
        table.add_row("gathered units at peak", _gb(plan.gathered_peak))
    for label, value in activation_rows(plan):
        table.add_row(label, value)
    hybrid = plan.replicas > 1
    inside = "moved per step in each shard group (full tensors)" if hybrid else "moved per step (full tensors)"
    table.add_row(inside, _gb(traffic.scope_bytes("world", "shard", rings=True)))
    if plan.reshard_size:
        table.add_row("moved per step in each reshard group (full tensors)", _gb(traffic.scope_bytes("reshard")))
    if hybrid:
        table.add_row("moved per step across shard groups (all-reduced shards)", _gb(traffic.scope_bytes("replica")))
        table.add_row(f"intra-group link >= ({plan.links['intra']})", _ms(plan.link_seconds["intra"]))
        table.add_row(f"inter-group link >= ({plan.links['inter']})", _ms(plan.link_seconds["inter"]))
        table.add_row("communication >= (both links)", _ms(plan.comm_seconds))
    else:
        table.add_row(f"communication >= ({plan.interconnect})", _ms(plan.comm_seconds))
    fields = asdict(plan)
    if plan.step_peak is not None:  # the verdict is the step peak's (below), not the model state's alone
        fields["device_memory"] = None
    for label, value in [*whole_rows(plan.whole_tensor, plan.world_size), *plan_rows(fields)]:
        table.add_row(label, _gb(value) if isinstance(value, float) else value)
    if plan.compute_seconds is not None:
        verdict = "hides behind compute" if plan.comm_seconds <= plan.compute_seconds else "exceeds compute"
        table.add_row("compute per step (estimate)", _ms(plan.compute_seconds))
        table.add_row("communication", verdict)
    print_table(console, table)
    console.print(
        f"{plan.params:,} parameters, stage {plan.stage}, {_grouping(plan)}, {plan.precision}", soft_wrap=True
    )
    print_fit(plan, console)
    if plan.whole_tensor:
        console.print(
            f"{plan.whole_tensor['recipe']}; each parameter {plan.whole_tensor['optimizer']} steps is stepped whole"
            " on one owner rank, which alone keeps its state: per step one all-to-all gathers its averaged gradient"
            " pieces (and values, unless the owner holds the parameter whole), one returns the new values.",
            soft_wrap=True,
        )


def activation_rows(plan: Plan) -> list[tuple[str, str]]:
    """(label, text) rows for a traced micro-batch: what it saves, the largest unit, the step peak, the verdict."""
    acts, peak = plan.activations, plan.step_peak
    if acts is None or peak is None:
        return []
    ckpt = acts["checkpointing"]
    by_unit = acts["checkpointed_by_unit" if ckpt else "by_unit"]
    units = {k: v for k, v in by_unit.items() if k != "root"}
    shape = f"{acts['micro_batch_size']} x {acts['seq_len']}"
    ckpt_text = f", {len(acts['checkpointed'])} modules checkpointed" if ckpt else ""
    total = acts["checkpointed_total" if ckpt else "total"]
    rows = [(f"saved for backward (micro-batch {shape}{ckpt_text}; traced)", _gb(total))]
    rows.append(("  of which the root unit", _gb(by_unit.get("root", 0))))
    if units:
        largest = max(units, key=units.get)
        rows.append((f"  the largest unit ({largest}; {len(units)} units)", _gb(units[largest])))
    if ckpt:
        rows.append(("recompute peak (largest checkpointed module, in backward)", _gb(acts["recompute_peak"])))
    rows.append(("live at the step's busiest moment (traced)", _gb(peak["traced"])))
    rows.append(("  gathered then / in flight then", f"{_gb(peak['gathered'])} / {_gb(peak['in_flight'])}"))
    rows.append(("step peak per rank", _gb(peak["total"])))
    if plan.fit is not None:
        rows.append((f"in {plan.fit['device_memory'] / 1e9:,.0f} GB of device memory", _verdict(plan.fit)))
    return rows


def _verdict(fit: dict[str, Any]) -> str:
    if fit["fits"]:
        return "fits"
    return f"does not fit; cheapest change: {fit['choice']}" if fit["choice"] else "does not fit; no single change fits"


def print_fit(plan: Plan, console: Console) -> None:
    """The step peak as arithmetic, and with --device-memory every change tried, the cheapest that fits marked."""
    if plan.step_peak is None:
        return
    console.print(f"step peak per rank: {plan.step_peak['arithmetic']}", soft_wrap=True)
    if plan.fit is None or plan.fit["fits"]:
        return
    table = Table(title=f"changes that fit the step in {_gb(plan.fit['device_memory'])} (cheapest first)")
    for col in ("change", "step peak", "fits", "added per step >=", "cost"):
        table.add_column(col, justify="left" if col in ("change", "cost") else "right")
    ordered = sorted(plan.fit["candidates"], key=lambda c: (not c["fits"], c["added_seconds"]))
    for c in ordered:
        mark = " (chosen)" if c["name"] == plan.fit["choice"] else ""
        table.add_row(
            c["name"] + mark, _gb(c["peak"]["total"]), "yes" if c["fits"] else "no", _ms(c["added_seconds"]), c["cost"]
        )
    print_table(console, table)


def whole_rows(whole: dict[str, Any] | None, world_size: int) -> list[tuple[str, float | str]]:
    """(label, bytes or text) rows for a whole-tensor optimizer: the fullest owner, the 1/W ideal, the exchanges."""
    if not whole:
        return []
    name, fullest, busiest = whole["optimizer"], whole["fullest_rank"], whole["busiest_rank"]
    owned = f"{fullest['owned_params']:,} parameters, " if whole["params"] else ""
    share = fullest["owned_numel"] / max(whole["numel"], 1)
    return [
        (
            f"{name}: owned by the fullest rank ({fullest['rank']})",
            f"{owned}{fullest['owned_numel']:,.0f} of {whole['numel']:,.0f} elements ({share:.1%}; 1/W"
            f" {1 / world_size:.1%})",
        ),
        (f"{name} state of the fullest rank (whole tensors)", float(fullest["state_bytes"])),
        (f"{name} state per rank, the 1/W ideal", float(whole["ideal_state_bytes_per_rank"])),
        (
            f"all-to-all per step: {whole['calls_per_step']} calls, sent by the busiest rank ({busiest['rank']})",
            float(busiest["gather_bytes"] + busiest["return_bytes"]),
        ),
    ]


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f} ms"


def print_time(time: dict[str, Any], console: Console) -> None:
    """The time per step: its parts, by collective kind, and (communication exposed) the changes tried; without
    compute, each collective's time on the wire."""
    if "step" not in time:
        rows = [(kind, _ms(entry["seconds"])) for kind, entry in time["by_collective"].items()]
        _rows_table(console, "time per step: communication", ("collective", "on the wire >="), rows)
        console.print(time["note"], soft_wrap=True)
        return
    _rows_table(console, "time per step (predicted)", ("", "per step", "share"), time_rows(time))
    console.print(basis_line(time), soft_wrap=True)
    if "changes" in time:
        title = f"changes that hide communication ({_ms(time['comm_exposed'])} exposed of {_ms(time['step'])})"
        _rows_table(console, title, ("change", "step", "comm exposed", "vs now", "note"), change_rows(time))
        console.print(choice_line(time), soft_wrap=True)


def _rows_table(console: Console, title: str, columns: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    table = Table(title=title)
    for i, col in enumerate(columns):
        table.add_column(col, justify="left" if i == 0 or col == "note" else "right")
    for row in rows:
        table.add_row(*row)
    print_table(console, table)


# ---- the command ----


def group_size(text: str) -> int | str:
    """``--shard-group-size``: a number of ranks, or 'node'."""
    return text if text == "node" else int(text)


def flops(text: str) -> float | str:
    """``--flops``: a FLOP/s figure, or 'here'."""
    return text if text == "here" else float(text)


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
    p.add_argument(
        "--optimizer",
        default="adamw",
        help="adamw, adam, sgd, rmsprop, adagrad, ... (default adamw); or a whole-tensor optimizer, each parameter"
        " stepped whole on one owner rank: muon (with --model/--config the usual recipe: Muon steps the parameters"
        " of 2+ dimensions inside units other than the root, AdamW the rest) or adafactor (every parameter)",
    )
    p.add_argument("--shard-group-size", type=group_size, help="hybrid: G ranks shard the model, or 'node'")
    p.add_argument("--ranks-per-node", type=int, help="for --shard-group-size node (default: the world size)")
    p.add_argument("--reshard-after-forward", type=int, metavar="K", help="stage 3: gather for backward in K ranks")
    # the presets (budget/predicted/zero_table.py's INTERCONNECTS), e.g. 10gbe: 10 Gb/s line rate (IEEE 802.3ae) = 1.25
    # GB/s per direction, and 50 us per message: a small TCP message through two hosts' kernel stacks and a switch
    # (netperf TCP_RR round trips on 10 GbE NICs measure tens of us); `local` measures this machine instead
    links = (*INTERCONNECTS, "local")
    p.add_argument("--interconnect", default="nvlink", choices=links, help="every link (default nvlink)")
    p.add_argument("--intra", choices=links, help="the link inside shard groups (default: --interconnect)")
    p.add_argument("--inter", choices=links, help="the link across shard groups (default: --interconnect)")
    p.add_argument("--tokens-per-step", type=float, help="global tokens per optimizer step, for the compute estimate")
    p.add_argument("--device", choices=tuple(DEVICES), help="for the compute estimate")
    p.add_argument("--mfu", type=float, default=0.4, help="model FLOP utilisation assumed for compute (default 0.4)")
    p.add_argument("--offload", choices=("none", "cpu", "disk"), help="masters and optimizer state on host or disk")
    p.add_argument("--tier-link", choices=tuple(LINKS), help="the link to the offload tier (default nvme / pcie5)")
    p.add_argument(
        "--device-memory",
        type=gigabytes,
        help="e.g. 80GB: does the model state fit on one device? With --micro-batch-size, the step's peak, and if"
        " not the cheapest change that makes it fit",
    )
    p.add_argument("--micro-batch-size", type=int, metavar="B", help="trace one micro-batch of B sequences per rank")
    p.add_argument("--seq-len", type=int, metavar="T", help="tokens per sequence of the traced micro-batch")
    p.add_argument(
        "--activation-checkpointing", action="store_true", help="plan with every unit's modules checkpointed"
    )
    time_arguments(p)
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    return p


def time_arguments(p: argparse.ArgumentParser) -> None:
    """The options of the time per step (with --micro-batch-size and --seq-len)."""
    p.add_argument(
        "--flops",
        type=flops,
        help="FLOP/s the matmuls sustain, for the time per step (default: --device x --mfu), or"
        " 'here': measured on this machine",
    )
    p.add_argument("--accumulate-grad-batches", type=int, default=1, metavar="M", help="micro-batches per step")
    p.add_argument("--data-seconds", type=float, default=0.0, help="seconds per step waiting for data (default 0)")


def _links(args: argparse.Namespace) -> tuple[Interconnect, Interconnect]:
    """(intra, inter): the named presets, ``local`` measured once here."""
    names = (args.intra or args.interconnect, args.inter or args.interconnect)
    measured = local_link() if "local" in names else None
    intra, inter = (measured if name == "local" else INTERCONNECTS[name] for name in names)
    return intra, inter


def _strategy_options(strategy: dict[str, Any], args: argparse.Namespace) -> ShardLabConfig:
    """The config's strategy options, with the command line's stage and groups over them."""
    given = {
        "stage": args.stage,
        "shard_group_size": args.shard_group_size,
        "reshard_after_forward": args.reshard_after_forward,
        "offload": args.offload,
        "activation_checkpointing": True if args.activation_checkpointing else None,
    }
    strategy = {**strategy, **{k: v for k, v in given.items() if v is not None}}
    fields = ShardLabConfig.__dataclass_fields__
    return ShardLabConfig(**{k: v for k, v in strategy.items() if k in fields})


def _check_micro_batch(args: argparse.Namespace) -> None:
    """``ValueError`` naming the option unless --micro-batch-size and --seq-len come together, with a model."""
    traced = (args.micro_batch_size, args.seq_len)
    if args.activation_checkpointing and args.micro_batch_size is None:
        raise ValueError("--activation-checkpointing plans activations. HINT: add --micro-batch-size and --seq-len.")
    if any(v is not None for v in traced) and any(v is None for v in traced):
        raise ValueError("--micro-batch-size and --seq-len go together. HINT: give both, e.g. 4 and 2048.")
    if any(v is not None and v < 1 for v in traced):
        raise ValueError(f"--micro-batch-size and --seq-len must be >= 1, not {traced}.")
    if args.accumulate_grad_batches < 1:
        raise ValueError(f"--accumulate-grad-batches must be >= 1, not {args.accumulate_grad_batches}.")
    if args.micro_batch_size is not None and args.params is not None:
        raise ValueError(
            "--micro-batch-size traces the model's own forward: a parameter count has none. HINT: --model or --config."
        )


def make_plan(args: argparse.Namespace) -> Plan:
    """The plan the command line asks for. Raises ``ValueError`` naming the option on a bad one."""
    return plan_and_setting(args)[0]


def plan_and_setting(args: argparse.Namespace) -> tuple[Plan, TimedSetting | None]:
    """The plan, and with a model and a micro-batch what its time per step is made from (nothing traced yet)."""
    _check_micro_batch(args)
    intra, inter, timed = *_links(args), None
    if args.params is not None:
        config = _strategy_options({"stage": 3}, args)
        precision = args.precision or "bf16-mixed"
        plan = plan_params(
            args.params, args.world_size, config.stage, precision, args.optimizer, intra,
            inter=inter, config=config, per_node=args.ranks_per_node, offload=config.offload,
            tier_link=args.tier_link, device_memory=args.device_memory,
        )  # fmt: skip
    else:
        class_path, init_args, strategy, precision = (
            from_yaml(args.config) if args.config else (args.model, json.loads(args.init_args), {}, None)
        )
        model, config = meta_model(class_path, init_args), _strategy_options(strategy, args)
        precision = args.precision or precision or "bf16-mixed"
        plan = plan_model(
            model,
            config,
            args.world_size,
            precision,
            args.optimizer,
            intra,
            class_path,
            inter=inter,
            per_node=args.ranks_per_node,
            tier_link=args.tier_link,
            device_memory=args.device_memory,
        )
        if args.micro_batch_size is not None:
            setting = Setting(
                model, config, args.world_size, precision, args.optimizer, intra, inter, class_path,
                args.micro_batch_size, args.seq_len, args.ranks_per_node, args.tier_link, args.device or "h100",
                args.mfu,
            )  # fmt: skip
            plan = add_activations(plan, setting, args.device_memory)
            rate = preset_rate(args.device or "h100", args.mfu, None if args.flops == "here" else args.flops)
            timed = TimedSetting(
                model, config, args.world_size, precision, args.optimizer, intra, inter, rate, args.micro_batch_size,
                args.seq_len, args.accumulate_grad_batches, args.ranks_per_node, args.data_seconds,
            )  # fmt: skip
    if args.tokens_per_step and args.device:
        per_rank_tokens = args.tokens_per_step / args.world_size
        plan.compute_seconds = 6 * plan.params * per_rank_tokens / (DEVICES[args.device] * args.mfu)
    return plan, timed


def make_time(args: argparse.Namespace, plan: Plan, timed: TimedSetting | None) -> dict[str, Any]:
    """The time per step (budget/predicted/plan_time.py), or without a traced model each collective's time."""
    if timed is None:
        return comm_only_time(plan, *_links(args))
    if args.flops == "here":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        dtype = COMPUTE[timed.precision] or (torch.bfloat16 if timed.precision == "bf16-true" else torch.float32)
        timed.rate = measure_rate(device, dtype, timed.compute().matmuls)
    return plan_time(timed)


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    try:
        plan, timed = plan_and_setting(args)
        time = make_time(args, plan, timed)
    except ValueError as err:
        sys.exit(f"shardlab plan: error: {err}")
    if args.json:
        print(json.dumps({**asdict(plan), "time": time}, indent=1))
    else:
        console = Console()
        print_plan(plan, console)
        print_time(time, console)
