"""Worked examples: a small GPT, a byte-level text data module, and the fine-tune script the README runs.

python -m lightning_shardlab.examples.finetune          # pretrain (once), then fine-tune fully sharded
shardlab fit --config configs/gpt_finetune_cpu.yaml     # the same model and data through LightningCLI
"""
