#!/usr/bin/env bash
# Create .venv (Python 3.11) and install the project with its test extras. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
if ! .venv/bin/python -c "import megatron_hexi, planner, megatron.core, pytest, jsonschema" 2>/dev/null \
   || [ setup.py -nt .venv/.hexi-installed ]; then
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null
  .venv/bin/python -m pip install -q -e ".[test]"
  touch .venv/.hexi-installed
fi
