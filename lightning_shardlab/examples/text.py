"""Byte-level text data: a user's text file, or a corpus every Python installation carries.

Tokens are the text's UTF-8 bytes (vocabulary 256), so any text file works and a model pretrained on
one text can be fine-tuned on another without a new vocabulary. The built-in corpora need no network:

    stdlib_docstrings   docstrings of a fixed, sorted list of standard-library modules (about 400 kB)
    python_topics       the help topics of the Python documentation (``pydoc_data.topics``, about 450 kB)

Every rank builds the same data: the text, the split and the training blocks depend only on the options.
Lightning's DistributedSampler then hands each rank its share of the blocks.

For a pretrained model with its own vocabulary (GPT-2's, say), ``tokenizer`` names a Hugging Face tokenizer
(a local directory or a name in the local cache; ``transformers`` is then needed) used instead of bytes.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import platform
from pathlib import Path
from types import ModuleType

import lightning as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from lightning_shardlab.examples.hf_local import from_local, require_transformers

SOURCES = ("stdlib_docstrings", "python_topics")

STDLIB_MODULES = (
    "abc",
    "argparse",
    "base64",
    "bisect",
    "calendar",
    "collections",
    "configparser",
    "contextlib",
    "copy",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "enum",
    "fractions",
    "functools",
    "glob",
    "gzip",
    "hashlib",
    "heapq",
    "html",
    "http.client",
    "inspect",
    "io",
    "ipaddress",
    "itertools",
    "json",
    "logging",
    "math",
    "operator",
    "os",
    "pathlib",
    "pickle",
    "pprint",
    "queue",
    "random",
    "re",
    "shutil",
    "socket",
    "statistics",
    "string",
    "subprocess",
    "tarfile",
    "tempfile",
    "textwrap",
    "threading",
    "time",
    "typing",
    "unittest",
    "urllib.parse",
    "uuid",
    "warnings",
    "zipfile",
)  # sorted; pure standard library, importable everywhere


# ---- the texts ----


def _documented(module: ModuleType) -> list[tuple[str, object]]:
    """Public classes and routines defined in ``module`` (not imported into it), sorted by name."""
    names = getattr(module, "__all__", None) or [name for name in vars(module) if not name.startswith("_")]
    members = [(name, getattr(module, name, None)) for name in sorted(names)]
    return [
        (name, obj)
        for name, obj in members
        if getattr(obj, "__module__", None) == module.__name__ and (inspect.isclass(obj) or inspect.isroutine(obj))
    ]


def module_docstrings(name: str) -> list[str]:
    """The docstrings of one module, its public classes and functions, and the classes' public methods."""
    module = importlib.import_module(name)
    docs = [f"{name}\n\n{inspect.getdoc(module) or ''}"]
    for obj_name, obj in _documented(module):
        docs.append(f"{name}.{obj_name}\n\n{inspect.getdoc(obj) or ''}")
        if inspect.isclass(obj):
            for meth_name, meth in sorted(vars(obj).items()):
                if not meth_name.startswith("_") and inspect.isroutine(meth) and inspect.getdoc(meth):
                    docs.append(f"{name}.{obj_name}.{meth_name}\n\n{inspect.getdoc(meth)}")
    return docs


def stdlib_docstrings() -> str:
    return "\n\n".join(doc for name in STDLIB_MODULES for doc in module_docstrings(name))


def python_topics() -> str:
    from pydoc_data.topics import topics  # the text behind help("for"), help("CLASSES"), ...

    return "\n\n".join(topics[key] for key in sorted(topics))


def read_text(path: str | None, source: str) -> str:
    if path is not None:
        return Path(path).read_text(encoding="utf-8", errors="replace")
    return stdlib_docstrings() if source == "stdlib_docstrings" else python_topics()


# ---- the byte-level tokenizer ----


def encode(text: str) -> Tensor:
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8)  # (n,) token ids 0..255


def decode(tokens: Tensor) -> str:
    return bytes(tokens.to(torch.uint8).tolist()).decode("utf-8", errors="replace")


# ---- a Hugging Face tokenizer instead (optional) ----


def load_tokenizer(name: str):  # -> transformers.PreTrainedTokenizerBase
    transformers = require_transformers("tokenizer")
    return from_local(transformers.AutoTokenizer.from_pretrained, name, "tokenizer")


def encode_with(tokenizer, text: str, max_bytes: int) -> Tensor:
    """The token ids of the text's first ``max_bytes`` bytes, without special tokens."""
    text = text.encode("utf-8")[:max_bytes].decode("utf-8", errors="ignore")
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]  # verbose: no "too long" warning
    return torch.tensor(ids, dtype=torch.long)  # (n,)


# ---- blocks of tokens ----


class RandomBlocks(Dataset):
    """``num_samples`` blocks at random offsets, drawn once from ``seed``: the same on every rank and run."""

    def __init__(self, tokens: Tensor, block_size: int, num_samples: int, seed: int) -> None:
        self.tokens, self.block_size = tokens, block_size
        generator = torch.Generator().manual_seed(seed)
        self.offsets = torch.randint(0, len(tokens) - block_size, (num_samples,), generator=generator)  # (n,)

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        start = int(self.offsets[i])
        chunk = self.tokens[start : start + self.block_size + 1].long()  # (block_size + 1,)
        return chunk[:-1], chunk[1:]  # inputs, next-token targets


