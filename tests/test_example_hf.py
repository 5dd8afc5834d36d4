"""The Hugging Face GPT-2 example (``examples/hf_gpt2.py``) and the GPU fine-tune config.

GPT-2 is built from a tiny ``GPT2Config`` or from a ``save_pretrained`` directory made here: nothing is
downloaded. The command-line runs are real 2-rank trainings, as in ``test_example.py``. ``transformers``
is an optional extra for users but these tests need it: without it they fail with the hint (CI installs it).
"""

from __future__ import annotations

import csv
import importlib.util
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lightning_shardlab.core.config import ShardLabConfig
from lightning_shardlab.examples.hf_gpt2 import HFGPT2, check_vocab
from lightning_shardlab.examples.text import TextDataModule, encode, python_topics
from lightning_shardlab.sharding.policy import plan_units
from tests.helpers.launch import ROOT
from tests.test_example import CONFIGS, assert_budget_printed, shardlab

TINY_GPT2 = dict(vocab_size=256, n_positions=16, n_layer=2, n_head=2, n_embd=32, bos_token_id=None, eos_token_id=None)
STEPS = [
    "--trainer.max_steps=3",
    "--trainer.limit_val_batches=1",
    "--trainer.val_check_interval=3",
    "--trainer.log_every_n_steps=1",
    "--data.block_size=16",
    "--data.batch_size=4",
]  # then 1 val batch per rank
BPE_VOCAB = 300  # the tiny tokenizer: 256 bytes + the end-of-text token + 43 merges


@pytest.fixture(autouse=True)
def transformers_installed() -> None:
    if importlib.util.find_spec("transformers") is None:
        pytest.fail(
            "`transformers` is not installed; the Hugging Face example tests need it."
            " HINT: pip install 'lightning-shardlab[hf]' (CI installs it)."
        )


