#!/usr/bin/env bash
# Set up and run the whole test suite (CPU only; starts a localhost Slurm for the Slurm tests).
#   bash tools/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup_env.sh
exec .venv/bin/python -m pytest tests -q "$@"
