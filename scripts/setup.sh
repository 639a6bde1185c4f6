#!/usr/bin/env bash
# Creates .venv (if missing) and installs raydl into it, editable, with the extras named in $1
# (e.g. "test"). Used by scripts/demo.sh and scripts/test.sh; safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
python="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    echo "setup: creating .venv with $($python --version)"
    "$python" -m venv .venv
fi
spec="."
[ -n "$extras" ] && spec=".[$extras]"
# torch: users bring their own build; tests pin the CPU wheel that this machine serves locally.
pins=()
[[ "$extras" == *test* ]] && pins+=("torch==2.13.0")
echo "setup: pip install -e $spec ${pins[*]:-}"
.venv/bin/python -m pip install -q --disable-pip-version-check -e "$spec" "${pins[@]}"
