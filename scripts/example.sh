#!/usr/bin/env bash
# Set up, then fine-tune the example GPT fully sharded (stage 3) on 2 CPU ranks: progress, perplexity
# before and after, samples, and the budget (memory per rank, communication per step).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
[ -n "${VIRTUAL_ENV:-}" ] || . .venv/bin/activate
export OMP_NUM_THREADS=1
python -m lightning_shardlab.examples.finetune "$@"
