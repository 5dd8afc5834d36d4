#!/usr/bin/env bash
# Set up, then run the whole test suite (CPU ranks on gloo; tests marked `gpu` skip without a GPU).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
[ -n "${VIRTUAL_ENV:-}" ] || . .venv/bin/activate
export OMP_NUM_THREADS=1
python -m pytest -q -p no:cacheprovider tests "$@"
