#!/usr/bin/env bash
# Set up, check style and the import layers, build the manual (mkdocs, strict), then run the whole test suite
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
else
  # the manual (mkdocs.yml, ~7 s): a broken link or anchor, a page missing from the nav, a benchmark file that is
  # not there or an API name that does not resolve fails the build; built into a temporary folder, then removed
  site="$(mktemp -d)"
  NO_MKDOCS_2_WARNING=1 mkdocs build --strict --quiet --site-dir "$site" || { rm -rf "$site"; exit 1; }
  rm -rf "$site"
fi
python -m pytest -q -p no:cacheprovider --durations=15 "${marker[@]}" tests "$@"
