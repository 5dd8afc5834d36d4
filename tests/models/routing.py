"""Models a new user brings whose execution depends on the data: mixture-of-experts, blocks on some ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tests.models.basic import Block
from tests.models.parity import ParityModule


class Expert(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, 17)
        self.down = nn.Linear(17, d)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.gelu(self.up(x)))


class MoELayer(nn.Module):
    """Top-k routing, experts in an ``nn.ModuleList`` (Mixtral's way): an expert that gets no token is not run,
    so on one rank it has a gradient and on another none."""

    def __init__(self, d: int, experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(d, experts)
        self.experts = nn.ModuleList([Expert(d) for _ in range(experts)])
        self.ran: list[list[int]] = []  # per forward: the experts that got tokens

    def forward(self, x: Tensor) -> Tensor:  # x: (tokens, d)
        weight, index = self.router(x).softmax(-1).topk(self.top_k, dim=-1)  # (tokens, k)
        out = torch.zeros_like(x)
        ran = []
        for e, expert in enumerate(self.experts):
            rows, slot = torch.where(index == e)
            if rows.numel():
                out = out.index_add(0, rows, weight[rows, slot, None] * expert(x[rows]))
                ran.append(e)
        self.ran.append(ran)
        return x + out


class MoEBlock(nn.Module):
    def __init__(self, d: int, experts: int, top_k: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.moe = MoELayer(d, experts, top_k)

    def forward(self, x: Tensor) -> Tensor:
        return self.moe(self.norm(x))


class MoENet(ParityModule):
    """``blocks=0``: one MoE layer between two linears (its experts are the only repeated blocks);
    ``blocks>0``: MoE blocks in an ``nn.ModuleList`` run in order (the blocks are units, experts inside)."""

    def __init__(self, experts: int = 4, top_k: int = 1, blocks: int = 0) -> None:
        super().__init__()
        self.inp = nn.Linear(7, 15)
        self.moe = MoELayer(15, experts, top_k) if blocks == 0 else None
        self.blocks = nn.ModuleList([MoEBlock(15, experts, top_k) for _ in range(blocks)])
        self.out = nn.Linear(15, 3)

    def layers(self) -> list[MoELayer]:
        return [self.moe] if self.moe is not None else [b.moe for b in self.blocks]

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        h = self.inp(x)
        if self.moe is not None:
            h = self.moe(h)
        for block in self.blocks:
            h = block(h)
        loss = F.mse_loss(self.out(h), y)
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)


class RankOneExtra(ParityModule):
    """A block that only rank 1 runs (a rank-dependent branch); with ``unit_classes`` naming ``Extra`` it is a unit."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(7, 15)
        self.extra = Extra(15)
        self.out = nn.Linear(15, 3)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        h = self.inp(x)
        if self.global_rank == 1:
            h = self.extra(h)
        return F.mse_loss(self.out(h), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


class Extra(Block):
    pass


class SwappedBlocks(ParityModule):
    """Two blocks of one size as units; rank 1 runs them in the opposite order."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(7, 15)
        self.blocks = nn.ModuleList([Block(15) for _ in range(2)])
        self.out = nn.Linear(15, 3)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        h = self.inp(x)
        for block in self.blocks[:: -1 if self.global_rank == 1 else 1]:
            h = block(h)
        return F.mse_loss(self.out(h), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)
