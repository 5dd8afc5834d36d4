"""Whole-tensor optimizers on the 14M GPT: the usual Muon recipe under shardlab stages 2-3 against Lightning ddp.

    python -m benchmarks.whole_tensor                 # 5 interleaved repeats; writes its section of RESULTS.md
    python -m benchmarks.whole_tensor --quick         # 1 repeat, printed only: checks that the script runs

The recipe: torch.optim.Muon on the transformer blocks' 2-D matrices, AdamW on everything else (embeddings,
norms, the tied head), two optimizers stepped by hand (``automatic_optimization = False``). The model, data,
init and machine setup are bench.py's "default" setting: 2 CPU ranks, 1 thread each, gloo, fp32; a sample is
the median of the timed steps after warm-up, in fresh processes; each repeat runs every variant once, in
turn, the order rotating from one repeat to the next.
bench.py's own AdamW runs (``ddp``, ``shardlab_stage_3``) come along for context. Measured:

    step time       per variant: median and min-max over repeats; shardlab / ddp with Muon, per repeat
    Newton-Schulz   calls and seconds per step on each rank (torch's ``_zeropower_via_newtonschulz``, timed)
    exchange        the bytes each rank sends per step in the whole-tensor gather and return (the ledger's
                    ``all_to_all`` entries), against the budget's prediction from the owner plan
                    (budget/predicted/whole_tensor.py) and against the closed form from the flat layout alone: each
                    matrix's owner receives the gradient elements outside its own shard (and the values too at
                    stage 3, where the master is not held whole) and sends the new values of those elements back
    state           Muon's state (momentum buffers) on each rank, against the ideal 1/N of the whole-tensor
                    state; under ddp every rank holds all of it
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time
from datetime import date
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.bench import SETTINGS, _peak_rss, _tokens, machine
from benchmarks.bench import sample as adamw_sample
from benchmarks.ranks import run_ranks, timing_trainer
from benchmarks.sections import MARKERS, replace_section
from lightning_shardlab.examples.gpt import GPT

HERE = Path(__file__).resolve().parent
SETTING = "default"
MUON = ("ddp_muon", "shardlab_stage_2_muon", "shardlab_stage_3_muon")
ADAMW = ("ddp", "shardlab_stage_3")  # bench.py's variants, as they are
VARIANTS = MUON + ADAMW
GATHER, RETURN = "whole-tensor gather", "whole-tensor return"


class MuonRecipeGPT(GPT):
    """bench.py's GPT trained by the usual Muon recipe: two optimizers, stepped in ``training_step``."""

    def __init__(self, **kwargs) -> None:  # noqa: ANN003
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def is_muon(self, name: str, param: torch.nn.Parameter) -> bool:
        return name.startswith("blocks.") and param.ndim == 2

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        loss = F.cross_entropy(self(x).flatten(0, 1), y.flatten())
        self.manual_backward(loss)
        for optimizer in self.optimizers():
            optimizer.step()
            optimizer.zero_grad()

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        named = list(self.named_parameters())
        matrices = [p for n, p in named if self.is_muon(n, p)]
        rest = [p for n, p in named if not self.is_muon(n, p)]
        hp = self.hparams
        return [
            torch.optim.Muon(matrices, lr=0.02, weight_decay=0.1, momentum=0.95),
            torch.optim.AdamW(rest, lr=hp.lr, betas=(hp.beta1, hp.beta2), weight_decay=0.0),
        ]


def _muon_model() -> MuonRecipeGPT:
    torch.manual_seed(0)
    keys = ("vocab_size", "n_layer", "n_embd", "n_head", "block_size")
    return MuonRecipeGPT(**{k: SETTINGS[SETTING][k] for k in keys}, lr=1e-4, warmup_steps=0)