class ConsecutiveBlocks(Dataset):
    """Non-overlapping blocks from the start: deterministic, for validation."""

    def __init__(self, tokens: Tensor, block_size: int) -> None:
        self.tokens, self.block_size = tokens, block_size

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.block_size

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        start = i * self.block_size
        chunk = self.tokens[start : start + self.block_size + 1].long()  # (block_size + 1,)
        return chunk[:-1], chunk[1:]


class TextDataModule(L.LightningDataModule):
    """Next-token prediction on bytes of text.

    Args:
        path: a UTF-8 text file to train on; when None, the built-in corpus ``source``.
        source: 'stdlib_docstrings' or 'python_topics' (used only when ``path`` is None).
        block_size: tokens per training example (the model's context).
        batch_size: examples per batch, per rank.
        val_fraction: the last part of the text, held out for validation (a contiguous split).
        train_samples: random training blocks per epoch; None: as many as fit in the training text end to end.
        seed: the seed of the training block offsets.
        max_bytes: read at most this many bytes of text (the built-in corpora are about 0.4 MB each).
        num_workers: DataLoader worker processes.
        tokenizer: a Hugging Face tokenizer to use instead of bytes: a local directory or a name in the local
            cache, loaded with ``transformers.AutoTokenizer`` and ``local_files_only=True`` (e.g. GPT-2's, for a
            pretrained GPT-2). None: UTF-8 bytes, vocabulary 256.
    """

    def __init__(
        self,
        path: str | None = None,
        source: str = "stdlib_docstrings",
        block_size: int = 128,
        batch_size: int = 16,
        val_fraction: float = 0.1,
        train_samples: int | None = None,
        seed: int = 1337,
        max_bytes: int = 10_000_000,
        num_workers: int = 0,
        tokenizer: str | None = None,
    ) -> None:
        super().__init__()
        if source not in SOURCES:
            raise ValueError(f"`source={source!r}` is invalid. Allowed values: {', '.join(map(repr, SOURCES))}.")
        if not 0 < val_fraction < 1:
            raise ValueError(f"`val_fraction={val_fraction}` must be between 0 and 1.")
        self.save_hyperparameters()
        self.tokenizer = None if tokenizer is None else load_tokenizer(tokenizer)
        self.vocab_size = 256 if self.tokenizer is None else len(self.tokenizer)  # token ids are 0 .. vocab_size - 1
        self.train_tokens: Tensor | None = None
        self.val_tokens: Tensor | None = None

    def tokens(self) -> Tensor:
        """The whole text as byte tokens (uint8, at most ``max_bytes``), or the tokenizer's ids (int64) of as much."""
        text = read_text(self.hparams.path, self.hparams.source)
        if self.tokenizer is not None:
            return encode_with(self.tokenizer, text, self.hparams.max_bytes)
        return encode(text)[: self.hparams.max_bytes]

    def setup(self, stage: str) -> None:
        if self.train_tokens is not None:
            return
        tokens = self.tokens()
        n_val = max(int(len(tokens) * self.hparams.val_fraction), 1)
        self.train_tokens, self.val_tokens = tokens[:-n_val], tokens[-n_val:]  # contiguous split
        for name, part in (("training", self.train_tokens), ("validation", self.val_tokens)):
            if len(part) <= self.hparams.block_size:
                raise ValueError(
                    f"the {name} text has {len(part)} {'bytes' if self.tokenizer is None else 'tokens'},"
                    f" not more than block_size={self.hparams.block_size}."
                    " HINT: use a longer text, a smaller block_size, or adjust val_fraction."
                )

    def fingerprint(self) -> str:
        """The text this data reads, in one line: a built-in corpus comes from this interpreter's standard
        library, so another Python version trains on another text (and prints other perplexities)."""
        self.setup("fit")
        assert self.train_tokens is not None and self.val_tokens is not None
        tokens = torch.cat([self.train_tokens, self.val_tokens])
        digest = hashlib.sha256(tokens.numpy().tobytes()).hexdigest()[:12]
        where = self.hparams.path or f"{self.hparams.source} of Python {platform.python_version()}"
        return f"{where}: {len(tokens):,} tokens, sha256 {digest}"

    def train_samples(self) -> int:
        """Training blocks per epoch (the text is read on first use)."""
        self.setup("fit")
        assert self.train_tokens is not None
        return self.hparams.train_samples or len(self.train_tokens) // self.hparams.block_size

    def batches_per_epoch(self, world_size: int) -> int:
        """Training batches per rank per epoch: Lightning's DistributedSampler gives each of ``world_size`` ranks
        ``ceil(samples / world_size)`` blocks, and the loader drops the last incomplete batch."""
        return max(-(-self.train_samples() // world_size) // self.hparams.batch_size, 1)

    def train_dataloader(self) -> DataLoader:
        assert self.train_tokens is not None
        dataset = RandomBlocks(self.train_tokens, self.hparams.block_size, self.train_samples(), self.hparams.seed)
        return DataLoader(
            dataset, self.hparams.batch_size, shuffle=True, drop_last=True, num_workers=self.hparams.num_workers
        )

    def val_dataloader(self) -> DataLoader:
        assert self.val_tokens is not None
        dataset = ConsecutiveBlocks(self.val_tokens, self.hparams.block_size)
        return DataLoader(dataset, self.hparams.batch_size, num_workers=self.hparams.num_workers)
