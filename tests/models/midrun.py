"""Training code that changes the parameters after setup: freezing in a hook, Lightning's finetuning and pruning
callbacks, a parametrization registered mid-run. One model, four ways of changing it."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import BackboneFinetuning, ModelPruning
from torch import Tensor, nn
from torch.nn.utils.parametrizations import weight_norm

from tests.models.basic import Block

MODES = ("freeze", "finetune", "prune", "weight_norm")


class MidRunNet(L.LightningModule):
    """A stem, a ``backbone`` of two blocks (odd widths) and a head; every parameter in one AdamW with weight
    decay (``finetune``: the trainable ones, the backbone joins later). Records the local loss each step and
    checks, inside ``training_step`` and between steps, that the optimizer holds exactly the module's parameter
    objects, with their real shapes."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.stem = nn.Linear(7, 15)
        self.backbone = nn.Sequential(Block(15), Block(15))
        self.head = nn.Linear(15, 3)
        self.losses: list[Tensor] = []
        self.ids: set[int] = set()
        self.identity_checks = 0
        self.retired: Tensor | None = None

    def on_train_batch_start(self, batch: object, batch_idx: int) -> None:
        if self.mode == "freeze":  # frozen for the first three steps, then trained again: the first block, and
            # half of the second (its other half stays trainable: the two share a flat parameter)
            self.backbone[0].requires_grad_(self.global_step >= 3)
            self.backbone[1].l1.requires_grad_(self.global_step >= 3)

    def on_train_batch_end(self, outputs: object, batch: object, batch_idx: int) -> None:
        self._check_identity()  # between steps, too

    def on_train_epoch_start(self) -> None:
        if self.mode == "weight_norm" and self.current_epoch == 1:
            self.retired = self.head.weight  # the optimizer keeps it; the module computes from two new parameters
            with self._gathered():
                weight_norm(self.head)

    def _gathered(self) -> AbstractContextManager[None]:
        """What changing a parameter's values needs at stage 3 (every rank holds a slice between steps)."""
        gathered = getattr(self.trainer.strategy, "gathered_params", None)
        return gathered([self.head], writeback=True) if gathered is not None else nullcontext()

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        self._check_identity()
        x, y = batch
        loss = F.mse_loss(self.head(self.backbone(torch.tanh(self.stem(x)))), y)
        self.losses.append(loss.detach().clone())
        return loss

    def _check_identity(self) -> None:
        mine = {id(p) for p in self.parameters()} | {id(self.retired)}
        held = [p for opt in self.trainer.optimizers for g in opt.param_groups for p in g["params"]]
        assert all(id(p) in mine for p in held), "an optimizer holds a tensor that is not a module parameter"
        for name, p in self.named_parameters():  # the real shape, whatever the stage (pruning renames to *_orig)
            assert p.shape == self._shapes.get(name.removesuffix("_orig"), p.shape), name
        self.ids |= {id(p) for p in self.parameters()}
        self.identity_checks += 1

    def on_fit_start(self) -> None:
        self._shapes = {n.removesuffix("_orig"): p.shape for n, p in self.named_parameters()}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=2e-2, weight_decay=0.1)


def callbacks(mode: str) -> list[L.Callback]:
    if mode == "finetune":
        return [BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_ratio_lr=0.5, verbose=False)]
    if mode == "prune":  # with its defaults: global L1 pruning of every weight and bias, the lottery-ticket reset
        return [ModelPruning("l1_unstructured", amount=0.3, verbose=0)]
    return []


def midrun_dataset(n: int, seed: int = 5) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(torch.randn(n, 7, generator=g), torch.randn(n, 3, generator=g))
