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
fake tensors (budget/predicted/forward_trace.py: nothing allocated, a 7B-shaped model in seconds) and adds what
autograd saves for backward, by unit, and the step peak per rank: model state + gathered units + activations (+ the
largest recomputation with ``--activation-checkpointing``). With ``--device-memory`` it says whether that peak fits
and, when not, the change that makes it fit at the shortest step (budget/predicted/changes.py: a higher stage,
activation checkpointing, a smaller micro-batch with gradient accumulation, offload, a larger shard group):

    shardlab plan --model transformers.LlamaForCausalLM --init-args '{"num_hidden_layers": 32}' --world-size 8 \\
        --micro-batch-size 4 --seq-len 4096 --device-memory 80GB

With a traced micro-batch it also prints the time per optimizer step (budget/predicted/step_time.py): forward,
backward, optimizer, communication exposed and hidden, by collective kind, on the engine's schedule over the plan's
links, compute at ``--device`` x ``--mfu`` (default h100 x 0.4), ``--flops`` FLOP/s given, or ``--flops here``
(measured on this machine); ``--accumulate-grad-batches M`` micro-batches per step. When communication is exposed,
the cheapest change that hides it (budget/predicted/changes.py: stage, shard group, resharding, micro-batch).
From ``--params`` alone it prints each collective's time on the wire, and says compute needs a model.

    shardlab plan --model lightning_shardlab.examples.gpt.GPT --init-args '{"block_size": 1024}' --world-size 8 \\
        --interconnect 10gbe --micro-batch-size 8 --seq-len 1024 --flops here

``--optimizer muon|adafactor`` plans a whole-tensor optimizer (budget/predicted/whole_tensor.py): each parameter it
steps is owned by one rank, which keeps its state; the plan shows the fullest rank's share (about 1/W) and the
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

from lightning_shardlab.budget.measured.tiers import LINKS
from lightning_shardlab.budget.predicted.changes import add_activations, plan_time
from lightning_shardlab.budget.predicted.compute_rate import (
    MEMORY_BANDWIDTH,
    ComputeRate,
    link_share,
    measure_rate,
    sharing_cores,
)
from lightning_shardlab.budget.predicted.engine_cost import with_engine_cost
from lightning_shardlab.budget.predicted.fake_step import CONVERTED
from lightning_shardlab.budget.predicted.plan import COMPUTE, Plan, plan_model, plan_params
from lightning_shardlab.budget.predicted.run_time import local_link
from lightning_shardlab.budget.predicted.setting import Setting
from lightning_shardlab.budget.predicted.zero_table import DEVICES, INTERCONNECTS, Interconnect, Traffic
from lightning_shardlab.cli.plan_tables import print_plan, print_time
from lightning_shardlab.core.config import ShardLabConfig, import_path
from lightning_shardlab.core.display import gigabytes

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


def plan_and_setting(args: argparse.Namespace) -> tuple[Plan, Setting | None]:
    """The plan, and with a model and a micro-batch what its time per step is made from (nothing traced yet)."""
    _check_micro_batch(args)
    intra, inter, setting = *_links(args), None
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
        if precision in CONVERTED:  # as Lightning's plugin converts the module: its layouts in 2- or 8-byte elements
            model = model.to(CONVERTED[precision])
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
            rate = preset_rate(args.device or "h100", args.mfu, None if args.flops == "here" else args.flops)
            setting = Setting(
                model, config, args.world_size, precision, args.optimizer, intra, inter, class_path,
                args.micro_batch_size, args.seq_len, rate, args.accumulate_grad_batches, args.ranks_per_node,
                args.tier_link, args.data_seconds,
            )  # fmt: skip
            if args.flops == "here":  # measured as a run of the plan measures them for itself
                setting.rate, setting.link_share = rate_here(setting, _local_ranks(args, setting))
            plan = add_activations(plan, setting, args.device_memory)
    if args.tokens_per_step and args.device:
        per_rank_tokens = args.tokens_per_step / args.world_size
        plan.compute_seconds = 6 * plan.params * per_rank_tokens / (DEVICES[args.device] * args.mfu)
    return plan, setting


