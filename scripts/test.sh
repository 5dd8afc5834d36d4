#!/usr/bin/env bash
# Set up, check style and the import layers, then run the whole test suite
# (CPU ranks on gloo; tests marked `gpu` skip without a GPU).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
[ -n "${VIRTUAL_ENV:-}" ] || . .venv/bin/activate
export OMP_NUM_THREADS=1
# the house rules first (seconds): formatting, lint, and imports that run one way (docs/design.md)
ruff format --check --quiet .
ruff check --quiet .
lint-imports --no-cache > /dev/null || lint-imports --no-cache  # quiet when the contracts hold
python -m pytest -q -p no:cacheprovider tests "$@"
