"""A small GPT as a LightningModule, in nanoGPT's shape (github.com/karpathy/nanoGPT, model.py).

Token and position embeddings, pre-norm transformer blocks, a final LayerNorm and an output head tied
to the token embedding. The blocks sit in ``self.blocks`` (an ``nn.ModuleList``): the shardlab strategy's
default policy makes each block a unit, and the embeddings, final norm and head form the root unit.

Nothing here knows about sharding: the same class trains with ``strategy="auto"``, ``"ddp"`` or
``"shardlab"``. Parameters keep their objects, names and shapes under every stage; what stage 3 changes is
that between steps their values are spread over the ranks, so ``configure_optimizers`` chooses the weight
decay groups below by module type and name (nanoGPT's ``p.dim() >= 2`` would choose the same) and never
by looking at values.
"""

from __future__ import annotations

import math

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics.text import Perplexity


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool) -> None:
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"`n_embd={n_embd}` must be a multiple of `n_head={n_head}`.")
        self.n_head = n_head
        self.dropout = dropout
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape  # (batch, time, channels)
        q, k, v = self.qkv(x).split(c, dim=2)  # 3 x (b, t, c)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))  # (b, h, t, c/h)
        dropout = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)  # (b, h, t, c/h)
        y = y.transpose(1, 2).reshape(b, t, c)  # (b, t, c)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    def __init__(self, n_embd: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.proj = nn.Linear(4 * n_embd, n_embd, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))  # (b, t, c)


class Block(nn.Module):
    """Pre-norm: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, bias)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = MLP(n_embd, dropout, bias)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))  # (b, t, c)
        return x + self.mlp(self.ln_2(x))  # (b, t, c)


class WarmupCosine:
    """LR multiplier: linear warm-up to 1 over ``warmup`` steps, then cosine down to ``floor`` at ``total``.

    A small class rather than a closure so ``LambdaLR.state_dict()`` saves its numbers in checkpoints.
    """

    def __init__(self, warmup: int, total: int, floor: float) -> None:
        self.warmup, self.total, self.floor = warmup, max(total, 1), floor

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        progress = min((step - self.warmup) / max(self.total - self.warmup, 1), 1.0)
        return self.floor + (1 - self.floor) * 0.5 * (1 + math.cos(math.pi * progress))


class GPT(L.LightningModule):
    """A decoder-only transformer language model.

    Args:
        vocab_size: number of token ids (256 for the byte-level tokenizer of ``examples/text.py``).
        block_size: longest context, in tokens.
        n_layer, n_head, n_embd: depth, attention heads, width.
        dropout: dropout probability (0.0: none, as for small fine-tunes).
        bias: biases in the linear layers and LayerNorms (nanoGPT's default is without).
        lr, weight_decay, beta1, beta2: AdamW; weight decay applies to the weights of linear and
            embedding layers only, never to biases or LayerNorm weights.
        warmup_steps, min_lr_ratio: linear warm-up, then cosine decay to ``lr * min_lr_ratio`` at the
            last step (``trainer.estimated_stepping_batches``).
        init_from: path of a full, unsharded Lightning checkpoint or plain state dict to start from
            (loaded strictly, on every rank, when the module is built).
    """

    def __init__(
        self,
        vocab_size: int = 256,
        block_size: int = 128,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.0,
        bias: bool = False,
        lr: float = 2e-3,
        weight_decay: float = 0.1,
        beta1: float = 0.9,
        beta2: float = 0.95,
        warmup_steps: int = 20,
        min_lr_ratio: float = 0.1,
        init_from: str | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList([Block(n_embd, n_head, dropout, bias) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one parameter, two names
        self.val_ppl = Perplexity()
        self._init_weights(n_layer)
        if init_from is not None:
            self.load_weights(init_from)

    def _init_weights(self, n_layer: int) -> None:
        """nanoGPT's init: N(0, 0.02), residual projections scaled by 1/sqrt(2 * n_layer) (GPT-2 paper)."""
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * n_layer))
            elif p.dim() >= 2:
                nn.init.normal_(p, std=0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def load_weights(self, path: str) -> None:
        """Load a full Lightning checkpoint (its ``state_dict``) or a plain state dict, strictly."""
        state = torch.load(path, map_location="cpu", weights_only=True)
        self.load_state_dict(state.get("state_dict", state), strict=True)

    # ---- the model ----

    def forward(self, idx: Tensor) -> Tensor:
        b, t = idx.shape  # (batch, time) token ids
        if t > self.hparams.block_size:
            raise ValueError(f"sequence of {t} tokens is longer than block_size={self.hparams.block_size}.")
        pos = torch.arange(t, device=idx.device)  # (t,)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (b, t, c)
        for block in self.blocks:
            x = block(x)  # (b, t, c)
        return self.lm_head(self.ln_f(x))  # (b, t, vocab)

    @torch.no_grad()
    def generate(
        self,
        idx: Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Extend ``idx`` (b, t) by ``max_new_tokens`` tokens; ``temperature=0`` is greedy.

        Call it in eval mode. Under a sharded strategy every forward gathers parameters, so every rank
        must call ``generate`` with the same arguments (the same number of forward calls).
        """
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.hparams.block_size :])[:, -1, :]  # (b, vocab)
            if temperature == 0:
                idx_next = logits.argmax(dim=-1, keepdim=True)  # (b, 1)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]  # (b, 1)
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                idx_next = torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)  # (b, 1)
            idx = torch.cat([idx, idx_next], dim=1)  # (b, t + 1)
        return idx

    # ---- training and validation ----

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch  # (b, t), (b, t)
        logits = self(x)  # (b, t, vocab)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch  # (b, t), (b, t)
        logits = self(x)  # (b, t, vocab)
        self.log("val_loss", F.cross_entropy(logits.flatten(0, 1), y.flatten()), prog_bar=True, sync_dist=True)
        self.val_ppl.update(logits, y)  # summed over all tokens of all ranks when computed
        self.log("val_ppl", self.val_ppl, prog_bar=True, sync_dist=True)

    def configure_optimizers(self) -> dict:
        hp = self.hparams
        optimizer = torch.optim.AdamW(self.param_groups(), lr=hp.lr, betas=(hp.beta1, hp.beta2))
        schedule = WarmupCosine(hp.warmup_steps, int(self.trainer.estimated_stepping_batches), hp.min_lr_ratio)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def param_groups(self) -> list[dict]:
        """Weight decay for the weights of linear and embedding layers; none for biases and norms.

        Chosen by module type and parameter name (shapes would do too); never by values, which at stage 3 are
        spread over the ranks between steps.
        """
        decayed = {
            f"{path}.weight" for path, module in self.named_modules() if isinstance(module, (nn.Linear, nn.Embedding))
        }
        params = dict(self.named_parameters())  # a tied parameter appears once, under its first name
        decay = [p for name, p in params.items() if name in decayed]
        no_decay = [p for name, p in params.items() if name not in decayed]
        return [
            {"params": decay, "weight_decay": self.hparams.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
