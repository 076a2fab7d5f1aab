#!/usr/bin/env bash
# Set up, check lint, format and types, and run the whole test suite (CPU only, on two workers;
# starts a localhost Slurm for the Slurm tests).
#   bash tools/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup_env.sh
# Configured in pyproject.toml; each prints one line when it passes. All three run, and any
# failure fails the command before the tests start.
status=0
.venv/bin/ruff check . || status=1
.venv/bin/ruff format --check . || status=1
# mypy's cache lives outside the checkout, like pip's: a fresh clone then checks in seconds instead
# of re-analysing torch's typed sources (over a minute). mypy validates every cached module
# against its source (size, then content hash), so a cache from another checkout is only reused
# where it still holds. MYPY_CACHE_DIR overrides the folder.
mypy_cache="${MYPY_CACHE_DIR:-${XDG_CACHE_HOME:-${HOME:-/tmp}/.cache}/megatron-hexi/mypy}"
MYPY_CACHE_DIR="$mypy_cache" .venv/bin/mypy || status=1
if [ "$status" != 0 ]; then
  echo "tools/test.sh: lint, format or type check failed (above)" >&2
  exit 1
fi
# Two pytest-xdist workers: while one worker's test waits (rendezvous, restarts, the localhost
# Slurm), the other's computes; a third makes the suite no faster (its CPU is the limit).
# `--dist loadfile` keeps each file's tests on one worker, and tests/conftest.py keeps tests/slurm
# and tests/data whole (their session fixtures). Later options win: `-n 0` runs the suite
# serially in this process. `--cpu-top 25` lists the tests that used the most CPU
# (tests/cpu_time.py): the wall-clock durations above it do not show where the CPU goes.
# Bytecode writing on: a module that tools/setup_env.sh did not compile is compiled by its first
# importer instead of by every process that imports it.
unset PYTHONDONTWRITEBYTECODE
exec .venv/bin/python -m pytest tests -q -n 2 --dist loadfile --cpu-top 25 "$@"
