"""A tiny GPT (nanoGPT's shape: tied embedding and head, pre-norm blocks of the example GPT) and its data."""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_shardlab.examples.gpt import Block


class TinyGPT(L.LightningModule):
    def __init__(
        self,
        vocab: int = 37,
        block_size: int = 11,
        n_layer: int = 3,
        n_embd: int = 18,
        n_head: int = 3,
        lr: float = 3e-3,
        optimizer: str = "adamw",
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.wte = nn.Embedding(vocab, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        # no biases: a key bias gets an exactly-zero gradient, whose rounding noise Adam would amplify
        self.blocks = nn.ModuleList([Block(n_embd, n_head, dropout=0.0, bias=False) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        self.losses: list[Tensor] = []

    def forward(self, idx: Tensor) -> Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)  # (b, t, c)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # (b, t, vocab)

    def loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        idx, targets = batch
        logits = self(idx)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self.loss(batch)
        self.losses.append(loss.detach().clone())
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.loss(batch), sync_dist=True)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("test_loss", self.loss(batch), sync_dist=True)

    def predict_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.hparams.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr * 10, momentum=0.9)
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.1)


def token_dataset(n: int, vocab: int = 37, block_size: int = 11, seed: int = 2) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, vocab, (n, block_size + 1), generator=g)
    return TensorDataset(data[:, :-1], data[:, 1:])


class OrderedData(L.LightningDataModule):
    """Training data in order: rank r takes samples r, r + N, r + 2N, ... (Lightning's own sampler would
    shuffle training data). Ranks are read from the trainer, so any launcher works. Pair it with
    ``Trainer(use_distributed_sampler=False)``."""

    def __init__(self, dataset: TensorDataset, batch_size: int) -> None:
        super().__init__()
        self.dataset, self.batch_size = dataset, batch_size

    def _loader(self) -> DataLoader:
        sampler = DistributedSampler(
            self.dataset, num_replicas=self.trainer.world_size, rank=self.trainer.global_rank, shuffle=False
        )
        return DataLoader(self.dataset, batch_size=self.batch_size, sampler=sampler)

    def train_dataloader(self) -> DataLoader:
        return self._loader()

    val_dataloader = test_dataloader = predict_dataloader = train_dataloader


def global_batches(dataset: TensorDataset, local_batch: int, world_size: int) -> list[tuple[Tensor, ...]]:
    """The batches a DistributedSampler(shuffle=False) run covers, step by step, as one global batch."""
    step = local_batch * world_size
    return [tuple(t[i : i + step] for t in dataset.tensors) for i in range(0, len(dataset) - step + 1, step)]