@pytest.fixture(scope="module")
def pretrained_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory laid out like a downloaded ``gpt2/``: a tiny GPT-2's weights and a byte-level BPE tokenizer.

    The token embedding (tied to the head) is scaled up, so the model is easy to tell from a fresh one:
    its loss is far from ln(vocab_size), where a freshly initialised model starts.
    """
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path = tmp_path_factory.mktemp("hf") / "tiny-gpt2"
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>"],
        show_progress=False,
    )
    bpe.train_from_iterator([python_topics()[:50_000]], trainer)
    end = "<|endoftext|>"
    tokenizer = transformers.GPT2TokenizerFast(tokenizer_object=bpe, bos_token=end, eos_token=end, unk_token=end)
    tokenizer.save_pretrained(path)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**TINY_GPT2, "vocab_size": BPE_VOCAB}))
    with torch.no_grad():
        model.transformer.wte.weight.mul_(20)
    model.save_pretrained(path)
    return path


# ---- the module, in this process ----


def test_builds_from_a_config_with_one_unit_per_block_and_the_tied_head_in_the_root() -> None:
    model = HFGPT2(config=TINY_GPT2)
    assert model.model.lm_head.weight is model.model.transformer.wte.weight
    assert list(plan_units(model, ShardLabConfig(), world_size=2).layouts()) == ["root"]  # tiny: one unit
    layouts = plan_units(model, ShardLabConfig(unit_bucket_params=0), world_size=2).layouts()  # tiny: no buckets
    assert list(layouts) == ["root", "model.transformer.h.0", "model.transformer.h.1"]
    root_names = {slot.fqns for layout in layouts["root"] for slot in layout.slots}
    assert ("model.transformer.wte.weight", "model.lm_head.weight") in root_names  # one parameter, two names
    decay, no_decay = model.param_groups()
    assert {id(p) for p in decay["params"]} == {id(p) for p in model.parameters() if p.dim() == 2}
    assert {id(p) for p in no_decay["params"]} == {id(p) for p in model.parameters() if p.dim() == 1}
    assert no_decay["weight_decay"] == 0.0
    idx = encode("def f(x): return").long()[None]  # (1, 16)
    assert model(idx).shape == (1, 16, 256)
    with pytest.raises(ValueError, match="longer than n_positions=16"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_pretrained_directory_loads_its_weights_and_tokenizer(pretrained_dir: Path) -> None:
    import transformers

    saved = transformers.GPT2LMHeadModel.from_pretrained(pretrained_dir).state_dict()
    loaded = HFGPT2(pretrained=str(pretrained_dir)).model.state_dict()
    assert list(loaded) == list(saved)
    for name, value in saved.items():
        assert torch.equal(loaded[name], value) and loaded[name].dtype == torch.float32, name
    data = TextDataModule(source="python_topics", tokenizer=str(pretrained_dir), max_bytes=20_000)
    tokens = data.tokens()
    assert data.vocab_size == BPE_VOCAB and 0 <= int(tokens.min()) and int(tokens.max()) < BPE_VOCAB
    assert len(tokens) < 20_000  # merges: fewer tokens than bytes
    assert data.tokenizer.decode(tokens.tolist()) == python_topics().encode()[:20_000].decode()  # the first 20 kB
    assert TextDataModule().vocab_size == 256 and TextDataModule().tokenizer is None  # bytes stay the default


def test_missing_pretrained_tokenizer_and_bad_options_raise_with_a_hint(tmp_path: Path) -> None:
    missing = str(tmp_path / "no-such-gpt2")
    with pytest.raises(ValueError, match=r"`pretrained='.*no-such-gpt2'` is neither a local directory.*HINT"):
        HFGPT2(pretrained=missing)
    with pytest.raises(ValueError, match=r"`tokenizer='.*no-such-gpt2'` is neither a local directory.*HINT"):
        TextDataModule(tokenizer=missing)
    with pytest.raises(ValueError, match="exactly one of `pretrained` or `config`.*HINT"):
        HFGPT2()
    with pytest.raises(ValueError, match="exactly one of `pretrained` or `config`.*HINT"):
        HFGPT2(pretrained=missing, config=TINY_GPT2)
    with pytest.raises(ValueError, match=r"GPT2Config does not know: \['n_layers'\]"):
        HFGPT2(config={**TINY_GPT2, "n_layers": 3})
    with pytest.raises(ValueError, match=r"vocabulary \(300 ids\) is larger than the model's \(vocab_size=256\).*HINT"):
        check_vocab(model_vocab=256, data_vocab=300)
    with pytest.warns(UserWarning, match="bytes.*HINT: for a pretrained GPT-2 set data.tokenizer"):
        check_vocab(model_vocab=50257, data_vocab=256)


HIDE_TRANSFORMERS = """
import importlib.metadata as md, sys

class Uninstalled:  # a finder that answers for transformers as if it were not installed
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "transformers":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

from_name = md.Distribution.from_name.__func__
def from_name_unless_transformers(cls, name):  # version checks (torchmetrics') see no distribution either
    if name.lower() == "transformers":
        raise md.PackageNotFoundError(name)
    return from_name(cls, name)

sys.meta_path.insert(0, Uninstalled())
md.Distribution.from_name = classmethod(from_name_unless_transformers)
"""


def test_the_package_imports_without_transformers_and_says_how_to_install_it() -> None:
    script = (
        HIDE_TRANSFORMERS
        + """
import lightning_shardlab, lightning_shardlab.cli
from lightning_shardlab.examples.hf_gpt2 import HFGPT2
from lightning_shardlab.examples.text import TextDataModule
assert "transformers" not in sys.modules
TextDataModule()  # bytes need nothing
for build in (lambda: HFGPT2(config={}), lambda: TextDataModule(tokenizer="gpt2")):
    try:
        build()
    except ImportError as err:
        print(err)
