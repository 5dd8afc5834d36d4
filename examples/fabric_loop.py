"""A complete Fabric training loop, fully sharded (ZeRO stage 3) on 2 CPU ranks.

    python examples/fabric_loop.py                 # the example GPT, bytes of Python's help topics
    python examples/fabric_loop.py --model litgpt  # a litgpt GPT (pip install --no-deps litgpt==0.5.13 psutil)

What a litgpt-style loop does, on shardlab: ``fabric.setup`` (the model and its optimizer together, as stage 3
needs), gradient accumulation under ``no_backward_sync``, clipping by the global norm, a warm-up + cosine
schedule, a sharded checkpoint half-way that the run reloads and continues from, and the budget, the sanity
guard and the vital signs called by hand (Fabric has no Trainer hooks to call them).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F

from lightning_shardlab import SanityConfig, SanityGuard, ShardLabBudget, ShardLabVitals
from lightning_shardlab.examples.gpt import GPT, WarmupCosine
from lightning_shardlab.examples.text import encode, python_topics
from lightning_shardlab.fabric import ShardLabStrategy

BLOCK, LOCAL, MICRO = 64, 4, 2  # context, sequences per rank and micro-batch, micro-batches per step


def make_model(kind: str) -> torch.nn.Module:
    if kind == "litgpt":
        from litgpt import GPT as LitGPT
        from litgpt import Config

        config = Config(n_layer=4, n_embd=128, n_head=4, vocab_size=256, padded_vocab_size=256, block_size=BLOCK)
        return LitGPT(config)
    return GPT(vocab_size=256, block_size=BLOCK, n_layer=4, n_head=4, n_embd=128)


def batches(tokens: torch.Tensor, step: int, rank: int, world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Step ``step``'s micro-batches for this rank: fixed offsets, the same global batch at any world size."""
    g = torch.Generator().manual_seed(step)
    starts = torch.randint(0, len(tokens) - BLOCK - 1, (MICRO, LOCAL * world), generator=g)
    out = []
    for micro in starts:
        mine = micro[rank::world]
        x = torch.stack([tokens[s : s + BLOCK] for s in mine]).long()
        y = torch.stack([tokens[s + 1 : s + BLOCK + 1] for s in mine]).long()
        out.append((x, y))
    return out


def train(fabric: L.Fabric, model, optimizer, schedule, tokens, steps: range, tools: dict) -> list[float]:
    losses = []
    for step in steps:
        tools["guard"].before_step(step, None)
        tools["budget"].step_start()
        tools["vitals"].step_start()
        total = 0.0
        for m, (x, y) in enumerate(batches(tokens, step, fabric.global_rank, fabric.world_size)):
            with fabric.no_backward_sync(model, enabled=m < MICRO - 1):
                logits = model(x)
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)) / MICRO
                fabric.backward(loss)
            total += loss.item()
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        tools["vitals"].before_optimizer_step(optimizer)
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
        tools["vitals"].step_end(torch.tensor(total))
        tools["budget"].step_end()
        losses.append(fabric.all_reduce(torch.tensor(total)).item())
        fabric.print(f"step {step:3d}  loss {losses[-1]:.4f}  lr {schedule.get_last_lr()[0]:.2e}")
    return losses


def setup(fabric: L.Fabric, kind: str, steps: int):
    with fabric.init_module(empty_init=False):
        model = make_model(kind)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.1)
    model, optimizer = fabric.setup(model, optimizer)  # stage 3: together (see the README, "From Fabric")
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupCosine(warmup=4, total=steps, floor=0.1))
    return model, optimizer, schedule


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("gpt", "litgpt"), default="gpt")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--out", default="runs/fabric")
    args = parser.parse_args(argv)
    fabric = L.Fabric(accelerator="cpu", devices=args.devices, strategy=ShardLabStrategy(stage=3))
    fabric.launch()
    torch.manual_seed(0)
    tokens = encode(python_topics())
    out = Path(args.out)
    model, optimizer, schedule = setup(fabric, args.model, args.steps)
    budget, vitals = ShardLabBudget(), ShardLabVitals(dashboard_dir=str(out / "vitals"))
    budget.watch(fabric, model, optimizer, micro_batches=MICRO, directory=out)
    vitals.watch(fabric, model)
    guard = SanityGuard(fabric.strategy.sharded_model(model), [optimizer], SanityConfig(every_n_steps=5))
    half = args.steps // 2
    with guard:
        tools = {"guard": guard, "budget": budget, "vitals": vitals}
        first = train(fabric, model, optimizer, schedule, tokens, range(half), tools)
        state = {"model": model, "optimizer": optimizer, "schedule": schedule, "step": half}
        fabric.save(out / "checkpoint", state)  # sharded: every rank writes its slices; atomic, verified
        state["step"] = 0
        fabric.load(out / "checkpoint", state)  # what a resumed run does (any world size or stage works)
        rest = train(fabric, model, optimizer, schedule, tokens, range(state["step"], args.steps), tools)
    budget.report()
    paths = vitals.finish()
    losses = first + rest
    fabric.print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} (perplexity {math.exp(losses[-1]):.2f})")
    if fabric.global_rank == 0 and paths:
        fabric.print(f"vital signs dashboard: {paths.get('html')}")


if __name__ == "__main__":
    main()
