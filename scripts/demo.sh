#!/usr/bin/env bash
# The main job on a fresh machine: install raydl into .venv, then `raydl demo` on a local Ray.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/raydl demo "$@"
