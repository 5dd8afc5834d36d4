"""The step's peak of tensor memory, predicted against measured, over stages, shapes and activation checkpointing.

    python -m benchmarks.step_peak             # writes benchmarks/STEP_PEAK.md
    python -m benchmarks.step_peak --quick     # the example GPT at stage 3 only, printed

Two CPU ranks (gloo; four for ``reshard_after_forward=2``), AdamW in fp32 (some in ``bf16-mixed``), two optimizer
steps per configuration, ``ShardLabBudget(step_peak=True)``: measured on the first step after the warm-up
(budget/measured/step_peak.py: on CPU, what is live as the step starts, read from the real tensors, plus every
allocation and free the step makes), predicted from the first batch run under fake tensors on the engine's schedule
and the optimizers' step on fakes of this rank's masters (budget/predicted/step_timeline.py,
budget/predicted/optimizer_peak.py, budget/predicted/first_batch.py). Beside them, the plan's step peak for the same
model and shape (budget/predicted/setting.py: the same timeline without gloo's receive rooms, as ``shardlab plan
--micro-batch-size B
--seq-len T`` prints it). Models: the example GPT and a Hugging Face Llama
built from its config (4 layers each, one unit per block).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.ranks import QUIET, run_ranks
from lightning_shardlab import ShardLabBudget, ShardLabStrategy

HERE = Path(__file__).resolve().parent
VOCAB = 256
SHAPES = [(2, 64), (4, 128)]  # (micro-batch, sequence length)


class Llama(L.LightningModule):
    """A four-layer Hugging Face Llama built from its config (nothing downloaded), trained on its own loss."""

    def __init__(self) -> None:
        super().__init__()
        import transformers

        config = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        )  # fmt: skip
        self.model = transformers.LlamaForCausalLM(config)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self.model(input_ids=batch[0], labels=batch[1]).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def build(name: str) -> tuple[L.LightningModule, type]:
    torch.manual_seed(0)
    if name == "gpt":
        from lightning_shardlab.examples.gpt import GPT, Block

        return GPT(vocab_size=VOCAB, block_size=128, n_layer=4, n_head=4, n_embd=64), Block
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return Llama(), LlamaDecoderLayer


def planned_peak(name: str, strategy: ShardLabStrategy, b: int, t: int, world: int, precision: str) -> float:
    from lightning_shardlab.budget.predicted.compute_rate import ComputeRate
    from lightning_shardlab.budget.predicted.plan import plan_model
    from lightning_shardlab.budget.predicted.setting import Setting
    from lightning_shardlab.budget.predicted.zero_table import INTERCONNECTS

    link = INTERCONNECTS["nvlink"]  # no memory figure depends on it
    rate = ComputeRate("given", 1e12, 1e12)  # nor on the rate
    setting = Setting(build(name)[0], strategy.config, world, precision, "adamw", link, link, name, b, t, rate)
    plan = plan_model(setting.model, strategy.config, world, precision, "adamw", link, name)
    return setting.peak(plan).total


def measure(configs: list[tuple], directory: str, devices: int = 2) -> list[dict[str, Any]]:
    """Each of ``configs`` (model, stage, micro-batch, sequence length, checkpointing[, strategy options])."""
    out = []
    for name, stage, b, t, checkpointing, *more in configs:
        options = dict(more[0]) if more else {}
        precision = options.pop("precision", "32-true")
        model, block = build(name)
        strategy = ShardLabStrategy(
            stage=stage, unit_classes=[block], sanity_every_n_steps=0, activation_checkpointing=checkpointing, **options
        )
        ids = torch.randint(0, VOCAB, (4 * b, t + 1), generator=torch.Generator().manual_seed(0))
        budget = ShardLabBudget(step_peak=True)
        trainer = L.Trainer(
            accelerator="cpu", devices=devices, strategy=strategy, max_steps=2, callbacks=[budget], precision=precision,
            default_root_dir=f"{directory}/{name}-{stage}-{b}x{t}-{checkpointing}", **QUIET,
        )  # fmt: skip
        trainer.fit(model, DataLoader(TensorDataset(ids[:, :-1], ids[:, 1:]), batch_size=b))
        report = budget.reports[trainer.global_rank]
        out.append({
            "config": f"{name} stage {stage} {b}x{t}{' ckpt' if checkpointing else ''}"
            + "".join(f" {k}={v}" for k, v in options.items())
            + (f" {precision}" if precision != "32-true" else "")
            + (f" ({devices} ranks)" if devices != 2 else ""),
            "measured": {phase: v["peak"] for phase, v in report["step_peak_measured"].items()},
            "predicted": report["step_peak_predicted"],
            "planned": planned_peak(name, strategy, b, t, devices, precision),
        })  # fmt: skip
    return out


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| configuration | measured forward / backward / optimizer, kB | predicted forward / backward / optimizer, kB |"
        " measured / predicted (step) | the predicted moment | plan (no gloo rooms), kB |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        m, p = r["measured"], r["predicted"]
        step = max(m.values()) / p["total"]
        predicted = " / ".join(f"{p['by_phase'].get(k, 0) / 1e3:,.1f}" for k in ("forward", "backward", "optimizer"))
        lines.append(
            f"| {r['config']} | {m['forward'] / 1e3:,.1f} / {m['backward'] / 1e3:,.1f} / {m['optimizer'] / 1e3:,.1f}"
            f" | {predicted} | {step:.3f} |"
            f" {p['where']} | {r['planned'] / 1e3:,.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        configs = [("gpt", 3, b, t, ckpt) for b, t in SHAPES for ckpt in (False, True)]
    else:
        configs = [
            (name, stage, b, t, ckpt)
            for name in ("gpt", "llama")
            for stage in (1, 2, 3)
            for b, t in SHAPES
            for ckpt in (False, True)
        ]
        mixed = {"precision": "bf16-mixed"}
        configs += [
            (name, stage, 2, 64, ckpt, mixed) for name in ("gpt", "llama") for stage in (2, 3) for ckpt in (False, True)
        ]
    import tempfile

    regrouped = [("gpt", 3, 2, 64, ckpt, {"reshard_after_forward": 2}) for ckpt in (False, True)]
    with tempfile.TemporaryDirectory() as directory:
        rows = run_ranks(measure, 2, {"configs": configs, "directory": directory})[0]
        if not args.quick:  # backward gathers in reshard groups of 2 inside a shard group of 4
            rows += run_ranks(measure, 4, {"configs": regrouped, "directory": directory, "devices": 4})[0]
    ratios = [max(r["measured"].values()) / r["predicted"]["total"] for r in rows]
    text = (
        "# The step's peak: predicted against measured\n\n"
        "`python -m benchmarks.step_peak` (2 CPU ranks, 4 for `reshard_after_forward=2`, gloo, AdamW, fp32 unless"
        " marked bf16-mixed; rank 0's"
        " figures). Measured on the first"
        " step after the warm-up; predicted from the first batch run under fake tensors on the engine's schedule."
        f" Measured / predicted over {len(rows)} configurations: {min(ratios):.3f}-{max(ratios):.3f}.\n\n"
        + table(rows)
        + "\n"
    )
    print(text)
    if not args.quick:
        (HERE / "STEP_PEAK.md").write_text(text)


if __name__ == "__main__":
    main()
