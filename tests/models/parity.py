"""Models for the DDP parity matrix: regression, a grouped GPT, a CNN, manual optimisation, branches."""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import TensorDataset

from tests.models.basic import Block, OddNet
from tests.models.gpt import TinyGPT


class ParityModule(L.LightningModule):
    """Records each step's local loss and global grad norm the way a user would, on any strategy."""

    clip_norm_type: float = 2.0

    def __init__(self) -> None:
        super().__init__()
        self.losses: list[Tensor] = []
        self.grad_norms: list[Tensor] = []

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        from lightning.pytorch.utilities import grad_norm

        from lightning_shardlab import ShardLabStrategy

        if isinstance(self.trainer.strategy, ShardLabStrategy):
            norm = self.trainer.strategy.grad_norm(2.0)
        else:
            norm = grad_norm(self, norm_type=2)["grad_2.0_norm_total"]
        self.grad_norms.append(norm.detach().clone())

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:  # noqa: ANN001
        from lightning_shardlab import ShardLabStrategy

        if not gradient_clip_val:
            return
        if gradient_clip_algorithm in (None, "norm") and not isinstance(self.trainer.strategy, ShardLabStrategy):
            # the unsharded reference: torch's own clipping, with the norm type under test
            torch.nn.utils.clip_grad_norm_(self.parameters(), gradient_clip_val, norm_type=self.clip_norm_type)
            return
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)


class RegressionNet(ParityModule):
    """OddNet as a LightningModule, AdamW or SGD with momentum."""

    def __init__(self, optimizer: str = "adamw") -> None:
        super().__init__()
        self.optimizer_name = optimizer
        self.net = OddNet()

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)


class GroupedGPT(ParityModule):
    """Tied embedding/head, one frozen block, two param groups (decay / none) and a linear warm-up."""

    def __init__(self, frozen_block: int = 1, warmup: int = 4) -> None:
        super().__init__()
        self.gpt = TinyGPT(n_layer=3)
        for p in self.gpt.blocks[frozen_block].parameters():
            p.requires_grad_(False)
        self.warmup = warmup

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self.gpt.loss(batch)
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self) -> dict:
        named = [(n, p) for n, p in self.named_parameters() if p.requires_grad]
        decay = [p for n, p in named if n.endswith("weight") and ".ln" not in n and "wpe" not in n]
        no_decay = [p for n, p in named if not (n.endswith("weight") and ".ln" not in n and "wpe" not in n)]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=3e-3
        )
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / self.warmup))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class ConvBlock(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.bn = nn.BatchNorm2d(c)

    def forward(self, x: Tensor) -> Tensor:
        return x + torch.relu(self.bn(self.conv(x)))


class TinyCNN(ParityModule):
    """BatchNorm in every block (buffers), SGD with momentum and an epoch-interval StepLR."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 5, 3)
        self.blocks = nn.ModuleList([ConvBlock(5) for _ in range(2)])
        self.head = nn.Linear(5, 3)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        loss = F.cross_entropy(self.head(h.mean((2, 3))), y)
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self) -> dict:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)}


class ManualNet(ParityModule):
    """Manual optimisation: two optimizers, manual_backward twice a step, clip_gradients on each."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.net = OddNet()

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        opt_a, opt_b = self.optimizers()
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.manual_backward(loss)
        self.clip_gradients(opt_a, gradient_clip_val=0.3, gradient_clip_algorithm="norm")
        opt_a.step()
        opt_a.zero_grad()
        loss2 = F.mse_loss(self.net(2 * x), y)
        self.manual_backward(loss2)  # the second optimizer's gradients accumulate over both losses
        self.clip_gradients(opt_b, gradient_clip_val=0.3, gradient_clip_algorithm="norm")
        opt_b.step()
        opt_b.zero_grad()
        self.losses.append((loss + loss2).detach().clone())

    def configure_optimizers(self) -> list:
        a = [p for n, p in self.named_parameters() if n.startswith(("net.inp", "net.blocks.0", "net.gates.0"))]
        b = [p for n, p in self.named_parameters() if not n.startswith(("net.inp", "net.blocks.0", "net.gates.0"))]
        return [torch.optim.AdamW(a, lr=1e-2), torch.optim.SGD(b, lr=0.05, momentum=0.9)]


class BranchyNet(ParityModule):
    """An unused layer, and a branch that alternates by step (the same on every rank)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(7, 15)
        self.branches = nn.ModuleList([Block(15), Block(15)])
        self.unused = nn.Linear(15, 15)
        self.out = nn.Linear(15, 3)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        h = self.branches[self.global_step % 2](self.inp(x))
        loss = F.mse_loss(self.out(h), y)
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)


def regression_dataset(n: int, seed: int = 3) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 7, generator=g), torch.randn(n, 3, generator=g))


def image_dataset(n: int, seed: int = 4) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 3, 9, 9, generator=g), torch.randint(0, 3, (n,), generator=g))


def _muon_and_rest(module: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """The usual Muon recipe: the blocks' matrices for Muon, everything else (embeddings, norms) for AdamW."""
    named = list(module.named_parameters())
    matrices = [p for n, p in named if n.startswith("gpt.blocks.") and p.ndim == 2]
    rest = [p for n, p in named if not (n.startswith("gpt.blocks.") and p.ndim == 2)]
    return matrices, rest


class MuonGPT(ParityModule):
    """Manual optimisation with two optimizers: Muon on the blocks' matrices, AdamW on the rest."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.gpt = TinyGPT(n_layer=3)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        muon, adamw = self.optimizers()
        loss = self.gpt.loss(batch)
        self.manual_backward(loss)
        muon.step()
        adamw.step()
        muon.zero_grad()
        adamw.zero_grad()
        self.losses.append(loss.detach().clone())

    def configure_optimizers(self) -> list:
        matrices, rest = _muon_and_rest(self)
        return [
            torch.optim.Muon(matrices, lr=0.02, weight_decay=0.1, momentum=0.95),
            torch.optim.AdamW(rest, lr=3e-3, weight_decay=0.0),
        ]


class AdafactorGPT(ParityModule):
    """Adafactor alone: factored second moments for the matrices, unfactored for the norms."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = TinyGPT(n_layer=3)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self.gpt.loss(batch)
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adafactor(self.parameters(), lr=1e-2, weight_decay=0.01)