"""
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    hint = "not installed. HINT: pip install 'lightning-shardlab[hf]'"
    assert f"`HFGPT2` needs the optional package `transformers`, which is {hint}" in out.stdout, out.stdout
    assert f"`tokenizer` needs the optional package `transformers`, which is {hint}" in out.stdout, out.stdout


# ---- the shardlab command ----


def test_hf_config_trains_a_tiny_gpt2_from_scratch(tmp_path: Path) -> None:
    output = shardlab("fit", "--config", str(CONFIGS / "gpt2_hf_finetune_cpu.yaml"), *STEPS, cwd=tmp_path)
    assert_budget_printed(output, stage=3)
    budget = (tmp_path / "runs/logs/gpt2_hf_finetune/version_0/shardlab_budget.json").read_text()
    # the config's 4 small blocks hold fewer than unit_bucket_params parameters: one unit, one message each way
    assert "all_gather root[float32]" in budget and "all_gather model.transformer.h" not in budget
    assert (tmp_path / "runs/gpt2_hf_finetune/gpt2.ckpt").exists()


def test_hf_config_fine_tunes_a_pretrained_directory(pretrained_dir: Path, tmp_path: Path) -> None:
    output = shardlab(
        "fit",
        "--config",
        str(CONFIGS / "gpt2_hf_finetune_cpu.yaml"),
        *STEPS,
        f"--model.pretrained={pretrained_dir}",
        "--model.config=null",
        f"--data.tokenizer={pretrained_dir}",
        "--model.lr=0.0001",
        cwd=tmp_path,
    )
    assert_budget_printed(output, stage=3)
    rows = list(csv.DictReader((tmp_path / "runs/logs/gpt2_hf_finetune/version_0/metrics.csv").open()))
    assert [float(r["train_loss"]) for r in rows if r.get("train_loss")], "no training loss logged"
    val_loss = next(float(r["val_loss"]) for r in rows if r.get("val_loss"))
    # The validation after 3 warm-up steps (lr at most 3 * 1e-4 / 20) is the pretrained model's, to within
    # rounding: rank r validates blocks r, r + 2, ... (DistributedSampler), and the two losses are averaged.
    expected = validation_loss(HFGPT2(pretrained=str(pretrained_dir)).eval(), pretrained_dir)
    assert abs(expected - math.log(BPE_VOCAB)) > 1.0  # far from a fresh model's loss: the weights were used
    assert val_loss == pytest.approx(expected, abs=0.02)


def validation_loss(model: HFGPT2, tokenizer: Path) -> float:
    data = TextDataModule(source="python_topics", tokenizer=str(tokenizer), block_size=16, batch_size=4)
    data.setup("validate")
    blocks = data.val_dataloader().dataset
    losses = []
    with torch.no_grad():
        for rank in range(2):
            x, y = (torch.stack(t) for t in zip(*(blocks[i] for i in range(rank, 8, 2))))  # (4, 16) each
            losses.append(F.cross_entropy(model(x).flatten(0, 1), y.flatten()))
    return float(sum(losses) / 2)


def test_gpu_finetune_config_parses(tmp_path: Path) -> None:
    """There may be no GPU here: parse and print the config, which instantiates nothing."""
    output = shardlab("fit", "--config", str(CONFIGS / "gpt_finetune_gpu.yaml"), "--print_config", cwd=tmp_path)
    for line in (
        "accelerator: gpu",
        "devices: auto",
        "strategy: shardlab",
        "precision: bf16-mixed",
        "class_path: lightning_shardlab.ShardLabBudget",
        "class_path: lightning_shardlab.examples.gpt.GPT",
    ):
        assert line in output, output[-3000:]


@pytest.mark.parametrize("stage", [1, 2])
def test_gpu_finetune_config_takes_another_stage_from_the_command_line(stage: int, tmp_path: Path) -> None:
    output = shardlab(
        "fit",
        "--config",
        str(CONFIGS / "gpt_finetune_gpu.yaml"),
        f"--trainer.strategy=shardlab_stage_{stage}",
        "--print_config",
        cwd=tmp_path,
    )
    assert f"strategy: shardlab_stage_{stage}" in output, output[-3000:]
