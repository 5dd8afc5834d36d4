"""Hugging Face GPT-2 (``transformers.GPT2LMHeadModel``) as a LightningModule, trained like examples/gpt.py.

The weights come from ``pretrained``: a directory written by ``save_pretrained`` or a model name already in
the local Hugging Face cache, always loaded with ``local_files_only=True`` (nothing is downloaded). Or
``config`` builds a GPT-2 of any size from scratch: with ``vocab_size=256`` it trains on the byte tokens of
``examples/text.py`` as they are; a pretrained GPT-2 wants its own tokenizer there (``data.tokenizer``).

Under ``strategy="shardlab"`` the default unit policy makes each block ``model.transformer.h[i]`` a unit;
the token and position embeddings, the final LayerNorm and the head (tied to the token embedding: one
parameter, two names) form the root unit. ``transformers`` is optional: it is imported when the module is
built, with a hint to install it when it is missing.
"""

from __future__ import annotations

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn
from torchmetrics.text import Perplexity
from typing_extensions import override

from lightning_shardlab.checkpoint.export import HF_CONFIG_KEY
from lightning_shardlab.examples.gpt import GPT
from lightning_shardlab.examples.hf_local import from_local, require_transformers


def build_gpt2(pretrained: str | None, config: dict | None) -> nn.Module:
    """A ``GPT2LMHeadModel`` with fp32 parameters: loaded from ``pretrained``, or new from the ``config`` options."""
    if (pretrained is None) == (config is None):
        raise ValueError(
            f"HFGPT2 needs exactly one of `pretrained` or `config` (got pretrained={pretrained!r}, config={config!r})."
            " HINT: `pretrained: <local dir or cached name>` with `config: null` to fine-tune GPT-2's weights;"
            " `config: {n_layer: ..., ...}` with `pretrained: null` for a new model."
        )
    transformers = require_transformers("HFGPT2")
    if pretrained is not None:
        # fp32 whatever the saved dtype: the strategy keeps fp32 masters and makes its own compute copies.
        return from_local(transformers.GPT2LMHeadModel.from_pretrained, pretrained, "pretrained", dtype=torch.float32)
    unknown = sorted(set(config) - set(transformers.GPT2Config().to_dict()))
    if unknown:  # GPT2Config accepts any keyword silently: a typo would change nothing
        raise ValueError(f"`config` has keys GPT2Config does not know: {unknown}. HINT: see transformers.GPT2Config.")
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**config))


def check_vocab(model_vocab: int, data_vocab: int | None) -> None:
    """Token ids must fit the embedding; bytes fed to a pretrained GPT-2 train, but mean nothing to it."""
    if data_vocab is None:
        return
    if data_vocab > model_vocab:
        raise ValueError(
            f"the data's vocabulary ({data_vocab} ids) is larger than the model's (vocab_size={model_vocab})."
            " HINT: use the model's own tokenizer (data.tokenizer), or a config with a larger vocab_size."
        )
    if data_vocab == 256 and model_vocab != 256:
        rank_zero_warn(
            f"the data are bytes (256 ids) but the model has vocab_size={model_vocab}."
            " HINT: for a pretrained GPT-2 set data.tokenizer to its directory or cached name."
        )


class HFGPT2(L.LightningModule):
    """GPT-2 from ``transformers``, with the training interface of ``examples/gpt.py``.

    Args:
        pretrained: a local directory written by ``save_pretrained`` (e.g. ``gpt2/``) or a model name already in
            the local Hugging Face cache (``openai-community/gpt2``); loaded with ``local_files_only=True``.
        config: ``transformers.GPT2Config`` options for a new, randomly initialised model (give this or
            ``pretrained``, not both), e.g. ``{vocab_size: 256, n_positions: 128, n_layer: 4, n_head: 4, n_embd: 128}``.
        lr, weight_decay, beta1, beta2: AdamW; weight decay applies to the weights of linear (GPT-2's
            ``Conv1D``) and embedding layers only, never to biases or LayerNorm weights.
        warmup_steps, min_lr_ratio: linear warm-up, then cosine decay to ``lr * min_lr_ratio`` at the last step.
    """

    def __init__(
        self,
        pretrained: str | None = None,
        config: dict | None = None,
        lr: float = 3e-4,
        weight_decay: float = 0.1,
        beta1: float = 0.9,
        beta2: float = 0.95,
        warmup_steps: int = 20,
        min_lr_ratio: float = 0.1,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = build_gpt2(pretrained, config)
        self.val_ppl = Perplexity()

    @override
    def setup(self, stage: str) -> None:
        check_vocab(self.model.config.vocab_size, getattr(self.trainer.datamodule, "vocab_size", None))

    @override
    def forward(self, idx: Tensor) -> Tensor:
        t = idx.shape[1]  # idx: (batch, time) token ids
        if t > self.model.config.n_positions:
            raise ValueError(f"sequence of {t} tokens is longer than n_positions={self.model.config.n_positions}.")
        return self.model(input_ids=idx, use_cache=False).logits  # (b, t, vocab)

    # The steps and the optimizer are GPT's own: they use only self(x), self.log, self.val_ppl,
    # self.param_groups() and the hyperparameters both classes share (lr, beta1, beta2, warmup_steps, min_lr_ratio).
    @override
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """Keep the model's Hugging Face config beside its weights: ``shardlab export CKPT DIR --prefix model.``
        then writes ``config.json``, and ``AutoModelForCausalLM.from_pretrained(DIR)`` loads the fine-tune."""
        checkpoint[HF_CONFIG_KEY] = self.model.config.to_dict()

    training_step = GPT.training_step
    validation_step = GPT.validation_step
    configure_optimizers = GPT.configure_optimizers

    def param_groups(self) -> list[dict]:
        """Weight decay for the weights of linear, ``Conv1D`` and embedding layers; none for biases and norms.

        Chosen by module type and name, as in ``GPT.param_groups``: never by values, which at stage 3 are
        spread over the ranks between steps.
        """
        from transformers.pytorch_utils import Conv1D  # GPT-2's linear layer, with a transposed weight

        kinds = (nn.Linear, nn.Embedding, Conv1D)
        decayed = {f"{path}.weight" for path, module in self.named_modules() if isinstance(module, kinds)}
        params = dict(self.named_parameters())  # the tied head appears once, as model.transformer.wte.weight
        return [
            {"params": [p for name, p in params.items() if name in decayed], "weight_decay": self.hparams.weight_decay},
            {"params": [p for name, p in params.items() if name not in decayed], "weight_decay": 0.0},
        ]
