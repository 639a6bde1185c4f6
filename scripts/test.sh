#!/usr/bin/env bash
# The test suite on a fresh machine: install raydl with its test extras into .venv, lint (ruff), then pytest.
# pytest's own exit code is kept, so "no tests collected" (5) fails the run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
.venv/bin/ruff check --quiet .
.venv/bin/ruff format --check --quiet .
exec .venv/bin/python -m pytest "$@"
