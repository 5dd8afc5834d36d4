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
        sampler = DistributedSampler(self.dataset, num_replicas=self.trainer.world_size,
                                     rank=self.trainer.global_rank, shuffle=False)
        return DataLoader(self.dataset, batch_size=self.batch_size, sampler=sampler)

    def train_dataloader(self) -> DataLoader:
        return self._loader()

    val_dataloader = test_dataloader = predict_dataloader = train_dataloader


def global_batches(dataset: TensorDataset, local_batch: int, world_size: int) -> list[tuple[Tensor, ...]]:
    """The batches a DistributedSampler(shuffle=False) run covers, step by step, as one global batch."""
    step = local_batch * world_size
    return [tuple(t[i : i + step] for t in dataset.tensors) for i in range(0, len(dataset) - step + 1, step)]


# ---- models for the DDP parity matrix (the ladder issue) ----


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
        optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                      lr=3e-3)
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


# ---- a model built in configure_model (on the meta device under shardlab) ----


class WideBlocks(L.LightningModule):
    """Only shapes until setup: ``configure_model`` builds it, each module initialises itself in
    ``reset_parameters`` (torch's layers do), so an eager build from the same seed gives the same values."""

    def __init__(self, width: int = 64, depth: int = 4, lr: float = 1e-3) -> None:
        super().__init__()
        self.width, self.depth, self.lr = width, depth, lr
        self.blocks: nn.ModuleList | None = None

    def configure_model(self) -> None:
        if self.blocks is not None:
            return
        self.inp = nn.Linear(7, self.width)
        self.blocks = nn.ModuleList([Block2(self.width) for _ in range(self.depth)])
        self.norm = nn.LayerNorm(self.width)
        self.out = nn.Linear(self.width, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(self.norm(h))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class Block2(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.l1 = nn.Linear(d, d)
        self.l2 = nn.Linear(d, d)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.l2(torch.relu(self.l1(x)))


# ---- models a new user brings: mixture-of-experts routing, blocks that run on some ranks only ----


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


# ---- containers iterated in different ways (the default unit policy reads the loops) ----


class Looped(nn.Module):
    """Three same-class blocks; each subclass runs them its own way (the policy reads the class's code)."""

    def __init__(self, container: str = "list") -> None:
        super().__init__()
        blocks = [Block(4) for _ in range(3)]
        self.layers = nn.ModuleDict({str(i): b for i, b in enumerate(blocks)}) if container == "dict" else nn.ModuleList(blocks)


class DictValues(Looped):
    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers.values():
            x = layer(x)
        return x


class Checkpointed(Looped):
    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            if self.training:
                x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
            else:
                x = layer(x)
        return x


class Reused(Looped):
    def forward(self, x: Tensor) -> Tensor:
        for _ in range(2):
            for layer in self.layers:
                x = layer(x)
        return x


class SkipsOne(Looped):
    def forward(self, x: Tensor) -> Tensor:
        for i, layer in enumerate(self.layers):
            if i == 1:
                continue
            x = layer(x)
        return x


class ByIndex(Looped):
    def forward(self, x: Tensor) -> Tensor:
        return self.layers[int(x.sum() > 0)](x)