def make_time(args: argparse.Namespace, plan: Plan, setting: Setting | None) -> dict[str, Any]:
    """The time per step (budget/predicted/changes.py), or without a traced model each collective's time."""
    return comm_only_time(plan, *_links(args)) if setting is None else plan_time(setting)


def preset_rate(device: str, mfu: float = 0.4, flops: float | None = None) -> ComputeRate:
    """A named device (``DEVICES``): its dense peak x ``mfu``, or ``flops`` FLOP/s given; its datasheet bandwidth
    (compute_rate.py's ``MEMORY_BANDWIDTH``). ``ValueError`` naming the option for an unknown device or a rate that
    is not positive."""
    if device not in DEVICES:
        raise ValueError(f"--device {device!r} is not known. HINT: one of {', '.join(DEVICES)}.")
    if flops is not None and flops <= 0 or not 0 < mfu <= 1:
        raise ValueError(f"--flops must be > 0 and --mfu in (0, 1], not {flops} and {mfu}.")
    name = f"given: {flops:.3g} FLOP/s" if flops is not None else f"{device} peak {DEVICES[device]:.3g} x {mfu:g}"
    kind = "cpu" if device.startswith("cpu") else "cuda"
    rate = flops if flops is not None else DEVICES[device] * mfu
    return ComputeRate(f"{name}, {MEMORY_BANDWIDTH[device] / 1e9:,.0f} GB/s", rate, MEMORY_BANDWIDTH[device], 0.0, kind)


def comm_only_time(plan: Plan, intra: Interconnect, inter: Interconnect) -> dict[str, Any]:
    """What a plan without a traced micro-batch can time: each collective kind's seconds on the wire, the ring lower
    bound over its calls (``Plan.traffic``), none known to be hidden."""
    traffic, group, reshard = Traffic(**plan.traffic), plan.shard_group_size, plan.reshard_size
    out = {}
    for kind in ("all_gather", "reduce_scatter"):
        scopes = ("world", "shard")
        out[kind] = intra.ring_seconds(
            traffic.scope_bytes(*scopes, kind=kind), group, traffic.scope_calls(*scopes, kind=kind)
        )
        if reshard:
            nbytes, calls = traffic.scope_bytes("reshard", kind=kind), traffic.scope_calls("reshard", kind=kind)
            out[kind] += intra.ring_seconds(nbytes, reshard, calls)
    calls, nbytes = traffic.scope_calls("replica"), traffic.scope_bytes("replica")
    out["all_reduce"] = inter.all_reduce_seconds(nbytes, plan.replicas, calls) if calls else 0.0
    return {
        "by_collective": {kind: {"seconds": s, "exposed": None} for kind, s in out.items() if s > 0},
        "note": "compute, and so what hides behind it, needs a model: --model or --config with --micro-batch-size"
        " and --seq-len",
    }


def _local_ranks(args: argparse.Namespace, setting: Setting) -> int:
    """The ranks the plan puts on this machine: all of them when every link is ``local``, else one node's."""
    local = {args.intra or args.interconnect, args.inter or args.interconnect} == {"local"}
    return setting.world_size if local else args.ranks_per_node or 1


def rate_here(setting: Setting, ranks_here: int) -> tuple[ComputeRate, float]:
    """(the rate, the links' share) measured here as a run of the plan measures them for itself (budget/callback.py,
    run_time.py): the model's matmuls, a kernel's costs and the engine's work at the plan's stage, shared by the
    ``ranks_here`` ranks of this machine, and what their compute leaves the links."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = COMPUTE[setting.precision] or CONVERTED.get(setting.precision, torch.float32)
    rate = with_engine_cost(measure_rate(device, dtype, setting.compute()), setting.config.stage)
    return sharing_cores(rate, ranks_here), link_share(device.type, ranks_here)


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    try:
        plan, setting = plan_and_setting(args)
        time = make_time(args, plan, setting)
    except ValueError as err:
        sys.exit(f"shardlab plan: error: {err}")
    if args.json:
        print(json.dumps({**asdict(plan), "time": time}, indent=1))
    else:
        console = Console()
        print_plan(plan, console)
        print_time(time, console)
