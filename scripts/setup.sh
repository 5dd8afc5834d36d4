#!/usr/bin/env bash
# Set up the project: a virtualenv at .venv (unless one is already active) with the package,
# its test, plot, Hugging Face and docs extras. Safe to run again; it only installs what is missing.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ -z "${VIRTUAL_ENV:-}" ]; then
  [ -x .venv/bin/python ] || python3 -m venv .venv
  # shellcheck disable=SC1091
  . .venv/bin/activate
fi
# torch first, pinned to the release we test: where a CPU wheel of it is at hand, pip takes it
# instead of downloading a multi-GB CUDA build, and a CUDA build of the same release that is
# already installed satisfies the pin and stays.
python -m pip install -q --disable-pip-version-check "torch==2.13.0"
python -m pip install -q --disable-pip-version-check -e ".[test,plot,hf,docs]"
# litgpt's models for the Fabric tests and example (pinned; without its own pins, which would replace ours)
python -m pip install -q --disable-pip-version-check --no-deps "litgpt==0.5.13" "psutil==7.2.2"
