#!/usr/bin/env bash
# The test suite on a fresh machine: install raydl with its test extras into .venv, lint (ruff), then pytest.
# pytest's own exit code is kept, so "no tests collected" (5) fails the run.
#
# Strict skips (RAYDL_TEST_STRICT_SKIPS=1 unless set): a test may skip only for what this machine's
# hardware lacks (tests/conftest.py ALLOWED_SKIPS); a skip for anything this command installs (libfabric,
# the C kernels, torch, DALI's wds2idx) or for a missing ../shared/data beside the checkout fails the run.
# The fuzz targets get a fresh seed each run, so runs add up; it is printed, and RAYDL_FUZZ_SEED=<it>
# replays them.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
.venv/bin/ruff check --quiet .
.venv/bin/ruff format --check --quiet .
export RAYDL_TEST_STRICT_SKIPS="${RAYDL_TEST_STRICT_SKIPS:-1}"
export RAYDL_FUZZ_SEED="${RAYDL_FUZZ_SEED:-$(od -An -N4 -tu4 /dev/urandom | tr -d ' ')}"
echo "test: RAYDL_FUZZ_SEED=$RAYDL_FUZZ_SEED (the fuzz targets' seed; set it to replay this run's fuzzing)"
echo "test: RAYDL_TEST_STRICT_SKIPS=$RAYDL_TEST_STRICT_SKIPS"
# Two pytest processes (pytest-xdist), each test module whole in one of them: most tests wait on Ray, servers
# and subprocesses, so two processes fill a 2-core machine. RAYDL_TEST_PROCESSES=0 runs them in this one.
PROCESSES="${RAYDL_TEST_PROCESSES:-2}"
echo "test: RAYDL_TEST_PROCESSES=$PROCESSES"
if [ "$PROCESSES" = "0" ]; then
    exec .venv/bin/python -m pytest "$@"
fi
exec .venv/bin/python -m pytest -n "$PROCESSES" --dist loadfile "$@"