class NewtonSchulzClock:
    """Counts and times torch Muon's Newton-Schulz orthogonalisation in this process (one call per matrix)."""

    def __init__(self) -> None:
        import torch.optim._muon as muon_impl

        self.calls, self.seconds = 0, 0.0
        run = muon_impl._zeropower_via_newtonschulz

        def timed(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            start = time.perf_counter()
            try:
                return run(*args, **kwargs)
            finally:
                self.calls += 1
                self.seconds += time.perf_counter() - start

        muon_impl._zeropower_via_newtonschulz = timed


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every state tensor ``optimizer`` holds on this rank."""
    return sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))


def run_muon(variant: str, warmup: int, steps: int) -> dict:
    """One rank of the Muon recipe under ``ddp`` or shardlab stage k: step times, Newton-Schulz work, exchange
    bytes (measured and predicted), and the Muon state this rank holds."""
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_shardlab import ShardLabStrategy

    world = int(os.environ["WORLD_SIZE"])
    strategy = ShardLabStrategy(stage=int(variant.split("_")[2])) if variant.startswith("shardlab") else "ddp"
    clock, times = NewtonSchulzClock(), []

    class Clock(L.Callback):
        def on_train_batch_start(self, *args) -> None:  # noqa: ANN002
            self.t = time.perf_counter()

        def on_train_batch_end(self, *args) -> None:  # noqa: ANN002
            times.append(time.perf_counter() - self.t)

    tokens = _tokens(SETTINGS[SETTING], warmup + steps, world)
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=SETTINGS[SETTING]["batch"])
    # Lightning counts each optimizer's step: a batch is two steps
    trainer = timing_trainer(
        accelerator="cpu", devices=world, strategy=strategy, max_steps=2 * (warmup + steps), callbacks=[Clock()]
    )
    model = _muon_model()
    trainer.fit(model, loader)
    batches = len(times)
    muon = trainer.optimizers[0]
    out = {
        "times": times[warmup:],
        "peak_rss": _peak_rss(),
        "ns_calls": clock.calls / batches,
        "ns_seconds": clock.seconds / batches,
        "state_bytes": state_bytes(muon),
        "muon_numel": sum(p.numel() for g in muon.param_groups for p in g["params"]),
    }
    if variant.startswith("shardlab"):
        out.update(exchange(trainer, muon, batches))
    return out


def exchange(trainer, muon: torch.optim.Optimizer, batches: int) -> dict:  # noqa: ANN001
    """What this rank sent per step in the whole-tensor exchanges, the budget's prediction of it and of the
    owned state, and (the same on every rank) the closed form's bytes over all ranks."""
    from lightning_shardlab.budget.predicted.whole_tensor import whole_tensor_report

    sharded = trainer.strategy.sharded
    ledger = sharded.comm.ledger
    sent = {label: ledger.by_label[("all_to_all", label)] for label in (GATHER, RETURN)}
    report = whole_tensor_report(sharded, [muon], global_steps=batches)  # one Muon step per batch
    return {
        "sent": {label: t.bytes / batches for label, t in sent.items()},
        "a2a_calls": sum(t.count for t in sent.values()) / batches,
        "a2a_seconds": sum(t.seconds for t in sent.values()) / batches,
        "predicted_sent": report["all_to_all_bytes"],
        "predicted_state": report["optimizers"][0]["state_bytes_predicted"],
        "owned": report["optimizers"][0]["owned"],
        "theory": closed_form(sharded, muon),
    }


def closed_form(sharded, muon: torch.optim.Optimizer) -> dict:  # noqa: ANN001
    """Bytes per step over all ranks, from the flat layout and the owners alone: each owner lacks the elements of
    its matrix outside its own shard; the gather brings it their gradient (and values, where the master is not
    held whole), the return sends their new values back. Also the same if every matrix were split evenly over
    the ranks (``even``), and the least any choice of owners could move (``least``: each matrix owned by the
    rank holding its largest piece, balance aside)."""
    from lightning_shardlab.sharding.owners import assign_owners

    where = {id(p): (fp, fp.layout.slots[i]) for fp in sharded.flat_params for i, p in enumerate(fp.params)}
    slots = [where[id(p)] for g in muon.param_groups for p in g["params"]]
    world = slots[0][0].layout.world_size
    owners = assign_owners([(slot.name, slot.numel) for _, slot in slots], world)
    lacking = best = 0  # bytes outside the owner's shard; outside the largest piece (any owner's least)
    for fp, slot in slots:
        held = [_overlap(fp.layout.shard_range(r), slot) for r in range(world)]
        lacking += (slot.numel - held[owners[slot.name]]) * fp.master.element_size()
        best += (slot.numel - max(held)) * fp.master.element_size()
    travel = 1 if all(fp.resident_full and fp.master is fp.shard for fp, _ in slots) else 2  # values too
    even = sum(slot.numel * fp.master.element_size() for fp, slot in slots) * (world - 1) / world
    return {
        GATHER: travel * lacking,
        RETURN: lacking,
        "even": {GATHER: travel * even, RETURN: even},
        "least": {GATHER: travel * best, RETURN: best},
    }


def _overlap(shard: tuple[int, int], slot) -> int:  # noqa: ANN001
    """Elements of ``slot`` inside the shard ``[start, end)`` of the full buffer."""
    return max(0, min(shard[1], slot.offset + slot.numel) - max(shard[0], slot.offset))


def sample(variant: str, warmup: int, steps: int) -> dict:
    """One run of ``variant`` on 2 ranks: rank 0's median step, and each rank's own figures."""
    if variant in ADAMW:
        result = adamw_sample(variant, SETTING, warmup, steps)
        return {"seconds": result["seconds"], "peak_rss": max(result["peak_rss"])}
    ranks = run_ranks(run_muon, 2, {"variant": variant, "warmup": warmup, "steps": steps})
    return {
        "seconds": statistics.median(ranks[0]["times"]),
        "peak_rss": max(r["peak_rss"] for r in ranks),
        "ranks": [{**r, "times": None} for r in ranks],
    }


def spread(values: list[float], fmt: str = "{:.3f}") -> str:
    """median (min-max)"""
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def step_rows(samples: dict[str, list[dict]]) -> list[str]:
    """One row per variant: its step, its ratio to ddp with the same optimizers per repeat, Newton-Schulz and
    all-to-all per rank, the peak memory of a rank."""
    rows = [
        "| variant | optimizers | s/step, median (min-max) | / ddp, same optimizers, per repeat |"
        " Newton-Schulz calls per step, rank 0 / 1 | Newton-Schulz s/step, rank 0 / 1 |"
        " all-to-all s/step, rank 0 / 1 | peak RSS per rank |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for variant, runs in samples.items():
        peer = "ddp_muon" if variant in MUON else "ddp"
        ratios = [r["seconds"] / p["seconds"] for r, p in zip(runs, samples[peer])]
        cells = [
            variant.removesuffix("_muon"),
            "Muon + AdamW" if variant in MUON else "AdamW",
            spread([r["seconds"] for r in runs], "{:.4f}"),
            "1" if variant == peer else spread(ratios),
        ]
        if variant in MUON:
            per_rank = [[r["ranks"][k] for r in runs] for k in (0, 1)]
            cells += [
                " / ".join(f"{statistics.median(x['ns_calls'] for x in rank):.0f}" for rank in per_rank),
                " / ".join(f"{statistics.median(x['ns_seconds'] for x in rank):.3f}" for rank in per_rank),
                " / ".join(f"{statistics.median(x['a2a_seconds'] for x in rank):.3f}" for rank in per_rank)
                if "a2a_seconds" in runs[0]["ranks"][0]
                else "-",
            ]
        else:
            cells += ["-", "-", "-"]
        cells.append(f"{max(r['peak_rss'] for r in runs) / 2**20:.0f} MiB")
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def exchange_rows(samples: dict[str, list[dict]]) -> list[str]:
    """Per stage and exchange: what each rank sent per step, against the budget's prediction and the closed form."""
    rows = [
        "| stage | exchange | rank 0 sends | rank 1 sends | all ranks | / budget's prediction | closed form |"
        " / closed form | if split evenly | least, any owners |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for variant in MUON[1:]:
        ranks = samples[variant][0]["ranks"]
        theory = ranks[0]["theory"]
        for label in (GATHER, RETURN):
            sent = [r["sent"][label] for r in ranks]
            rows.append(
                f"| {variant.split('_')[2]} | {label.removeprefix('whole-tensor ')} | {mb(sent[0])} | {mb(sent[1])} |"
                f" {mb(sum(sent))} | - | {mb(theory[label])} | {sum(sent) / theory[label]:.3f} |"
                f" {mb(theory['even'][label])} | {mb(theory['least'][label])} |"
            )
        both = [sum(r["sent"].values()) for r in ranks]
        predicted = [r["predicted_sent"] for r in ranks]
        rows.append(
            f"| {variant.split('_')[2]} | both | {mb(both[0])} | {mb(both[1])} | {mb(sum(both))} |"
            f" {both[0] / predicted[0]:.3f} / {both[1] / predicted[1]:.3f} |"
            f" {mb(theory[GATHER] + theory[RETURN])} | {sum(both) / (theory[GATHER] + theory[RETURN]):.3f} |"
            f" {mb(theory['even'][GATHER] + theory['even'][RETURN])} |"
            f" {mb(theory['least'][GATHER] + theory['least'][RETURN])} |"
        )
    return rows


def state_rows(samples: dict[str, list[dict]]) -> list[str]:
    """Muon's state on each rank against the ideal 1/N of the whole (and the budget's prediction)."""
    rows = [
        "| variant | matrices owned, rank 0 / 1 | Muon state, rank 0 | rank 1 | total (all matrices) | ideal 1/N |"
        " max / ideal | budget's prediction, rank 0 / 1 |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for variant in MUON:
        ranks = samples[variant][0]["ranks"]
        held = [r["state_bytes"] for r in ranks]
        total = 4 * ranks[0]["muon_numel"]  # one fp32 momentum element per matrix element
        ideal = total / len(ranks)
        owned = " / ".join(str(r["owned"]) for r in ranks) if "owned" in ranks[0] else "all / all"
        predicted = " / ".join(mb(r["predicted_state"]) for r in ranks) if "predicted_state" in ranks[0] else "-"
        rows.append(
            f"| {variant.removesuffix('_muon')} | {owned} | {mb(held[0])} | {mb(held[1])} | {mb(total)} | {mb(ideal)} |"
            f" {max(held) / ideal:.3f} | {predicted} |"
        )
    return rows


def repeats_agree(samples: dict[str, list[dict]]) -> bool:
    """Whether every repeat of each Muon variant measured the same bytes sent and state held on each rank as the
    first (the tables show the first)."""

    def figures(run: dict) -> list:
        return [(r.get("sent"), r["state_bytes"]) for r in run["ranks"]]

    return all(figures(run) == figures(runs[0]) for v in MUON for runs in [samples[v]] for run in runs)


def mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.2f} MB"


def nproc() -> str:
    return subprocess.run(["nproc"], capture_output=True, text=True, check=True).stdout.strip()


def section(samples: dict[str, list[dict]], args: argparse.Namespace, minutes: float) -> str:
    begin, end = MARKERS["whole_tensor"]
    first = samples["ddp_muon"][0]["ranks"][0]
    head = (
        f"Command: `python -m benchmarks.whole_tensor --repeats {args.repeats} --warmup {args.warmup}"
        f" --steps {args.steps}` ({minutes:.1f} min, {date.today().isoformat()}). Machine: `nproc` {nproc()};"
        f" {machine()}. bench.py's default GPT (13,816,704 parameters), 2 ranks, 1 thread each (gloo), fp32;"
        f" {args.repeats} interleaved repeats (the order rotates), a sample is rank 0's median of {args.steps}"
        f" steps after {args.warmup} warm-up steps. Muon + AdamW: the usual recipe by hand"
        " (`automatic_optimization = False`): torch.optim.Muon (lr 0.02, momentum 0.95, weight decay 0.1) on the"
        f" blocks' 24 matrices ({first['muon_numel']:,} elements), AdamW on the rest (embeddings, norms, the tied"
        " head). AdamW: bench.py's own runs, for context. Ratios are taken within each repeat."
    )
    return "\n".join(
        [
            begin,
            "## Whole-tensor optimizers: the Muon recipe\n",
            head + "\n",
            *step_rows(samples),
            "",
            "Exchange bytes per step (the ledger's `all_to_all` entries: what each rank sends), "
            + ("the same in every repeat." if repeats_agree(samples) else "the first repeat's (they varied!).")
            + " Budget: budget/predicted/whole_tensor.py's prediction from the owner plan, per rank. Closed form, from"
            " the flat layout and sharding/owners.py's owners: each owner gathers the gradient (at stage 3 the"
            " values too) of the elements of its matrices outside its own shard, and returns their new values."
            " If split evenly: the same were every matrix spread evenly over the ranks, (1 - 1/N) of it outside"
            " its owner's shard. Least: the least any choice of owners could move, each matrix owned by the rank"
            " that holds its largest piece (sharding/owners.py chooses by size alone, not by where pieces lie).\n",
            *exchange_rows(samples),
            "",
            "Muon's state (momentum buffers, fp32) on each rank after training, against the ideal 1/N of the"
            " whole-tensor state; under ddp every rank holds all of it.\n",
            *state_rows(samples),
            end,
        ]
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="1 repeat, printed only (RESULTS.md untouched)")
    args = parser.parse_args(argv)
    args.repeats = 1 if args.quick else args.repeats
    start = time.monotonic()
    samples: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for repeat in range(args.repeats):
        shift = repeat % len(VARIANTS)  # neither variant always first
        for variant in VARIANTS[shift:] + VARIANTS[:shift]:
            samples[variant].append(sample(variant, args.warmup, args.steps))
            print(f"[repeat {repeat}] {variant:22s} {samples[variant][-1]['seconds']:.4f} s/step", flush=True)
    text = section(samples, args, (time.monotonic() - start) / 60)
    if args.quick:
        print(text)
        return
    print(text)
    replace_section(HERE / "RESULTS.md", "whole_tensor", text)


if __name__ == "__main__":
    main()
