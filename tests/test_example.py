"""The example GPT, its data, the ``shardlab`` command and the fine-tune script the README runs.

``shardlab fit`` runs are real 2-rank trainings in a kept world, launched as torchrun launches them (each rank
runs the command; the ranks' environment names the world); ``--help`` and ``--print_config`` go through the
installed console script; the README's fine-tune script starts its second rank through Lightning's launcher.
Each command gets a free port, a hard wall clock, and its whole process group killed when it ends.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import unittest.mock
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_shardlab.examples.finetune import QUICK, samples
from lightning_shardlab.examples.gpt import GPT, WarmupCosine
from lightning_shardlab.examples.text import TextDataModule, decode, encode
from tests.helpers import cli_tools
from tests.helpers.launch import ROOT, free_port, run_ranks

CONFIGS = ROOT / "configs"
SHARDLAB = Path(sys.executable).parent / "shardlab"  # the console script pyproject.toml declares
TINY_MODEL = dict(n_layer=1, n_head=4, n_embd=32, block_size=16)
TINY = [
    "--trainer.max_steps=2",
    "--trainer.limit_val_batches=1",
    "--trainer.val_check_interval=1",
    "--model.n_layer=1",
    "--model.n_embd=32",
    "--model.block_size=16",
    "--data.block_size=16",
    "--data.batch_size=4",
]
DIST_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "PL_GLOBAL_SEED")


def run_command(args: list[str], cwd: Path, timeout: float) -> str:
    """Run ``args`` (which may start more ranks) in a new session; kill the whole group when it ends."""
    env = {k: v for k, v in os.environ.items() if k not in DIST_VARS}
    env.update(OMP_NUM_THREADS="1", MASTER_PORT=str(free_port()), PYTHONWARNINGS="ignore", COLUMNS="160")
    proc = subprocess.Popen(
        args, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        raise AssertionError(f"{' '.join(args)} ran past {timeout:.0f} s:\n{output[-3000:]}") from None
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # a rank left behind by a failed run
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, f"{' '.join(args)} exited with {proc.returncode}:\n{output[-3000:]}"
    return output


def errors_in(tree: Any, where: str = "") -> list[str]:
    """Every non-empty ``error`` (or ``..._error``) under ``tree``, with its path."""
    if isinstance(tree, dict):
        found = [f"{where}/{k}: {v}" for k, v in tree.items() if k.endswith("error") and v]
        return found + [e for k, v in tree.items() for e in errors_in(v, f"{where}/{k}")]
    return [e for i, v in enumerate(tree) for e in errors_in(v, f"{where}[{i}]")] if isinstance(tree, list) else []


def assert_budget_printed(output: str, stage: int) -> None:
    """The budget callback's tables (titles start "shardlab budget"), for the stage that ran."""
    assert "shardlab budget" in output, output[-3000:]
    budget = output[output.index("shardlab budget") :]
    assert re.search(rf"stage\s+{stage}\b", budget), budget[:1000]
    # printed whole although the output is a pipe (rich would fit it to 80 columns and clip cells with "…")
    assert "…" not in budget and all(c in budget for c in ("optimizer_state", "padding", "gathered_peak")), budget[
        :3000
    ]


@contextlib.contextmanager
def _in_dir(path: Path) -> Iterator[None]:
    before = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


def shardlab(*args: str, cwd: Path) -> str:
    """``shardlab ARGS`` in ``cwd``: a training subcommand on 2 ranks launched as torchrun would (a kept world:
    no process starts), ``--print_config`` in this process, ``--help`` through the installed console script.
    Rank 0's output."""
    if args[0] in ("fit", "validate", "test", "predict") and "--print_config" not in args:
        kwargs = {"argv": list(args), "cwd": str(cwd)}
        ranks = run_ranks("tests.helpers.cli_tools:shardlab_on_rank", 2, kwargs, timeout=180)
        for rank, (code, output) in enumerate(ranks):
            assert code == 0, f"rank {rank}: shardlab {' '.join(args)} exited with {code}:\n{output[-3000:]}"
        return ranks[0][1]
    if "--print_config" in args:  # no training: in this process
        with _in_dir(cwd), unittest.mock.patch.object(sys, "argv", ["shardlab"]):
            code, output = cli_tools.shardlab(*args)
        assert code == 0, f"shardlab {' '.join(args)} exited with {code}:\n{output[-3000:]}"
        return output
    assert SHARDLAB.exists(), f"{SHARDLAB} is missing. HINT: pip install -e . (it installs the `shardlab` command)"
    return run_command([str(SHARDLAB), *args], cwd, timeout=120)


