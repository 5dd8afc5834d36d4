"""Worked examples: a small GPT, a byte-level text data module, and the fine-tune script the README runs.

python -m lightning_shardlab.examples.finetune          # pretrain (once), then fine-tune fully sharded
shardlab fit --config configs/gpt_finetune_cpu.yaml     # the same model and data through LightningCLI

gpt.py       ``GPT``: a small nanoGPT-style LightningModule (its ``Block`` is the unit the example shards by)
text.py      ``TextDataModule``: byte-level text, a user's file or a corpus Python ships
finetune.py  the README's main job: pretrain at stage 2, fine-tune at stage 3, with the budget and vitals
             (each fewer-bytes option by a flag: ``--reduce-dtype``, ``--gather-dtype``)
hf_gpt2.py   Hugging Face GPT-2 as a LightningModule (the ``hf`` extra)
hf_local.py  loading Hugging Face files from a local directory or cache only (nothing downloaded)
resumable.py a job that resumes by itself after torchrun restarts it or SIGTERM stops it (the restart recipe)
"""
