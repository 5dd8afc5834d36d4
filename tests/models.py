"""Small models for the tests: odd shapes, units so small some ranks hold only padding, a tiny GPT."""

from __future__ import annotations

import math

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.l1 = nn.Linear(d, 17)
        self.l2 = nn.Linear(17, d)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.l2(torch.tanh(self.l1(x)))


class Gate(nn.Module):
    """One parameter of one element: at world size > 1 every rank but 0 holds only padding of it."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.scale


class OddNet(nn.Module):
    """Odd shapes (7, 15, 17), two block units, two one-element gate units, a size-1 layer at the root."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(7, 15)
        self.blocks = nn.ModuleList([Block(15) for _ in range(2)])
        self.gates = nn.ModuleList([Gate() for _ in range(2)])
        self.tiny = nn.Linear(15, 1)
        self.out = nn.Linear(1, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        for block, gate in zip(self.blocks, self.gates):
            h = gate(block(h))
        return self.out(self.tiny(h))


def regression_batches(steps: int, global_batch: int, seed: int = 1) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(global_batch, 7, generator=g), torch.randn(global_batch, 3, generator=g)) for _ in range(steps)]


# ---- a tiny GPT (nanoGPT's shape: tied embedding and head, pre-norm blocks) ----


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=False)  # a key bias gets an exactly-zero gradient: Adam would amplify its rounding noise
        self.proj = nn.Linear(n_embd, n_embd)

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))  # (b, h, t, d)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.shape[-1])  # (b, h, t, t)
        att = att.masked_fill(torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
        y = att.softmax(-1) @ v  # (b, h, t, d)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class GPTBlock(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(L.LightningModule):
    def __init__(self, vocab: int = 37, block_size: int = 11, n_layer: int = 3, n_embd: int = 18, n_head: int = 3,
                 lr: float = 3e-3, optimizer: str = "adamw") -> None:
        super().__init__()
        self.save_hyperparameters()
        self.wte = nn.Embedding(vocab, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList([GPTBlock(n_embd, n_head) for _ in range(n_layer)])
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

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.hparams.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr * 10, momentum=0.9)
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.1)


def token_dataset(n: int, vocab: int = 37, block_size: int = 11, seed: int = 2) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, vocab, (n, block_size + 1), generator=g)
    return TensorDataset(data[:, :-1], data[:, 1:])


def loader(dataset: TensorDataset, batch_size: int, world_size: int = 1, rank: int = 0) -> DataLoader:
    """In order, rank r taking samples r, r + N, ... (Lightning's own sampler would shuffle training data).

    Use with ``Trainer(use_distributed_sampler=False)``.
    """
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=False)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler)


def global_batches(dataset: TensorDataset, local_batch: int, world_size: int) -> list[tuple[Tensor, ...]]:
    """The batches a DistributedSampler(shuffle=False) run covers, step by step, as one global batch."""
    step = local_batch * world_size
    return [tuple(t[i : i + step] for t in dataset.tensors) for i in range(0, len(dataset) - step + 1, step)]