def test_help_lists_every_subcommand_tools_included(tmp_path: Path) -> None:
    output = shardlab("--help", cwd=tmp_path)
    for subcommand in ("fit", "validate", "test", "predict", "plan", "consolidate", "export", "inspect"):
        assert re.search(rf"^  {subcommand}\s", output, re.M), output


@pytest.fixture(scope="module")
def tiny_state_dict(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A plain state dict of the tiny GPT the command-line runs build, for ``model.init_from``."""
    path = tmp_path_factory.mktemp("init") / "tiny.pt"
    torch.save(GPT(**TINY_MODEL).state_dict(), path)
    return path


# ---- the shardlab command ----


def test_pretrain_config_trains_sharded_and_writes_a_full_checkpoint(tmp_path: Path) -> None:
    output = shardlab("fit", "--config", str(CONFIGS / "gpt_pretrain_cpu.yaml"), *TINY, cwd=tmp_path)
    assert_budget_printed(output, stage=2)
    checkpoint = torch.load(tmp_path / "runs/pretrain/gpt.ckpt", map_location="cpu", weights_only=True)
    assert list(checkpoint["state_dict"]) == list(GPT(**TINY_MODEL).state_dict())
    GPT(**TINY_MODEL, init_from=str(tmp_path / "runs/pretrain/gpt.ckpt"))  # loads strictly


@pytest.mark.parametrize(
    ("config", "stage"),
    [
        ("gpt_finetune_cpu.yaml", 3),
        ("gpt_finetune_cpu_stage1.yaml", 1),
        ("gpt_finetune_cpu_stage2.yaml", 2),
    ],
)
def test_finetune_configs_start_from_a_checkpoint(
    config: str, stage: int, tiny_state_dict: Path, tmp_path: Path
) -> None:
    output = shardlab(
        "fit", "--config", str(CONFIGS / config), *TINY, f"--model.init_from={tiny_state_dict}", cwd=tmp_path
    )
    assert_budget_printed(output, stage)
    assert (tmp_path / f"runs/finetune_stage{stage}/gpt.ckpt").exists()


def test_user_text_file(tmp_path: Path) -> None:
    (tmp_path / "poem.txt").write_text("Sharded or whole, the gradient flows; each rank holds a slice. " * 60)
    output = shardlab(
        "fit",
        "--config",
        str(CONFIGS / "gpt_finetune_cpu.yaml"),
        *TINY,
        "--model.init_from=null",
        "--data.path=poem.txt",
        cwd=tmp_path,
    )
    assert_budget_printed(output, stage=3)
    saved = (tmp_path / "runs/logs/finetune_stage3/version_0/config.yaml").read_text()
    assert "path: poem.txt" in saved


# ---- the data and the model, in this process ----


@pytest.mark.parametrize("source", ["stdlib_docstrings", "python_topics"])
def test_data_is_the_same_on_every_call(source: str) -> None:
    first, second = (TextDataModule(source=source, block_size=16, batch_size=4) for _ in range(2))
    for data in (first, second):
        data.setup("fit")
    assert torch.equal(first.train_tokens, second.train_tokens) and torch.equal(first.val_tokens, second.val_tokens)
    assert len(first.train_tokens) > 200_000  # a real corpus, not an empty one
    train, other = first.train_dataloader().dataset, second.train_dataloader().dataset
    assert torch.equal(train.offsets, other.offsets)  # the same random blocks on every rank and run
    x, y = train[5]
    assert x.shape == y.shape == (16,) and torch.equal(x[1:], y[:-1])  # targets: the inputs shifted by one
    val = first.val_dataloader().dataset
    assert torch.equal(val[0][0], first.val_tokens[:16].long())  # consecutive blocks from the split's start
    assert torch.equal(val[1][0], first.val_tokens[16:32].long())


def test_bytes_round_trip_and_bad_source() -> None:
    text = 'def f(x):\n    return "ünïcode ✓"\n'
    tokens = encode(text)
    assert tokens.dtype == torch.uint8 and len(tokens) == len(text.encode("utf-8")) and decode(tokens) == text
    with pytest.raises(ValueError, match="source='shakespeare'.*stdlib_docstrings"):
        TextDataModule(source="shakespeare")


def test_gpt_parameter_names_shapes_and_weight_decay_groups() -> None:
    model = GPT(n_layer=2, n_head=2, n_embd=16, block_size=8)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    block = {
        "ln_1.weight": (16,),
        "attn.qkv.weight": (48, 16),
        "attn.proj.weight": (16, 16),
        "ln_2.weight": (16,),
        "mlp.fc.weight": (64, 16),
        "mlp.proj.weight": (16, 64),
    }
    expected = {"wte.weight": (256, 16), "wpe.weight": (8, 16), "ln_f.weight": (16,)}
    expected |= {f"blocks.{i}.{name}": shape for i in range(2) for name, shape in block.items()}
    assert shapes == expected  # no biases by default; the head is tied to wte and listed once
    assert model.lm_head.weight is model.wte.weight and "lm_head.weight" in model.state_dict()
    decay, no_decay = model.param_groups()
    assert {id(p) for p in decay["params"]} == {id(p) for p in model.parameters() if p.dim() == 2}
    assert {id(p) for p in no_decay["params"]} == {id(p) for p in model.parameters() if p.dim() == 1}
    assert no_decay["weight_decay"] == 0.0
    with_bias = GPT(n_layer=1, n_head=2, n_embd=16, block_size=8, bias=True)
    assert "blocks.0.attn.qkv.bias" in dict(with_bias.named_parameters())
    no_decay = with_bias.param_groups()[1]["params"]
    assert {id(p) for p in no_decay} == {id(p) for p in with_bias.parameters() if p.dim() == 1}
    assert len(no_decay) == 4 + 4 + 2  # 4 linear biases, ln_1 and ln_2 weight and bias, ln_f weight and bias


def test_warmup_then_cosine() -> None:
    schedule = WarmupCosine(warmup=10, total=110, floor=0.1)
    assert schedule(0) == pytest.approx(0.1) and schedule(9) == pytest.approx(1.0)
    assert schedule(60) == pytest.approx(0.55)  # half way down the cosine: floor + (1 - floor) / 2
    assert schedule(110) == pytest.approx(0.1) and schedule(500) == pytest.approx(0.1)


def test_init_from_and_seeded_generation(tmp_path: Path) -> None:
    source = GPT(**TINY_MODEL)
    torch.save({"state_dict": source.state_dict(), "epoch": 0}, tmp_path / "lightning_style.ckpt")
    loaded = GPT(**TINY_MODEL, init_from=str(tmp_path / "lightning_style.ckpt")).eval()
    for name, value in source.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    prompt = encode("def ").long()[None]  # (1, 4)
    a, b = (
        loaded.generate(prompt, 20, temperature=0.8, top_k=5, generator=torch.Generator().manual_seed(0))
        for _ in range(2)
    )
    assert a.shape == (1, 24) and torch.equal(a, b) and torch.equal(a[:, :4], prompt)
    greedy = loaded.generate(prompt, 20, temperature=0)  # longer than block_size: the context slides
    assert greedy.shape == (1, 24)
    with pytest.raises(RuntimeError, match="size mismatch"):
        GPT(n_layer=1, n_head=4, n_embd=64, block_size=16, init_from=str(tmp_path / "lightning_style.ckpt"))


# ---- the README's main command, at tiny sizes ----


def test_finetune_script_quick(tmp_path: Path) -> None:
    args = [sys.executable, "-m", "lightning_shardlab.examples.finetune", "--quick"]
    output = run_command(args, tmp_path, timeout=180)
    before, after = map(float, re.search(r"before ([\d.]+) -> after ([\d.]+)", output).groups())
    assert after < before
    assert "samples before fine-tuning" in output and "samples after fine-tuning" in output
    assert output.count('[0] The "while" statement') == 2  # one sample per prompt, before and after
    pretraining, finetuning = output.split("=== 2. fine-tuning")
    assert_budget_printed(pretraining, stage=2)
    assert_budget_printed(finetuning, stage=3)
    runs = tmp_path / "runs/quick"
    # stage 3 shows units: several all-gathers per step, a gathered peak below the model; the output says why
    (budget, *_) = json.loads((runs / "finetune/logs/version_0/shardlab_budget.json").read_text())
    blocks = [name for name in budget["units"] if name != "root"]
    assert len(blocks) == QUICK.model["n_layer"] and budget["unit_policy"] == "unit_classes=[Block]", budget["units"]
    assert budget["comm_per_step"]["all_gather"]["calls"] > 1, budget["comm_per_step"]
    model_bytes = 4 * sum(budget["units"].values())
    assert 0 < budget["memory_measured"]["gathered_peak"] < model_bytes, (budget["memory_measured"], model_bytes)
    assert "units: the root" in finetuning and "gathers each just before it computes" in finetuning
    # the predicted side of a module validated, generated from and loaded before fit, whose training_step logs
    # (budget/predicted/step_stand_ins.py): every prediction made, printed beside its measurement
    predicted = {key: value for key, value in budget.items() if "predicted" in key}
    assert not errors_in(predicted), errors_in(predicted)
    assert budget["activations_predicted"]["step"] == "training_step" and budget["step_peak_predicted"]["total"] > 0
    time_table = finetuning[finetuning.index("time per optimizer step") :]
    assert re.search(r"│\s+0 │\s+[\d.]+ \([\d.]+\) │", time_table), time_table[:1500]  # step: measured (predicted)
    activations = finetuning[finetuning.index("activations saved for backward") :]
    assert re.search(r"│\s+0 │\s+[\d.]+ \([\d.]+\) │", activations) and "not traced" not in activations
    assert isinstance(budget["timeline"]["step"], int)  # the timeline picture's title names its step
    # the progress bar shows a real total of epochs (max_epochs from max_steps), never "Epoch 3/-2"
    epochs = re.findall(r"Epoch (\d+)/(-?\d+)", output)
    assert epochs and all(int(total) >= int(current) >= 0 for current, total in epochs), sorted(set(epochs))
    assert output.count("data: ") == 2 and "sha256" in output  # the texts the figures come from
    assert (runs / "finetune/loss.png").stat().st_size > 0
    assert "vital signs of every rank (dashboard): runs/quick/finetune/vitals/vitals.html" in output
    assert "data:image/png;base64," in (runs / "finetune/vitals/vitals.html").read_text()
    final = torch.load(runs / "finetune/gpt.ckpt", map_location="cpu", weights_only=True)
    pretrained = torch.load(runs / "pretrain/gpt.ckpt", map_location="cpu", weights_only=True)
    assert list(final["state_dict"]) == list(pretrained["state_dict"])
    assert not torch.equal(final["state_dict"]["wte.weight"], pretrained["state_dict"]["wte.weight"])  # it trained
    # The samples printed after fine-tuning came from the sharded model: the saved full weights, unsharded
    # in this process, generate the same text from the same seeded draws.
    plain = GPT(**QUICK.model, init_from=str(runs / "finetune/gpt.ckpt"))
    after = output[output.index("samples after fine-tuning") :]
    for i, text in enumerate(samples(plain, QUICK.new_tokens)):
        assert f"[{i}] " + text.replace("\n", "\n    ") in after
