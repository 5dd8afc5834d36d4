#!/usr/bin/env bash
# Set up, check style and the import layers, then run the whole test suite
# (CPU ranks on gloo; tests marked `gpu` skip without a GPU); the 15 slowest tests are listed at the end.
#   bash scripts/test.sh --quick     the smoke tier (tests marked `quick`): a few minutes, for the inner loop
#   bash scripts/test.sh -k budget   any other arguments go to pytest
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
[ -n "${VIRTUAL_ENV:-}" ] || . .venv/bin/activate
export OMP_NUM_THREADS=1
# the house rules first (seconds): formatting, lint, and imports that run one way (docs/design.md)
ruff format --check --quiet .
ruff check --quiet .
lint-imports --no-cache > /dev/null || lint-imports --no-cache  # quiet when the contracts hold
marker=()
if [ "${1:-}" = "--quick" ]; then
  shift
  marker=(-m quick)
fi
python -m pytest -q -p no:cacheprovider --durations=15 "${marker[@]}" tests "$@"
